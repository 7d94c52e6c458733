"""The streaming runtime behind megatrain's transfer ops.

One `Streamer` serves one compiled graph pair (forward, backward). It owns:
- a host-to-device stream and a device-to-host stream beside the compute stream, ordered
  with events only (no `record_stream`: it fragments the caching allocator);
- the device pool accounting that enforces `gpu_memory`;
- the weight path: fp32 masters sit in pinned host memory (host_store), so a region is
  DMA'd as fp32 into a small device staging chunk and cast to the compute dtype there, on
  the copy stream. PCIe then carries 4 bytes per parameter instead of 2, but the host does
  no work at all: a host-side cast would read 4 and write 2 bytes per parameter per fetch
  on the host memory bus the optimizer is bound by (bench/results/NOTES.md). Unpinned or
  over-budget cases fall back to a host cast thread into pinned staging;
- pinned staging for gradients coming back, in GRAD_TRANSFER_DTYPE (fp32: upcast on the
  device, so the host optimizer runs torch's fused AdamW directly), one slab per region in
  flight (grad_slabs.py) so the host holds a few regions of gradients, not all of them;
- one hand-off thread that gives sealed regions to their optimizer, in arrival order, or
  with the backlog (``backlog="host"`` or ``"device"``) earliest deadline first, deferring
  the rest past the end of backward (deadlines.py); with ``"device"`` gradients that find
  no free slab wait on the device (grad_backlog.py).

Device buffers are allocated on the compute stream at prefetch time, filled on the copy
stream after an event, and handed to the graph at `wait`, after which the graph owns them:
Inductor frees them at their last use, in compute-stream order, so they can never be
recycled while a copy into them is in flight.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch

from . import graph_order, handoff_graphs
from .activation_offload import ActivationStore
from .device_updates import DeviceUpdates
from .deadlines import DeadlineQueue, Deadlines
from .grad_backlog import GradBacklog, Held
from .grad_copies import GradCopy, settle_snapshots
from .grad_ring import GradRing
from .grad_slabs import GradSlabs
from ..memory.host_store import (host_views, is_page_locked, release_cached_pinned_blocks,
                         release_unused_pinned_blocks)
from ..memory.layout import FlatLayout, contiguous_spans
from .. import config
from ..errors import UnsupportedError, format_bytes
from ..optim import device_update
from ..optim.registry import owner_of, sole_owner
from ..memory.pool import DevicePool, Reserve
from .resident_regions import ResidentRegions

# Gradients are upcast to fp32 on the GPU (part of the snapshot copy, free) and cross the
# link in fp32: twice bf16's bytes, but the host optimizer then runs torch's fused AdamW
# directly instead of upcasting chunk by chunk, and the host is the bottleneck. H200, 1.3B,
# 16k tokens, 8 optimizer threads: 0.535 s/step with fp32 against 0.578 with bf16
# (bench/train.py --optim-threads 8/bf16,8/fp32).
GRAD_TRANSFER_DTYPE = torch.float32

# Chunks of the gradient ring (grad_ring.py) when it is on: one being filled, one waiting,
# one being updated, and one of slack for the hand-off's latency.
GRAD_RING_CHUNKS = 4

# The slab key under which the backlog's pump fills a slab (one region at a time).
_PUMP = ("backlog",)

# fp32 elements per device staging chunk of the weight path (64 MiB): large enough that the
# cast kernel after each chunk's copy costs ~1% of the copy, small beside a layer.
CAST_CHUNK = 16 << 20


def cuda_cast_staging_bytes(region_numel: int, compute_dtype: torch.dtype) -> int:
    """`Streamer.cast_staging_bytes` on a CUDA device: the fp32 staging chunk the weight
    path casts from (none when it computes in fp32)."""
    return 0 if compute_dtype == torch.float32 else min(CAST_CHUNK, region_numel) * 4

# updates="resident": after this many whole steps of the graph alone were measured (the
# first one adopts and autotunes) the reserve may grow to what the last one left free, less
# this fraction of gpu_memory (Streamer.grow_reserve); from then on a measured step over
# gpu_memory shrinks it to peak this fraction below (Streamer.shrink_reserve).
MEASURED_STEP = 2
RESERVE_MARGIN = 1 / 16

_REGISTRY: list["Streamer"] = []
_LOCK = threading.Lock()
_last_begun: int | None = None  # the streamer whose step began last (grow_reserve)


def register(streamer: "Streamer") -> int:
    with _LOCK:
        _REGISTRY.append(streamer)
        streamer.index = len(_REGISTRY) - 1
        return streamer.index


def get(index: int) -> "Streamer":
    return _REGISTRY[index]


@dataclass
class _Inflight:
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


@dataclass
class _PendingGrad:
    device_grad: torch.Tensor | None
    staged: torch.Tensor
    out: torch.Tensor
    nbytes: int
    done: object = None


@dataclass
class StepStats:
    """Bytes moved and device memory seen during the last step (forward + backward)."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    pool_peak: int = 0
    cuda_peak: int | None = None
    cuda_base: int = 0
    regions_fetched: list = field(default_factory=list)
    kept_hits: int = 0  # backward regions that took their forward's kept weights (claim)
    early_hits: int = 0  # first regions found already fetched by the graph before
    early_misses: int = 0  # ... fetched for other parameters (or since written): fetched again
    optimizer_wait_s: float = 0.0  # host time blocked before a fetch on a pending update
    slab_wait_s: float = 0.0  # host time blocked for a free gradient slab (optimizer behind)
    deferred_regions: int = 0  # sealed regions whose update backward's end deferred (backlog)
    cast_wait_s: float = 0.0  # host time blocked on the host-cast thread before a wait
    fetch_paths: collections.Counter = field(default_factory=collections.Counter)  # how weights came in
    waits: list = field(default_factory=list)  # CUDA (region, before, after) event pairs
    transfers: list = field(default_factory=list)  # CUDA (region, started, done) on the copy stream
    computes: list = field(default_factory=list)  # CUDA (region, weights ready, evicted) on compute
    grad_copies: list = field(default_factory=list)  # CUDA (region, started, done) on the D2H stream
    # Host updates run from this step's begin_step to the next one's (those the last
    # backward deferred included), (region, start, end, parameters) on the host's
    # perf_counter clock, and when the step's phases began on that clock ("forward":
    # begin_step, "backward": the forward's end, "drained": backward's end).
    host_updates: list = field(default_factory=list)
    phase_starts: dict = field(default_factory=dict)

    def event_seconds(self, pairs: str) -> float:
        """Seconds covered by one list of (region, start, end) CUDA event pairs, e.g.
        "computes" or "grad_copies" (blocks until the last of them has completed)."""
        events = getattr(self, pairs)
        if not events:
            return 0.0
        events[-1][2].synchronize()
        return sum(a.elapsed_time(b) for _, a, b in events) / 1e3

    def h2d_busy_s(self) -> float:
        """Seconds the host-to-device stream spent on weight copies (and device casts)."""
        return self.event_seconds("transfers")

    def stall_by_region(self) -> dict[int, float]:
        """Seconds of compute-stream stall per region (see transfer_stall_s)."""
        if self.waits:
            self.waits[-1][2].synchronize()
        out: dict[int, float] = collections.defaultdict(float)
        for region, before, after in self.waits:
            out[region] += before.elapsed_time(after) / 1e3
        return dict(out)

    def transfer_stall_s(self) -> float:
        """Seconds the compute stream sat waiting for weights this step (CUDA events
        recorded around each wait; blocks until the last of them has completed)."""
        return sum(self.stall_by_region().values())

    def host_updates_by_phase(self) -> dict[str, dict[str, float]]:
        """Host updates by the phase (forward, backward, after backward) the host thread
        was in when each began: how many, their parameters and busy seconds. Why: whether
        the host's update rate falls while the forward's weight copies read host memory
        beside it, which decides what overlapping updates with the forward is worth (the
        device backlog's updates took twice as long at 1.3B; bench/results/NOTES.md). Host
        clock: a phase starts when the host thread got there, ahead of
        the GPU by what it has queued."""
        marks = sorted((t, name) for name, t in self.phase_starts.items())
        out: dict[str, dict[str, float]] = {}
        for _, start, end, params in self.host_updates:
            phase = next((name for t, name in reversed(marks) if t <= start), "between steps")
            row = out.setdefault(phase, {"updates": 0, "params": 0, "busy_s": 0.0})
            row["updates"] += 1
            row["params"] += params
            row["busy_s"] += end - start
        return out


class Streamer:
    def __init__(self, device: torch.device, compute_dtype: torch.dtype, budget: int,
                 params: list[torch.nn.Parameter], staging_slots: int = 2,
                 grad_slabs: int | None = None):
        self.device = device
        self.compute_dtype = compute_dtype
        self.params = params
        self.pool = DevicePool(budget)
        self.cuda = device.type == "cuda"
        self._inflight: dict[int, collections.deque[_Inflight]] = collections.defaultdict(collections.deque)
        # Forward weight buffers the plan keeps for their region's backward, with the host
        # parameters they hold (keep -> claim -> wait), and each region's host parameters
        # as last prefetched (what keep records).
        self._kept: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._claimed: dict[int, torch.Tensor] = {}
        self._host_params: dict[int, list[torch.Tensor]] = {}
        self._pending: list[_PendingGrad] = []
        self._layouts: dict[tuple, FlatLayout] = {}
        self.stats = StepStats()
        self.last_stats: StepStats | None = None
        self._computing: dict[int, torch.cuda.Event] = {}  # region -> its weights-ready event
        # The gradient fast path (expect_gradients / grad_to_optimizer): per-backward
        # counters, and one hand-off thread that waits for copies and feeds the optimizer.
        self._expect_param: dict[int, int] = {}
        self._expect_region: dict[int, int] = {}
        self._contrib: dict[int, list[GradCopy]] = collections.defaultdict(list)
        self._bound: dict[int, torch.Tensor] = {}  # param_id -> the parameter this backward
        self._region_seen: dict[int, int] = collections.defaultdict(int)
        self._ready: dict[int, list[int]] = collections.defaultdict(list)
        self._handoff: concurrent.futures.ThreadPoolExecutor | None = None
        self._handoffs: list[concurrent.futures.Future] = []
        self._in_flight: list[GradCopy] = []  # CUDA copies still holding their snapshot
        # Bytes of gradient snapshots, the newest excepted, that may wait for their copy
        # before the compute stream is made to (settle_snapshots); set beside the plan.
        self.snapshot_window = 0
        self._slabs = GradSlabs(pin=self.cuda, max_slabs=grad_slabs, overlap=self._host_lag_overlaps)
        self._ring: GradRing | None = None  # enable_grad_ring
        # Prefetch across graphs (graph_order.py): each phase's first fetch, and fetches
        # started early by the graph that ran before, with the parameters' versions then.
        self.index = -1
        self._phase, self._awaiting_first = "forward", True
        self._first: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self._early: dict[int, _Inflight] = {}
        # The safety net (wait): the parameters each queued prefetch asked for, per region,
        # and the regions' names for its error.
        self._requested: dict[int, collections.deque[list[torch.Tensor]]] = collections.defaultdict(
            collections.deque)
        self.region_names: dict[int, str] = {}
        self._cast_chunk: torch.Tensor | None = None  # device fp32 staging (weight path)
        self._cast_chunk_refused = False
        self.weight_shadow = False  # option weight_shadow: fetch from AdamW's bf16 shadows
        self.device_updates: DeviceUpdates | None = None  # regions whose AdamW runs here
        self.resident: ResidentRegions | None = None  # regions whose AdamW state lives here
        self._resident_claimed = False  # begin_step sends other graphs' residents home, once
        # grow_reserve's measurement: whole steps of this graph alone (begin/end_step)
        self._measurable, self._begun_since_end, self._measured_steps = False, 0, 0
        self._overran: int | None = None  # a measured peak over gpu_memory (shrink_reserve)
        self._overrun_warned = False
        self.reserve: Reserve | None = None  # what the plan leaves free (place_updates)
        # The backlog (enable_backlog): the forward's fetch order, by which sealed regions
        # are handed over (None: in arrival order, and backward's end waits for them all),
        # and the device side of backlog="device".
        self.deadlines: Deadlines | None = None
        self.backlog: GradBacklog | None = None
        self._defer_declined = False  # the last backward's optimizers would not defer
        # Sealed regions waiting for the hand-off thread, which serves one per task.
        self._sealed = DeadlineQueue(None)
        self._grad_bytes: dict[int, int] = {}  # region -> its gradients' slab reservation
        # Regions sealed but not yet handed to their optimizer, and the AdamW.defer promises
        # made for them when backward ended; the hand-off list. Guarded by _lock (the
        # backlog's pump runs on the hand-off thread).
        self._unsubmitted: dict[int, list[torch.Tensor]] = {}  # ticket -> params
        self._tickets = itertools.count()
        self._promised: dict[int, dict[int, object]] = {}
        self._lock = threading.Lock()
        self._pump_lock = threading.Lock()
        self.grad_transfer_dtype: torch.dtype | None = GRAD_TRANSFER_DTYPE  # None: compute dtype
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
            # bf16 casts happen on one host thread, in prefetch order, into a ring of pinned
            # staging buffers; a buffer is rewritten only after its last copy completed.
            self._caster = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megatrain-h2d")
            self._staging: list[torch.Tensor | None] = [None] * max(staging_slots, 1)
            self._staging_free: list[torch.cuda.Event | None] = [None] * max(staging_slots, 1)
            self._staging_next = 0
        self._autotune_pins_released = False  # drain: release_cached_pinned_blocks, once
        # Boundary activations the plan parks in host memory between the passes.
        self.activations = ActivationStore(device, getattr(self, "h2d_stream", None),
                                           getattr(self, "d2h_stream", None))

    # -- step boundaries -------------------------------------------------------------
    def begin_step(self) -> None:
        global _last_begun
        self._phase, self._awaiting_first = "forward", True
        # A step measures this graph's whole step only if no other graph began since this
        # one last did, and this graph runs once per step (not once per module).
        self._measurable = _last_begun in (None, self.index) and self._begun_since_end == 0
        _last_begun = self.index
        self._begun_since_end += 1
        if self.resident is not None and not self._resident_claimed:
            self._resident_claimed = True
            self._send_other_residents_home()
        if self._overran is not None:  # between steps: no update of this graph is pending
            self.shrink_reserve(self._overran)
            self._overran = None
        for flat, _ in self._kept.values():  # kept by a forward whose backward has not run
            self._release(flat)
        self._kept.clear()
        if self.device_updates is not None:
            self.device_updates.abandon()
        self.stats = StepStats()
        self.stats.phase_starts["forward"] = time.perf_counter()
        self.pool.reset_peak()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.stats.cuda_base = torch.cuda.memory_allocated(self.device)

    def end_step(self) -> None:
        self.stats.pool_peak = self.pool.peak
        measured = self._allocator_peak()
        if measured is not None:
            self.stats.cuda_peak = measured - self.stats.cuda_base
        self.last_stats = self.stats
        whole = self._measurable and _last_begun == self.index and self._begun_since_end == 1
        self._begun_since_end = 0
        if whole and measured is not None and self.resident is not None:
            self._measured_steps += 1
            if self._measured_steps >= MEASURED_STEP and measured > self.pool.budget:
                self._overran = measured  # the next step begins by sending regions home
            elif self._measured_steps == MEASURED_STEP:
                self.grow_reserve(measured)

    def _allocator_peak(self) -> int | None:
        """The device allocator's high-water mark since begin_step (every byte allocated,
        whoever holds it); None off CUDA, where only the pool's own count is known."""
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def _host_lag_overlaps(self) -> bool:
        """Whether a host optimizer lagging behind backward has GPU work to overlap, so
        that the gradient slabs may grow (grad_slabs.py): some regions' updates skip the
        host (resident state, device sites), or the host backlog defers updates into the
        next forward (unless the optimizers declined last time)."""
        bypass = ((self.resident is not None and self.resident.regions)
                  or (self.device_updates is not None and self.device_updates.regions))
        host_backlog = self.deadlines is not None and self.backlog is None
        return bool(bypass or (host_backlog and not self._defer_declined))

    def grow_reserve(self, measured_peak: int) -> None:
        """Lend resident regions what a measured step left free beyond the plan's proof.

        Why: the plan's peak is an upper bound, and a loose one where Inductor fuses what
        the planner's walk counts as separate tensors: at 1.3B/16k it counts three fp32
        [tokens, vocab] tensors in the loss's backward that Inductor never makes, ~5 GiB
        of the 12 GiB budget (bench/results/NOTES.md). Static shapes repeat the
        same step, so the second whole step's allocator peak (``measured_peak``: every
        byte allocated on the device at the step's high-water mark, whoever holds it; the
        first step also adopts resident state and autotunes) is what later steps need,
        device updates and backlog in flight included. The reserve grows here, once, to
        ``gpu_memory - (measured_peak - resident bytes held) - gpu_memory/16``; more
        candidate regions become resident, keeping room for one device-site update. Where
        the plan counts short instead, shrink_reserve gives room back."""
        if self.reserve is None or self.resident is None:
            return
        margin = int(self.pool.budget * RESERVE_MARGIN)
        total = self.pool.budget - (measured_peak - self.resident.held_bytes) - margin
        if total <= self.reserve.nbytes:
            return
        self.reserve.nbytes = total
        keep_free = 0
        if self.device_updates is not None:
            keep_free = max((device_update.held_bytes([self.params[p].shape for p in pids])
                             for r, pids in self.device_updates.regions.items()
                             if r not in self.resident.regions), default=0)
        self.resident.acquire(keep_free)
        if self.device_updates is not None:
            self.device_updates.forget(list(self.resident.regions))

    def shrink_reserve(self, measured_peak: int) -> None:
        """A measured step went over gpu_memory: the plan's peak, which the reserve was
        sized against, counted short (at 3B/16k with the fused loss the step's allocator
        peak was 20.2-21.5 GiB with a 20 GiB budget: bench/results/NOTES.md).
        The excess is what the step must shed to peak ``gpu_memory/16`` below the budget
        (the margin grow_reserve keeps): resident regions go home, the last admitted
        first, until their bytes cover it, and the reserve shrinks by the excess, so
        neither they nor other holders take the room again. Where the resident state
        cannot cover it, it warns once: the rest is the plan's, which a smaller
        gpu_memory (a leaner schedule) fixes."""
        if self.reserve is None or self.resident is None:
            return
        budget = self.pool.budget
        excess = measured_peak - (budget - int(budget * RESERVE_MARGIN))
        why = (f"a measured step peaked at {measured_peak} bytes ({format_bytes(measured_peak)}), "
               f"over gpu_memory={budget} bytes ({format_bytes(budget)})")
        held = self.reserve.live
        for region in reversed(list(self.resident.regions)):
            if held - self.reserve.live >= excess:
                break
            self.resident.demote(region, why)
        self.reserve.nbytes = max(self.reserve.live, self.reserve.nbytes - excess)
        short = excess - (held - self.reserve.live)
        if short > 0 and not self._overrun_warned:
            self._overrun_warned = True
            warnings.warn(
                f"megatrain: {why}, and no resident state is left to give back the other {short} "
                f"bytes ({format_bytes(short)}): this graph peaks higher than its plan predicts; pass "
                f"a gpu_memory about {short} bytes smaller to keep the device within {budget} bytes",
                RuntimeWarning, stacklevel=2)

    def layout(self, shapes) -> FlatLayout:
        key = tuple(tuple(s) for s in shapes)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = FlatLayout.of(shapes)
        return lay

    # -- weights in ------------------------------------------------------------------
    def fetch_now(self, param: torch.Tensor) -> torch.Tensor:
        """Unscheduled fetch (only reached when a graph runs without the transfer pass)."""
        _host_copies_current([param])
        return param.detach().to(self.device, self.compute_dtype, copy=True)

    def prefetch(self, region: int, host_params: list[torch.Tensor]) -> None:
        self._host_params[region] = host_params
        self._requested[region].append(host_params)
        if self._awaiting_first:
            self._first[self._phase] = (region, list(host_params))
            self._awaiting_first = False
        if self.deadlines is not None and self._phase == "forward":
            self.deadlines.learn(region)  # its deadline: when the forward fetches it
        t0 = time.perf_counter()
        self.wait_updates(host_params)
        self.stats.optimizer_wait_s += time.perf_counter() - t0
        early = self._early.pop(region, None)
        if early is not None:
            if early.holds(host_params):
                self._inflight[region].append(early)
                self.stats.early_hits += 1
                return
            # Another module's weights (dynamo reuses one graph for every layer a graph
            # break splits), or an update landed after the early fetch: fetch afresh.
            self.stats.early_misses += 1
            self._discard(early)
        self._inflight[region].append(self._start_fetch(region, host_params))

    def prefetch_next(self, phase: str) -> None:
        """End of this graph's schedule: start the first fetch of the graph that ran next
        last time (same step only), if the device budget has room beside what is live."""
        nxt = graph_order.finished((self.index, phase))
        if phase == "forward":
            self._phase, self._awaiting_first = "backward", True
            self.stats.phase_starts["backward"] = time.perf_counter()
        if nxt is not None:
            get(nxt[0])._fetch_early(nxt[1], beside=self)

    def _fetch_early(self, phase: str, beside: "Streamer") -> None:
        first = self._first.get(phase)
        if first is None or first[0] in self._early:
            return
        region, host_params = first
        nbytes = self.layout([p.shape for p in host_params]).numel * self.compute_dtype.itemsize
        live = self.pool.live + (beside.pool.live if beside is not self else 0)
        if live + nbytes > self.pool.budget:
            return
        self.wait_updates(host_params)
        self._early[region] = self._start_fetch(region, host_params)

    def _discard(self, entry: _Inflight) -> None:
        """Drop a fetched buffer nobody will use, once no copy writes into it any more."""
        if self.cuda:
            done = entry.done.result() if isinstance(entry.done, concurrent.futures.Future) else entry.done
            done.synchronize()
        self.pool.release(entry.nbytes)

    def _start_fetch(self, region: int, host_params: list[torch.Tensor]) -> _Inflight:
        lay = self.layout([p.shape for p in host_params])
        nbytes = lay.numel * self.compute_dtype.itemsize
        # This region's gradients come back in the transfer dtype (fp32 on the CPU path).
        grad_size = (self.grad_transfer_dtype or self.compute_dtype).itemsize if self.cuda else 4
        self._grad_bytes[region] = lay.numel * grad_size + 64 * len(host_params)
        self._slabs.reserve(self._grad_bytes[region])
        if self._cast_chunk is not None and self.pool.live + nbytes > self.pool.budget:
            self._drop_cast_chunk()  # the plan's buffers come first; staging is a bonus
        self.pool.acquire(nbytes, f"prefetch of region {region}")
        flat = torch.empty(lay.numel, dtype=self.compute_dtype, device=self.device)
        spans = contiguous_spans([p.detach() for p in host_params], lay)
        self.stats.regions_fetched.append(region)
        entry = _Inflight(flat, nbytes, list(host_params), [p._version for p in host_params])
        resident = self.resident.sources(region, host_params) if self.resident is not None else None
        if resident is not None:
            self.stats.fetch_paths["resident"] += 1
            entry.from_device_masters = True
            entry.done = self._copy_resident(flat, lay, resident)
            return entry
        _host_copies_current(host_params)
        # PCIe bytes: the host tensors' own bytes when the device casts, else the flat's.
        self.stats.h2d_bytes += nbytes
        shadow = self._shadow_spans(region, host_params, lay) if self.weight_shadow else None
        if shadow is not None:
            spans = shadow
        if not self.cuda:
            self.stats.fetch_paths["cpu" if shadow is None else "shadow"] += 1
            for off, n, src in spans:
                flat[off:off + n].copy_(src)
        else:
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(self.device))
            pinned = all(is_page_locked(src) for _, _, src in spans)
            if pinned and all(src.dtype == self.compute_dtype for _, _, src in spans):
                self.stats.fetch_paths["page-locked" if shadow is None else "shadow"] += 1
                entry.done = self._copy_in(flat, spans, allocated, region)
            elif pinned and self._device_cast_chunk(lay.numel) is not None:
                self.stats.fetch_paths["device-cast"] += 1
                entry.done = self._copy_in_and_cast(flat, spans, allocated, region)
                self.stats.h2d_bytes += sum(n * src.element_size() for _, n, src in spans) - nbytes
            else:
                # pageable masters, or no device room for the cast chunk: cast on a host thread
                self.stats.fetch_paths["host-cast" if pinned else "host-cast (pageable)"] += 1
                entry.done = self._caster.submit(self._cast_and_copy_in, flat, spans, allocated, region)
        return entry

    def _shadow_spans(self, region: int, host_params: list, lay: FlatLayout) -> list | None:
        """Option weight_shadow: the spans of ``host_params``' page-locked copies in the
        compute dtype, which their megatrain.AdamW keeps current as it updates them
        (AdamW.keep_shadows; +2 B/param of host memory at bf16): the H2D then moves 2
        bytes a parameter instead of the fp32 master's 4, and nothing is cast on the
        device. None (read the masters) where the parameters have no single such owner or a
        shadow is stale, and for regions updated on the device (each copy back would leave
        the shadow stale, so it would only cost memory). The first fetch of a parameter
        allocates and writes its shadow."""
        if self.device_updates is not None and region in self.device_updates.regions:
            return None
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
        self.stats.transfers.append((region, started, done))
        return done

    def _device_cast_chunk(self, region_numel: int) -> torch.Tensor | None:
        """The device fp32 staging chunk, grown to min(CAST_CHUNK, largest region) and
        counted in the pool once; None (host-cast fallback) when the budget has no room."""
        want = min(CAST_CHUNK, region_numel)
        have = self._cast_chunk.numel() if self._cast_chunk is not None else 0
        if want > have and not self._cast_chunk_refused:
            extra = (want - have) * 4
            if self.pool.live + extra > self.pool.budget:
                self._cast_chunk_refused = True  # keep the smaller chunk, or the fallback
            else:
                # The old chunk may still be read by queued copies: let them finish before
                # its memory goes back to the allocator (happens once per larger region).
                self.h2d_stream.synchronize()
                self.pool.acquire(extra, "device cast staging")
                self._cast_chunk = None
                self._cast_chunk = torch.empty(want, dtype=torch.float32, device=self.device)
        return self._cast_chunk

    def _drop_cast_chunk(self) -> None:
        """Give the staging chunk's bytes back (after queued copies are done with it) and
        use the host-cast path from now on: the planner did not count the chunk."""
        self.h2d_stream.synchronize()
        self.pool.release(self._cast_chunk.numel() * 4)
        self._cast_chunk, self._cast_chunk_refused = None, True

    def _copy_in_and_cast(self, flat, spans, allocated, region):
        """fp32 pinned host -> device fp32 chunk -> compute dtype, all on the copy stream
        (the chunk is reused in stream order, so one chunk serves every region)."""
        chunk = self._cast_chunk
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
        self.stats.transfers.append((region, started, done))
        return done

    def _cast_and_copy_in(self, flat, spans, allocated, region):
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
        self.stats.transfers.append((region, started, done))
        self._staging_free[slot] = done
        return done

    def wait(self, region: int, numel: int) -> torch.Tensor:
        queue = self._inflight[region]
        claimed = self._claimed.pop(region, None)
        if claimed is not None:  # the forward's buffer (claim): same master, same bits
            assert claimed.numel() == numel, (claimed.numel(), numel)
            if self.cuda:  # the region's compute starts now (stats.computes)
                now = torch.cuda.Event(enable_timing=True)
                now.record(torch.cuda.current_stream(self.device))
                self._computing[region] = now
            return claimed
        if not queue:
            raise RuntimeError(f"megatrain: wait for region {region} without a prefetch (schedule bug)")
        entry = queue.popleft()
        self._check_fetched(region, entry, self._requested[region].popleft())
        assert entry.flat.numel() == numel, (entry.flat.numel(), numel)
        if self.cuda:
            done = entry.done
            if isinstance(done, concurrent.futures.Future):
                t0 = time.perf_counter()
                done = done.result()
                self.stats.cast_wait_s += time.perf_counter() - t0
            stream = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(done)
            after.record(stream)
            self.stats.waits.append((region, before, after))
            self._computing[region] = after
        if config.check_fetched_weights and not entry.from_device_masters:
            self._compare_with_masters(region, entry)
        return entry.flat

    def _check_fetched(self, region: int, entry: _Inflight, requested: list[torch.Tensor]) -> None:
        """The always-on safety net: the buffer a region is about to compute with was fetched
        from exactly the parameters its prefetch named, unchanged since the copy. A mismatch
        is a runtime bug that would train silently with another layer's or stale weights."""
        if entry.holds(requested):
            return
        name = self.region_names.get(region, f"region {region}")
        why = ("its parameters were written after the copy (versions "
               f"{entry.versions} at the copy, {[p._version for p in requested]} now)") \
            if entry.fetched_from(requested) else "the buffer holds other parameters (another module's weights)"
        raise RuntimeError(f"megatrain: region {name!r} would compute with weights it was not "
                           f"fetched for: {why}. This is a megatrain bug; please report it")

    def _compare_with_masters(self, region: int, entry: _Inflight) -> None:
        """megatrain.config.check_fetched_weights: every fetched weight equals its host
        master cast to the compute dtype, bit for bit (after the compute stream's wait, so
        the copy into the buffer is complete)."""
        lay = self.layout([p.shape for p in entry.params])
        for view, p in zip(lay.views(entry.flat.cpu()), entry.params):
            if not torch.equal(view, p.detach().to(self.compute_dtype)):
                raise RuntimeError(
                    f"megatrain: region {self.region_names.get(region, region)!r}: a fetched weight of "
                    f"shape {tuple(p.shape)} differs from its host master (megatrain.config."
                    f"check_fetched_weights)")

    def evict(self, region: int, flat: torch.Tensor) -> None:
        self._release(flat)
        self._note_compute_end(region)

    def _release(self, flat: torch.Tensor) -> None:
        """A weight buffer's bytes go back to the budget (evicted, or a kept one unused)."""
        self.pool.release(flat.numel() * flat.element_size())

    def keep(self, region: int, flat: torch.Tensor) -> None:
        """The forward is done with `flat`; the plan keeps it for the region's backward,
        which claims it (its bytes stay counted until that backward's evict)."""
        self._kept[region] = (flat, self._host_params[region])
        self._note_compute_end(region)

    def claim(self, region: int, host_params: list[torch.Tensor]) -> None:
        """The backward of a region the plan keeps, in place of its prefetch: take the
        forward's buffer if it holds these very parameters; else fetch them now. Else
        happens when dynamo runs one graph for several modules (a graph break inside a
        layer loop: every layer's forward runs before the backwards, and each forward
        gives back the previous one's kept buffer), and the plan's memory is then that of
        fetching twice, which it also fits."""
        kept = self._kept.pop(region, None)
        if kept is not None and len(kept[1]) == len(host_params) \
                and all(a is b for a, b in zip(kept[1], host_params)):
            self._claimed[region] = kept[0]
            self.stats.kept_hits += 1
            early = self._early.pop(region, None)  # fetched ahead when a fallback went first
            if early is not None:
                self._discard(early)
            return
        if kept is not None:  # another module's weights
            self._release(kept[0])
        self.prefetch(region, host_params)

    def _note_compute_end(self, region: int) -> None:
        started = self._computing.pop(region, None)
        if started is not None:  # the region's compute: from its weights' arrival to here
            evicted = torch.cuda.Event(enable_timing=True)
            evicted.record(torch.cuda.current_stream(self.device))
            self.stats.computes.append((region, started, evicted))

    # -- gradients out to megatrain.AdamW (fast path) ----------------------------------
    def expect_gradients(self, per_param: dict[int, int], per_region: dict[int, int]) -> None:
        """How many gradient contributions one backward sends, per parameter and per region
        (a tied weight sends one per region that fetched it)."""
        self._expect_param = dict(per_param)
        self._expect_region = dict(per_region)
        for pid in per_param:
            handoff_graphs.note(self.params[pid], self.index)
        if self._handoff is None:
            self._handoff = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megatrain-grads")

    def grad_to_optimizer(self, grad: torch.Tensor, region: int, param_id: int,
                          param: torch.Tensor) -> None:
        """Hand `grad`, the gradient of `param` (graph slot `param_id`: the same graph may
        run for several modules, each with its own parameters), to `param`'s optimizer."""
        if self.resident is not None and self.resident.take(grad, region, param):
            self._count_in(region)  # updated on the device; a demoted region's rest goes home
            return
        if self.device_updates is not None:
            if param is not self.params[param_id]:
                raise UnsupportedError(
                    f"updates='device' with a graph that dynamo runs for several modules (slot "
                    f"{param_id} of region {region} got a parameter of shape {tuple(param.shape)} "
                    "other than the one it was compiled with; a graph break inside a repeated "
                    "layer does this): use updates='host', or remove the graph break")
            if self.device_updates.take(grad, region, param_id):
                return  # kept on the device for the region's device update
        dtype = grad.dtype if grad.device.type == "cpu" else self.grad_transfer_dtype or grad.dtype
        if self._ring is not None and self._ring_takes(param_id, param):
            self._to_ring(grad, param, region, dtype)
            self._count_in(region)
            return
        backlog = self.backlog
        if backlog is not None and self._region_seen.get(region, 0) == 0:
            # The region's first gradient: a free slab, else the backlog if the reserve has
            # room, else wait for a slab as without the backlog.
            nbytes = self._grad_bytes.get(region, 0)
            if not self._slabs.try_open(region) and nbytes:
                backlog.open(region, nbytes)
        if backlog is not None and backlog.holds(region):
            entry = GradCopy()  # filled when a slab takes the region (_pump)
            backlog.hold(region, grad, entry, dtype)
            self.stats.d2h_bytes += grad.numel() * dtype.itemsize
        else:
            entry = self._to_slab(grad, region, dtype)
        self._contrib[param_id].append(entry)
        self._bound[param_id] = param
        if len(self._contrib[param_id]) == self._expect_param[param_id]:
            self._ready[region].append(param_id)
        self._count_in(region)

    def _count_in(self, region: int) -> None:
        """One more gradient of ``region`` is out; with its last, the region's slab (if its
        gradients used one) goes to the hand-off."""
        backlog = self.backlog
        self._region_seen[region] += 1
        if self._region_seen[region] == self._expect_region[region]:
            del self._region_seen[region]  # the next backward counts afresh
            if self.cuda and not self._autotune_pins_released:
                release_unused_pinned_blocks()  # what autotuning this region's kernels left
            pids = self._ready.pop(region, [])
            if not pids and not self._slabs.is_open(region) and (backlog is None or not backlog.holds(region)):
                return  # all of the region's gradients went through the ring
            parts = [self._contrib.pop(i) for i in pids]
            params = [self._bound.pop(i) for i in pids]
            # A ticket, not the region id: a graph dynamo runs for several modules seals
            # the same region once per module.
            ticket = next(self._tickets)
            with self._lock:
                self._unsubmitted[ticket] = params
            if backlog is not None and backlog.holds(region):
                backlog.seal(region, (ticket, params, parts))
                self._pump()
                return
            slab = self._slabs.seal(region)
            # Contributions of tied weights still waiting for another region sit in this
            # slab too: the hand-off moves them out before it frees the slab.
            waiting = [e for c in self._contrib.values() for e in c if slab is not None and e.slab is slab]
            self._queue_handoff(region, (ticket, params, parts, slab, waiting, None))

    def _to_slab(self, grad: torch.Tensor, region: int, dtype: torch.dtype) -> GradCopy:
        """Copy one gradient into the region's host slab (waiting for a slab if none is
        free)."""
        t0 = time.perf_counter()
        staged, slab = self._slabs.carve(region, grad.shape, dtype)
        self.stats.slab_wait_s += time.perf_counter() - t0
        if grad.device.type == "cpu":
            entry = GradCopy(staged.copy_(grad), slab=slab)
        else:
            done, snapshot = self._copy_out_into(staged, grad, region)
            # Holding the snapshot keeps its device memory until the copy ends (no
            # record_stream); `_release_copied` lets go of it in stream order.
            entry = GradCopy(staged, done, snapshot, slab)
            self._in_flight.append(entry)
            self._release_copied()
        return entry

    # -- the gradient ring (grad_ring.py) ----------------------------------------------
    def _ring_takes(self, param_id: int, param: torch.Tensor) -> bool:
        """Whether this gradient goes through the ring: one contribution per backward (a
        tied weight's are summed in a slab first), one graph handing it in, an optimizer
        that takes pieces."""
        return (self._expect_param[param_id] == 1 and param.is_contiguous()
                and owner_of(param) is not None
                and not handoff_graphs.several(param))

    def _to_ring(self, grad: torch.Tensor, param: torch.Tensor, region: int, dtype: torch.dtype) -> None:
        """Copy one gradient into the ring piece by piece (CUDA: from a device snapshot, on
        the D2H stream, as in _copy_out_into), handing each chunk to the optimizer as soon
        as it is full. A piece's copy is issued before its chunk can be handed off."""
        flat = grad.reshape(-1)
        n = flat.numel()
        ring = self._ring
        waited = ring.wait_s
        done = None
        if self.cuda:
            snapshot = flat.clone() if dtype == grad.dtype else flat.to(dtype)
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(self.device))
            self.d2h_stream.wait_event(produced)
        else:
            snapshot = flat
        start = 0
        while start < n:
            view, chunk = ring.carve(n - start, dtype)
            k = view.numel()
            if self.cuda:
                # Timed piece by piece: the host may wait for a free chunk between two
                # pieces, and a pair around the whole gradient counted that wait as copying
                # (the ring's copies read 2.4x slower that way on the H200).
                with torch.cuda.stream(self.d2h_stream):
                    started = torch.cuda.Event(enable_timing=True)
                    started.record(self.d2h_stream)
                    view.copy_(snapshot[start:start + k], non_blocking=True)
                    done = torch.cuda.Event(enable_timing=True)
                    done.record(self.d2h_stream)
                self.stats.grad_copies.append((region, started, done))
            else:
                view.copy_(snapshot[start:start + k])
            chunk.pieces.append((param, start, view, done))
            start += k
            full = ring.seal_if_full()
            if full is not None:
                self._hand_chunk(full)
        self.stats.slab_wait_s += ring.wait_s - waited
        self.stats.d2h_bytes += n * dtype.itemsize
        if self.cuda:
            self._in_flight.append(GradCopy(done=done, snapshot=snapshot))
            self._release_copied()

    def _hand_chunk(self, chunk) -> None:
        future = self._handoff.submit(self._hand_over_chunk, chunk)
        with self._lock:
            self._handoffs.append(future)

    def _hand_over_chunk(self, chunk) -> None:
        """On the hand-off thread: once the chunk's copies are done (one stream, in order:
        the last piece's event), give its pieces to their optimizers and go on; the chunk
        returns to the ring when they have consumed it. Pipelined, unlike a region slab's
        hand-off: the optimizer's FIFO already holds the next chunk's work while it updates
        this one, instead of idling while this thread wakes up to submit it (a ring makes
        ~80 hand-offs a step at 1.3B, against 26 regions). wait_handoffs waits for the
        updates and re-raises their errors."""
        futures = []
        try:
            done = chunk.pieces[-1][3]
            if done is not None:
                done.synchronize()
            by_owner: dict[int, tuple] = {}
            for p, start, view, _ in chunk.pieces:
                opt = owner_of(p)
                by_owner.setdefault(id(opt), (opt, []))[1].append((p, start, view))
            for opt, items in by_owner.values():
                futures.append(opt.submit_pieces(items))
        finally:
            self._release_chunk_after(chunk, futures)
            with self._lock:
                self._handoffs.extend(futures)

    def _release_chunk_after(self, chunk, futures: list) -> None:
        """Give `chunk` back to the ring once every one of `futures` is done (failed ones
        too: an error is re-raised by wait_handoffs, and the ring must not run dry)."""
        if not futures:
            self._ring.release(chunk)
            return
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._ring.release(chunk)

        for f in futures:
            f.add_done_callback(one_done)

    def _pump(self) -> None:
        """Send backlogged regions to the host while slabs are free, earliest deadline
        first (grad_backlog.py); a backward waiting for a slab gets it first. Called when a
        region joins the backlog, when a slab is released, and when backward ends."""
        with self._pump_lock:
            while self.backlog.peek() is not None and self._slabs.try_open(_PUMP, yield_to_waiters=True):
                held = self.backlog.take()
                self._copy_out_held(held)
                slab = self._slabs.seal(_PUMP)
                ticket, params, parts = held.payload
                self._queue_handoff(held.region, (ticket, params, parts, slab, [], held))

    def _copy_out_held(self, held: Held) -> None:
        """Carve the region's gradients in the slab opened for the pump and copy them
        there (CUDA: on the D2H stream after the backlog's copies on the compute stream)."""
        for view, entry in held.views:
            entry.staged, entry.slab = self._slabs.carve(_PUMP, view.shape, view.dtype)
        if not self.cuda:
            for view, entry in held.views:
                entry.staged.copy_(view)
            return
        started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device), torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(held.ready)
            started.record(self.d2h_stream)
            for view, entry in held.views:
                entry.staged.copy_(view, non_blocking=True)
            done.record(self.d2h_stream)
        self.stats.grad_copies.append((held.region, started, done))
        for _, entry in held.views:
            entry.done = done

    def _release_copied(self, everything: bool = False) -> None:
        """Drop device gradient snapshots whose device-to-host copy has completed, and the
        oldest of the rest in stream order beyond `snapshot_window` (settle_snapshots);
        ``everything``: all of them, the newest too, in stream order."""
        window = 0 if everything else self.snapshot_window
        self._in_flight = settle_snapshots(self._in_flight, window,
                                           torch.cuda.current_stream(self.device).wait_event,
                                           keep_newest=not everything)

    def _queue_handoff(self, region: int, args: tuple) -> None:
        """A sealed region waits for the hand-off thread, which takes the next one by
        deadline (in arrival order without the backlog) each time it is free."""
        parts = args[2]

        def copied() -> bool:
            return all(e.done is None or e.done.query() for c in parts for e in c)

        self._sealed.push(region, args, ready=copied)
        future = self._handoff.submit(self._hand_over_next)
        with self._lock:
            self._handoffs.append(future)

    def _hand_over_next(self) -> None:
        region, args = self._sealed.pop()  # one task per push: never empty
        self._hand_over(region, *args)

    def _hand_over(self, region: int, ticket: int, params: list[torch.Tensor], parts: list[list[GradCopy]],
                   slab, waiting: list[GradCopy], held: Held | None) -> None:
        """On the hand-off thread: hand one region's gradients to their optimizer, then
        free its slab (after moving out contributions that wait for another region) and
        let the backlog's next region have it. On error, fail the region's promises."""
        try:
            self._submit_gradients(region, ticket, params, parts, held)
            for entry in waiting:
                if entry.done is not None:
                    entry.done.synchronize()
                entry.staged, entry.slab = entry.staged.clone(), None
        except BaseException as e:
            with self._lock:
                self._unsubmitted.pop(ticket, None)
                promised = self._promised.pop(ticket, {})
            for d in promised.values():
                d.fail(e)
            raise
        finally:
            if held is not None:
                self.backlog.release(held)
            if slab is not None:
                self._slabs.release(slab)
            if self.backlog is not None:
                self._pump()

    def _submit_gradients(self, region: int, ticket: int, params: list[torch.Tensor],
                          parts: list[list[GradCopy]], held: Held | None) -> None:
        """Wait for the copies, sum tied contributions (in fp32), submit and wait until the
        optimizer has consumed them. A single contribution goes as it crossed the link (a
        narrower dtype is upcast by the optimizer in cache-sized chunks, by a p.grad fallback
        at once).
        Submits under the lock, with the region's promise if backward's end made one."""
        grads = []
        for contributions in parts:
            total = None
            for c in contributions:
                if c.done is not None:
                    c.done.synchronize()
                if len(contributions) == 1:
                    total = c.staged
                else:
                    total = c.staged.to(torch.float32, copy=True) if total is None else total.add_(c.staged)
            grads.append(total)
        if held is not None:
            self.backlog.release(held)  # on the host now: the device bytes go back
        futures, started = [], time.perf_counter()
        with self._lock:
            self._unsubmitted.pop(ticket, None)
            promised = self._promised.pop(ticket, {})
            for key, (opt, ps, gs) in _by_owner(params, grads).items():
                if opt is None:
                    # The optimizer this graph was compiled for is gone, or another graph
                    # hands in a gradient of `p` too: keep the gradient where any torch
                    # optimizer finds it, summed like autograd would; step() applies it.
                    for p, g in zip(ps, gs):
                        g = g.to(p.dtype, copy=True)  # its own memory: the slab is reused
                        p.grad = g if p.grad is None else p.grad.add_(g)
                    continue
                d = promised.get(key)
                futures.append(d.submit(gs) if d is not None else opt.submit(ps, gs))
        for f in futures:
            f.result()
        if futures:  # the worker's work on this region (one hand-off at a time)
            self.stats.host_updates.append((region, started, time.perf_counter(),
                                            sum(p.numel() for p in params)))

    def wait_handoffs(self) -> None:
        """Until every region of this backward has been handed over and consumed (the
        backlog's included: each hand-off pumps the next before it completes)."""
        while True:
            if self.backlog is not None:
                self._pump()
            with self._lock:
                futures, self._handoffs = self._handoffs, []
            if not futures:
                assert self.backlog is None or not len(self.backlog), "backlog left without a slab"
                break
            for f in futures:
                f.result()
        self._in_flight = []
        leftover = [i for i, c in self._contrib.items() if c]
        assert not leftover, f"gradients of parameters {leftover} never completed"

    def _defer_rest(self) -> bool:
        """End of backward with the backlog: promise every region not yet handed to its
        optimizer (AdamW.defer) so that backward can return now. False where an optimizer
        declines (its update is not immediate): then the caller waits for all hand-offs.
        Errors of hand-offs finished since the last backward surface here."""
        if self.backlog is not None:
            self._pump()
        with self._lock:
            self._defer_declined = False
            for ticket, params in self._unsubmitted.items():
                promised = self._promised.setdefault(ticket, {})
                for key, (opt, ps, _) in _by_owner(params, params).items():
                    if key not in promised:
                        d = opt.defer(ps) if opt is not None else None
                        if d is None:
                            self._defer_declined = True
                            return False
                        promised[key] = d
            self.stats.deferred_regions = len(self._unsubmitted)
            done = [f for f in self._handoffs if f.done()]
            self._handoffs = [f for f in self._handoffs if not f.done()]
        for f in done:
            f.result()
        # Slab-path copies still in flight: their device snapshots must not outlive
        # this backward (the plan does not count them in the next forward); released in
        # stream order, so the host need not wait for the copies.
        if self._in_flight:
            self._release_copied(everything=True)
        leftover = [i for i, c in self._contrib.items() if c]
        assert not leftover, f"gradients of parameters {leftover} never completed"
        return True

    def wait_updates(self, host_params: list[torch.Tensor]) -> None:
        """A region is never fetched before its pending update (from the last step) is done."""
        by_owner: dict[int, tuple] = {}
        for p in host_params:
            opt = owner_of(p)
            if opt is not None:
                by_owner.setdefault(id(opt), (opt, []))[1].append(p)
        for opt, ps in by_owner.values():
            opt.wait_params(ps)
        if self.device_updates is not None:
            self.device_updates.retire()

    # -- updates on the device (device_updates.py; the sites: compiler/update_sites.py) ---
    def place_updates(self, regions: dict[int, list[int]], reserve: int,
                      resident: dict[int, list[int]] | None = None) -> None:
        """Run the AdamW update of ``regions`` (region -> its parameter ids) on the device,
        their buffers in flight held within ``reserve`` bytes beside the plan; keep the
        AdamW state of ``resident`` regions on the device for good, their bytes taken from
        the reserve first (resident_regions.py). Resident bytes outlive this graph's step,
        which other graphs' plans do not count: every other streamer's go home."""
        streams = (self.h2d_stream, self.d2h_stream) if self.cuda else None
        self.reserve = Reserve(self.pool, reserve)
        if resident:
            self.resident = ResidentRegions(self.device, self.params, resident, self.reserve)
        self.device_updates = (DeviceUpdates(self.device, self.pool, self.params, streams, regions,
                                             self.reserve) if regions else None)

    def _send_other_residents_home(self) -> None:
        """Resident bytes outlive their graph's step and no other graph's plan counts them:
        before this graph's first step, every other graph's resident regions go home (at
        run time: demotion copies real tensors, which compile-time fake mode forbids)."""
        with _LOCK:
            others = [s for s in _REGISTRY if s is not self and s.resident is not None]
        for other in others:
            other.resident.demote_all("another compiled graph holds resident regions now")

    def enable_backlog(self, where: str, handoffs: list[tuple[int, int]]) -> None:
        """Hand sealed regions to the host optimizer earliest deadline first and defer
        those left at the end of backward into the next forward (deadlines.py); with
        ``where="device"`` also keep gradients that find no free slab on the device,
        within the reserve of place_updates (grad_backlog.py). ``handoffs``: the
        backward's (region, param id) hand-offs; there, regions holding part of a tied
        weight's gradient stay on the slab path."""
        assert where in ("host", "device"), where
        self.deadlines = Deadlines()
        self._sealed = DeadlineQueue(self.deadlines)
        if where == "device":
            assert self.reserve is not None, "place_updates first"
            counts = collections.Counter(p for _, p in handoffs)
            tied = {r for r, p in handoffs if counts[p] > 1}
            self.backlog = GradBacklog(self.device, self.reserve, tied, self.deadlines)

    def enable_grad_ring(self, chunk_bytes: int, chunks: int = GRAD_RING_CHUNKS) -> None:
        """Send untied gradients to their optimizer through a ring of fixed-size host chunks
        instead of region slabs (grad_ring.py): host memory for gradients becomes
        ``chunks x chunk_bytes`` whatever the largest region."""
        assert self.deadlines is None, "the backlog hands over whole regions: slabs only"
        if self._ring is None:
            self._ring = GradRing(chunk_bytes, chunks, pin=self.cuda)

    def cast_staging_bytes(self, region_numel: int) -> int:
        """Device bytes the weight path's cast staging may take beside the plan when the
        largest fetch is ``region_numel`` parameters (only CUDA casts on the device)."""
        return cuda_cast_staging_bytes(region_numel, self.compute_dtype) if self.cuda else 0

    def snapshot_window_bytes(self, region_numel: int) -> int:
        """The most bytes of older gradient snapshots worth letting wait for their copies
        (settle_snapshots) when the largest fetch is ``region_numel`` parameters: one
        region's gradients in the transfer dtype (only CUDA copies from snapshots)."""
        return region_numel * (self.grad_transfer_dtype or self.compute_dtype).itemsize if self.cuda else 0

    # -- gradients out -----------------------------------------------------------------
    def grad_to_host(self, grad: torch.Tensor, param_id: int) -> torch.Tensor:
        param = self.params[param_id]
        if grad.device.type == "cpu":
            return grad.to(param.dtype, copy=True)
        self._retire_done()
        nbytes = grad.numel() * grad.element_size()
        self.pool.acquire(nbytes, f"gradient of parameter {param_id}")
        staged, done, snapshot = self._copy_out(grad)
        out = staged if grad.dtype == param.dtype else torch.empty(grad.shape, dtype=param.dtype)
        self._pending.append(_PendingGrad(snapshot, staged, out, nbytes, done))
        return out

    def _copy_out(self, grad: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event", torch.Tensor]:
        staged = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        return staged, *self._copy_out_into(staged, grad)

    def _copy_out_into(self, staged: torch.Tensor, grad: torch.Tensor,
                       region: int | None = None) -> tuple["torch.cuda.Event", torch.Tensor]:
        """Device-to-host copy into pinned `staged` on the D2H stream, of a snapshot of
        `grad` taken on the compute stream. Why the snapshot: Inductor's generated code hands
        a gradient's memory to the next kernel right after the hand-off op (buffer reuse the
        allocator never sees, so holding `grad` does not protect it), and a copy on another
        stream that only waited for `grad`'s producer could read memory already overwritten.
        The device clone runs at HBM speed (~1 ms per GB) against PCIe's ~20 ms per GB;
        it is also where a gradient is upcast when `staged` is wider. Returns the event
        marking the host copy complete and the snapshot, which the caller keeps alive until
        then."""
        self.stats.d2h_bytes += staged.numel() * staged.element_size()
        snapshot = grad.clone() if staged.dtype == grad.dtype else grad.to(staged.dtype)
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        timed = region is not None  # timed copies show in the measured timeline
        started, done = torch.cuda.Event(enable_timing=timed), torch.cuda.Event(enable_timing=timed)
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(produced)
            if timed:
                started.record(self.d2h_stream)
            staged.copy_(snapshot, non_blocking=True)
            done.record(self.d2h_stream)
        if timed:
            self.stats.grad_copies.append((region, started, done))
        return done, snapshot

    def _retire_done(self) -> None:
        for p in self._pending:
            if p.device_grad is not None and p.done.query():
                p.device_grad = None
                self.pool.release(p.nbytes)

    def drain(self) -> None:
        """Block until every gradient of this backward is on the host (in the parameter's
        dtype) or handed to its optimizer, so `opt.step()` sees all of them. With the
        backlog, regions not handed over yet are deferred instead (AdamW.defer) where every
        optimizer concerned agrees: then step() has nothing to wait for."""
        if self._ring is not None:
            chunk = self._ring.seal()  # the last, partly filled chunk
            if chunk is not None:
                self._hand_chunk(chunk)
        self.stats.phase_starts["drained"] = time.perf_counter()
        if self.deadlines is None or not self._defer_rest():
            self.wait_handoffs()
        for p in self._pending:
            p.done.synchronize()
            if p.device_grad is not None:
                p.device_grad = None
                self.pool.release(p.nbytes)
            if p.out is not p.staged:
                p.out.copy_(p.staged)
        self._pending.clear()
        if self.cuda and not self._autotune_pins_released:
            self._autotune_pins_released = True  # the first backward's autotuning is over
            release_cached_pinned_blocks(self.device)
        self.end_step()


def _host_copies_current(params: list) -> None:
    """Before a fetch from host memory: parameters another graph keeps resident (AdamW
    state on the device, updates="resident") have their newest values copied home."""
    owners: dict[int, tuple] = {}
    for p in params:
        opt = owner_of(p)
        if opt is not None:
            owners.setdefault(id(opt), (opt, []))[1].append(p)
    for opt, ps in owners.values():
        opt.flush_resident(ps)


def _by_owner(params: list, values: list) -> dict[int, tuple]:
    """(optimizer, params, values) per owning optimizer, keyed by its id; None for the
    parameters whose gradients go to p.grad (no optimizer, or several graphs hand them in)."""
    owners: dict[int, tuple] = {}
    for p, v in zip(params, values):
        opt = None if handoff_graphs.several(p) else owner_of(p)
        entry = owners.setdefault(id(opt), (opt, [], []))
        entry[1].append(p)
        entry[2].append(v)
    return owners
