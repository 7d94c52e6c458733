"""How a region's weights reach the device, and the check that a buffer holds the ones asked for.

fp32 masters sit in pinned host memory (host_store), so a region is DMA'd as fp32 into a
small device staging chunk and cast to the compute dtype there, on the copy stream. PCIe
then carries 4 bytes per parameter instead of 2, but the host does no work at all: a
host-side cast would read 4 and write 2 bytes per parameter per fetch on the host memory
bus the optimizer is bound by. Unpinned or over-budget cases fall
back to a host cast thread into pinned staging. Two more sources skip the masters: a
resident region's device masters (resident_regions.py), and with option weight_shadow the
optimizer's page-locked copies in the compute dtype.

Device buffers are allocated on the compute stream at fetch time and filled on the copy
stream after an event; which region computes with which buffer, and when, is the
streamer's (streamer.py). `Inflight` records what each buffer was fetched from, so the
streamer can refuse one fetched for other parameters (`Inflight.check`).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch

from ..memory.host_store import host_views, is_page_locked
from ..memory.layout import FlatLayout, contiguous_spans
from ..optim.registry import by_owner, sole_owner
from .stream_context import StreamContext


@dataclass
class Inflight:
    """A region's weight buffer on its way to the device, and what it was fetched from:
    the very host parameters and their `_version` counters at the copy. Dynamo may call one
    graph for several modules (a graph break inside a layer), so a region index alone does
    not say whose weights a buffer holds; `holds` does."""

    flat: torch.Tensor
    nbytes: int
    params: list[torch.Tensor]
    versions: list[int]
    done: object = None  # torch.cuda.Event, or a Future resolving to one
    from_device_masters: bool = False  # a resident region: its host masters may be stale

    def fetched_from(self, host_params: list[torch.Tensor]) -> bool:
        """The buffer was fetched from exactly these parameter objects."""
        return len(self.params) == len(host_params) and all(a is b for a, b in zip(self.params, host_params))

    def holds(self, host_params: list[torch.Tensor]) -> bool:
        """The buffer was fetched from exactly these parameters, none written since."""
        return self.fetched_from(host_params) and self.versions == [p._version for p in host_params]

    def check(self, name: str, requested: list[torch.Tensor]) -> None:
        """The always-on safety net: the buffer region ``name`` is about to compute with was
        fetched from exactly the parameters its prefetch named, unchanged since the copy. A
        mismatch is a runtime bug that would train silently with another layer's or stale
        weights."""
        if self.holds(requested):
            return
        why = ("its parameters were written after the copy (versions "
               f"{self.versions} at the copy, {[p._version for p in requested]} now)") \
            if self.fetched_from(requested) else "the buffer holds other parameters (another module's weights)"
        raise RuntimeError(f"megatrain: region {name!r} would compute with weights it was not "
                           f"fetched for: {why}. This is a megatrain bug; please report it")

    def compare_with_masters(self, name: str, lay: FlatLayout, compute_dtype: torch.dtype) -> None:
        """megatrain.config.check_fetched_weights: every fetched weight equals its host
        master cast to the compute dtype, bit for bit (call after the compute stream's
        wait, so the copy into the buffer is complete)."""
        for view, p in zip(lay.views(self.flat.cpu()), self.params):
            if not torch.equal(view, p.detach().to(compute_dtype)):
                raise RuntimeError(
                    f"megatrain: region {name!r}: a fetched weight of "
                    f"shape {tuple(p.shape)} differs from its host master (megatrain.config."
                    f"check_fetched_weights)")


def host_copies_current(params: list) -> None:
    """Before a fetch from host memory: parameters another graph keeps resident (AdamW
    state on the device, updates="resident") have their newest values copied home."""
    for opt, ps in by_owner(params):
        opt.flush_resident(ps)


class WeightCopier:
    """Starts a region's fetch into a fresh device buffer counted in the pool, by the path
    its sources allow, and owns what those paths need: the device fp32 staging chunk of
    ``cast_chunk`` elements at most (counted in the pool once, dropped when the plan's
    buffers need the room: the planner does not count it), and on CUDA the host cast
    thread with its ring of ``staging_slots`` pinned buffers."""

    def __init__(self, ctx: StreamContext, compute_dtype: torch.dtype, cast_chunk: int,
                 staging_slots: int = 2):
        self._ctx = ctx
        self.device, self.pool, self.cuda = ctx.device, ctx.pool, ctx.cuda
        self.h2d_stream = ctx.h2d_stream
        self.compute_dtype = compute_dtype
        self.cast_chunk_numel = cast_chunk
        self.cast_chunk: torch.Tensor | None = None  # device fp32 staging
        self._cast_chunk_refused = False
        if self.cuda:
            # bf16 casts happen on one host thread, in prefetch order, into a ring of pinned
            # staging buffers; a buffer is rewritten only after its last copy completed.
            self._caster = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megatrain-h2d")
            self._staging: list[torch.Tensor | None] = [None] * max(staging_slots, 1)
            self._staging_free: list[torch.cuda.Event | None] = [None] * max(staging_slots, 1)
            self._staging_next = 0

    def start(self, region: int, host_params: list[torch.Tensor], lay: FlatLayout,
              resident, shadow: bool) -> Inflight:
        """Acquire the region's buffer and start filling it: from ``resident``'s device
        masters where it holds the region (a ResidentRegions, or None), else from host
        memory, from the optimizer's compute-dtype shadows where ``shadow`` and they are
        current (option weight_shadow)."""
        stats = self._ctx.stats
        nbytes = lay.numel * self.compute_dtype.itemsize
        if self.cast_chunk is not None and self.pool.live + nbytes > self.pool.budget:
            self._drop_cast_chunk()  # the plan's buffers come first; staging is a bonus
        self.pool.acquire(nbytes, f"prefetch of region {region}")
        flat = torch.empty(lay.numel, dtype=self.compute_dtype, device=self.device)
        spans = contiguous_spans([p.detach() for p in host_params], lay)
        stats.regions_fetched.append(region)
        entry = Inflight(flat, nbytes, list(host_params), [p._version for p in host_params])
        sources = resident.sources(region, host_params) if resident is not None else None
        if sources is not None:
            stats.fetch_paths["resident"] += 1
            entry.from_device_masters = True
            entry.done = self._copy_resident(flat, lay, sources)
            return entry
        host_copies_current(host_params)
        # PCIe bytes: the host tensors' own bytes when the device casts, else the flat's.
        stats.h2d_bytes += nbytes
        shadowed = self._shadow_spans(host_params, lay) if shadow else None
        if shadowed is not None:
            spans = shadowed
        if not self.cuda:
            stats.fetch_paths["cpu" if shadowed is None else "shadow"] += 1
            for off, n, src in spans:
                flat[off:off + n].copy_(src)
        else:
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(self.device))
            pinned = all(is_page_locked(src) for _, _, src in spans)
            if pinned and all(src.dtype == self.compute_dtype for _, _, src in spans):
                stats.fetch_paths["page-locked" if shadowed is None else "shadow"] += 1
                entry.done = self._copy_in(flat, spans, allocated, region)
            elif pinned and self._device_cast_chunk(lay.numel) is not None:
                stats.fetch_paths["device-cast"] += 1
                entry.done = self._copy_in_and_cast(flat, spans, allocated, region)
                stats.h2d_bytes += sum(n * src.element_size() for _, n, src in spans) - nbytes
            else:
                # pageable masters, or no device room for the cast chunk: cast on a host thread
                stats.fetch_paths["host-cast" if pinned else "host-cast (pageable)"] += 1
                entry.done = self._caster.submit(self._cast_and_copy_in, flat, spans, allocated, region)
        return entry

    def discard(self, entry: Inflight) -> None:
        """Drop a fetched buffer nobody will use, once no copy writes into it any more."""
        if self.cuda:
            done = entry.done.result() if isinstance(entry.done, concurrent.futures.Future) else entry.done
            done.synchronize()
        self.pool.release(entry.nbytes)

    def _shadow_spans(self, host_params: list, lay: FlatLayout) -> list | None:
        """Option weight_shadow: the spans of ``host_params``' page-locked copies in the
        compute dtype, which their megatrain.AdamW keeps current as it updates them
        (AdamW.keep_shadows; +2 B/param of host memory at bf16): the H2D then moves 2
        bytes a parameter instead of the fp32 master's 4, and nothing is cast on the
        device. None (read the masters) where the parameters have no single such owner or a
        shadow is stale. (Regions updated on the device never ask: each copy back would
        leave the shadow stale, so it would only cost memory.) The first fetch of a
        parameter allocates and writes its shadow."""
        opt = sole_owner(host_params)
        if opt is None:
            return None
        missing = [p for p in host_params if not opt.has_shadow(p)]
        if missing:
            fresh = FlatLayout.of([p.shape for p in missing])
            opt.keep_shadows(missing, host_views(fresh, self.compute_dtype, pin=self.cuda))
        sources = opt.shadow_sources(host_params)
        return None if sources is None else contiguous_spans(sources, lay)

    def _copy_resident(self, flat, lay, sources):
        """Cast the device masters of a resident region into its weight buffer: on the
        copy stream after the buffer's allocation and the masters' last updates (CUDA)."""
        views = lay.views(flat)
        if not self.cuda:
            for view, (master, _) in zip(views, sources):
                view.copy_(master)
            return None
        allocated = torch.cuda.Event()
        allocated.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(allocated)
            for event in {id(e): e for _, e in sources if e is not None}.values():
                self.h2d_stream.wait_event(event)
            for view, (master, _) in zip(views, sources):
                view.copy_(master)
            done = torch.cuda.Event()
            done.record(self.h2d_stream)
        return done

    def _copy_in(self, flat, spans, allocated, region):
        started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(allocated)
            started.record(self.h2d_stream)
            for off, n, src in spans:
                flat[off:off + n].copy_(src, non_blocking=True)
            done.record(self.h2d_stream)
        self._ctx.stats.transfers.append((region, started, done))
        return done

    def _device_cast_chunk(self, region_numel: int) -> torch.Tensor | None:
        """The device fp32 staging chunk, grown to min(cast_chunk, largest region) and
        counted in the pool once; None (host-cast fallback) when the budget has no room."""
        want = min(self.cast_chunk_numel, region_numel)
        have = self.cast_chunk.numel() if self.cast_chunk is not None else 0
        if want > have and not self._cast_chunk_refused:
            extra = (want - have) * 4
            if self.pool.live + extra > self.pool.budget:
                self._cast_chunk_refused = True  # keep the smaller chunk, or the fallback
            else:
                # The old chunk may still be read by queued copies: let them finish before
                # its memory goes back to the allocator (happens once per larger region).
                self.h2d_stream.synchronize()
                self.pool.acquire(extra, "device cast staging")
                self.cast_chunk = None
                self.cast_chunk = torch.empty(want, dtype=torch.float32, device=self.device)
        return self.cast_chunk

    def _drop_cast_chunk(self) -> None:
        """Give the staging chunk's bytes back (after queued copies are done with it) and
        use the host-cast path from now on: the planner did not count the chunk."""
        self.h2d_stream.synchronize()
        self.pool.release(self.cast_chunk.numel() * 4)
        self.cast_chunk, self._cast_chunk_refused = None, True

    def _copy_in_and_cast(self, flat, spans, allocated, region):
        """fp32 pinned host -> device fp32 chunk -> compute dtype, all on the copy stream
        (the chunk is reused in stream order, so one chunk serves every region)."""
        chunk = self.cast_chunk
        started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(allocated)
            started.record(self.h2d_stream)
            for off, n, src in spans:
                src = src.reshape(-1)
                for start in range(0, n, chunk.numel()):
                    k = min(chunk.numel(), n - start)
                    chunk[:k].copy_(src[start:start + k], non_blocking=True)
                    flat[off + start:off + start + k].copy_(chunk[:k])
            done.record(self.h2d_stream)
        self._ctx.stats.transfers.append((region, started, done))
        return done

    def _cast_and_copy_in(self, flat, spans, allocated, region):
        """On the host cast thread: cast into the next pinned staging buffer (once its last
        copy is done), then copy it to the device on the copy stream."""
        slot = self._staging_next
        self._staging_next = (slot + 1) % len(self._staging)
        if self._staging_free[slot] is not None:
            self._staging_free[slot].synchronize()
        need = flat.numel()
        buf = self._staging[slot]
        if buf is None or buf.numel() < need:
            buf = self._staging[slot] = torch.empty(need, dtype=self.compute_dtype, pin_memory=True)
        for off, n, src in spans:
            buf[off:off + n].copy_(src)
        started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(allocated)
            started.record(self.h2d_stream)
            flat.copy_(buf[:need], non_blocking=True)
            done.record(self.h2d_stream)
        self._ctx.stats.transfers.append((region, started, done))
        self._staging_free[slot] = done
        return done
