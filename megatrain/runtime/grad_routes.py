"""The ways a gradient leaves the device on its way to its optimizer, one object each.

`Streamer.grad_to_optimizer` offers each gradient to its routes in order; the first whose
`take` returns True has it. Which routes a streamer has follows from its compile options
(the streamer rebuilds the list when one is enabled), in this order:

- `ResidentRoute` (updates="resident"): the region's AdamW state lives on the device; the
  update runs there, from the gradient, on the compute stream (resident_regions.py).
- `DeviceUpdateRoute` (update sites on the device): the gradient is gathered on the device
  for its region's device update (device_updates.py).
- `RingRoute` (option grad_chunk): cut into fixed-size host chunks, each handed to the
  optimizer as soon as it is full (grad_ring.py).
- `BacklogRoute` (backlog="device"): a region whose first gradient finds no free slab
  waits on the device, within the reserve, until the pump gives it one (grad_backlog.py).
- `SlabRoute`, always last, takes whatever is left: copied into its region's host slab
  (grad_slabs.py), waiting for a free slab if there is none.

Each route but the device update counts its gradient in with the hand-off
(grad_handoff.py), which seals a region with its last one; the last two also bind it as a
contribution, handed over with its region. (A device update keeps its own count: a region
it takes never reaches the hand-off.)
"""

from __future__ import annotations

import threading
import time

import torch

from ..errors import UnsupportedError
from ..optim.registry import owner_of
from . import handoff_graphs
from .device_updates import DeviceUpdates
from .grad_backlog import GradBacklog
from .grad_copies import GradCopy, Snapshots, copy_to_host
from .grad_handoff import GradHandoff
from .grad_ring import GradRing
from .grad_slabs import GradSlabs
from .resident_regions import ResidentRegions
from .stream_context import StreamContext


class GradRoute:
    """One way out. ``dtype``: the dtype a gradient crossing the link is sent in."""

    def take(self, grad: torch.Tensor, region: int, param_id: int, param: torch.Tensor,
             dtype: torch.dtype) -> bool:
        """Send `grad`, the gradient of `param` (graph slot `param_id`), this way and say
        True; False: not this way, try the next route."""
        raise NotImplementedError

    def flush(self) -> None:
        """End of backward: send on whatever this route still holds back."""


class ResidentRoute(GradRoute):
    def __init__(self, resident: ResidentRegions, handoff: GradHandoff):
        self.resident = resident
        self.handoff = handoff
        self._pieces: dict[int, int] = {}  # param_id -> pieces of it seen this backward
        self._waiting: set[int] = set()  # param_ids with a piece waiting on the device this backward

    def take(self, grad, region, param_id, param, dtype) -> bool:
        """A tied weight's gradient comes in one piece per region that read it
        (`GradHandoff.expect_param`): all but the last wait on the device, summed. Should
        the device refuse a later piece after it took an earlier one, the host could not
        complete the sum (its slab waits for every piece): that is an error, not a hang."""
        seen = self._pieces.get(param_id, 0) + 1
        last = seen >= self.handoff.expect_param.get(param_id, 1)
        self._pieces[param_id] = seen
        if not self.resident.take(grad, region, param, last_piece=last):
            if param_id in self._waiting:
                why = self.resident.demoted.get(region, "its region is no longer resident")
                raise UnsupportedError(
                    f"a tied weight of shape {tuple(param.shape)} had part of its gradient summed on "
                    f"the device this backward when the rest was refused there ({why})")
            return False
        if not last:
            self._waiting.add(param_id)
        self.handoff.count_in(region)  # updated on the device; a demoted region's rest goes home
        return True

    def flush(self) -> None:
        self._pieces.clear()
        self._waiting.clear()


class DeviceUpdateRoute(GradRoute):
    """``params``: the parameters the graph was compiled with, by slot, which the device
    updates were placed for."""

    def __init__(self, updates: DeviceUpdates, params: list[torch.Tensor]):
        self.updates = updates
        self.params = params

    def take(self, grad, region, param_id, param, dtype) -> bool:
        if param is not self.params[param_id]:
            raise UnsupportedError(
                f"updates='device' with a graph that dynamo runs for several modules (slot "
                f"{param_id} of region {region} got a parameter of shape {tuple(param.shape)} "
                "other than the one it was compiled with; a graph break inside a repeated "
                "layer does this): use updates='host', or remove the graph break")
        return self.updates.take(grad, region, param_id)  # kept for the region's device update


class RingRoute(GradRoute):
    def __init__(self, ctx: StreamContext, ring: GradRing, handoff: GradHandoff, snapshots: Snapshots):
        self._ctx = ctx
        self.ring = ring
        self.handoff = handoff
        self.snapshots = snapshots

    def take(self, grad, region, param_id, param, dtype) -> bool:
        """Only a gradient with one contribution per backward (a tied weight's are summed
        in a slab first), one graph handing it in, an optimizer that takes pieces."""
        if not (self.handoff.expect_param[param_id] == 1 and param.is_contiguous()
                and owner_of(param) is not None
                and not handoff_graphs.several(param)):
            return False
        self._to_ring(grad, param, region, dtype)
        self.handoff.count_in(region)
        return True

    def flush(self) -> None:
        chunk = self.ring.seal()  # the last, partly filled chunk
        if chunk is not None:
            self.handoff.run(self._hand_over_chunk, chunk)

    def _to_ring(self, grad: torch.Tensor, param: torch.Tensor, region: int, dtype: torch.dtype) -> None:
        """Copy one gradient into the ring piece by piece (CUDA: from a device snapshot, on
        the D2H stream, as in grad_copies.copy_to_host), handing each chunk to the optimizer
        as soon as it is full. A piece's copy is issued before its chunk can be handed off."""
        ctx, ring = self._ctx, self.ring
        d2h = ctx.d2h_stream
        flat = grad.reshape(-1)
        n = flat.numel()
        waited = ring.wait_s
        done = None
        if ctx.cuda:
            snapshot = flat.clone() if dtype == grad.dtype else flat.to(dtype)
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(ctx.device))
            d2h.wait_event(produced)
        else:
            snapshot = flat
        start = 0
        while start < n:
            view, chunk = ring.carve(n - start, dtype)
            k = view.numel()
            if ctx.cuda:
                # Timed piece by piece: the host may wait for a free chunk between two
                # pieces, and a pair around the whole gradient counted that wait as copying
                # (the ring's copies read several times slower that way).
                with torch.cuda.stream(d2h):
                    started = torch.cuda.Event(enable_timing=True)
                    started.record(d2h)
                    view.copy_(snapshot[start:start + k], non_blocking=True)
                    done = torch.cuda.Event(enable_timing=True)
                    done.record(d2h)
                ctx.stats.grad_copies.append((region, started, done))
            else:
                view.copy_(snapshot[start:start + k])
            chunk.pieces.append((param, start, view, done))
            start += k
            full = ring.seal_if_full()
            if full is not None:
                self.handoff.run(self._hand_over_chunk, full)
        ctx.stats.slab_wait_s += ring.wait_s - waited
        ctx.stats.d2h_bytes += n * dtype.itemsize
        if ctx.cuda:
            self.snapshots.add(GradCopy(done=done, snapshot=snapshot))

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
            self.handoff.track(futures)

    def _release_chunk_after(self, chunk, futures: list) -> None:
        """Give `chunk` back to the ring once every one of `futures` is done (failed ones
        too: an error is re-raised by wait_handoffs, and the ring must not run dry)."""
        if not futures:
            self.ring.release(chunk)
            return
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.ring.release(chunk)

        for f in futures:
            f.add_done_callback(one_done)


class BacklogRoute(GradRoute):
    """Takes the gradients of a region the backlog holds: one whose first gradient found
    no free slab while the reserve had room for its reservation."""

    def __init__(self, ctx: StreamContext, backlog: GradBacklog, slabs: GradSlabs, handoff: GradHandoff):
        self._ctx = ctx
        self.backlog = backlog
        self.slabs = slabs
        self.handoff = handoff

    def take(self, grad, region, param_id, param, dtype) -> bool:
        if self.handoff.seen(region) == 0:
            # The region's first gradient: a free slab, else the backlog if the reserve has
            # room, else wait for a slab as without the backlog.
            nbytes = self.handoff.grad_bytes.get(region, 0)
            if not self.slabs.try_open(region) and nbytes:
                self.backlog.open(region, nbytes)
        if not self.backlog.holds(region):
            return False
        entry = GradCopy()  # filled when a slab takes the region (GradHandoff.pump)
        self.backlog.hold(region, grad, entry, dtype)
        self._ctx.stats.d2h_bytes += grad.numel() * dtype.itemsize
        self.handoff.add(param_id, param, region, entry)
        return True


class SlabRoute(GradRoute):
    def __init__(self, ctx: StreamContext, slabs: GradSlabs, handoff: GradHandoff, snapshots: Snapshots):
        self._ctx = ctx
        self.slabs = slabs
        self.handoff = handoff
        self.snapshots = snapshots

    def take(self, grad, region, param_id, param, dtype) -> bool:
        """Copy one gradient into the region's host slab (waiting for a slab if none is
        free)."""
        t0 = time.perf_counter()
        staged, slab = self.slabs.carve(region, grad.shape, dtype)
        self._ctx.stats.slab_wait_s += time.perf_counter() - t0
        if grad.device.type == "cpu":
            entry = GradCopy(staged.copy_(grad), slab=slab)
        else:
            done, snapshot = copy_to_host(self._ctx, staged, grad, region)
            # Holding the snapshot keeps its device memory until the copy ends (no
            # record_stream); `Snapshots` lets go of it in stream order.
            entry = GradCopy(staged, done, snapshot, slab)
            self.snapshots.add(entry)
        self.handoff.add(param_id, param, region, entry)
        return True
