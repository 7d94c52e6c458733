"""The device side of the gradient backlog (compile option ``backlog="device"``): gradients
that find no free host slab wait on the device, and cross earliest deadline first.

The backlog itself, either way (``backlog="host"`` or ``"device"``; runtime/deadlines.py
says why): sealed regions reach the host optimizer earliest deadline first, and at the end
of backward the regions not yet handed to their optimizer are deferred (``AdamW.defer``),
so ``step()`` returns without them and the next forward runs beside their updates, each
fetch waiting for its own region only (Streamer.wait_updates -> AdamW.wait_params, which
also waits for a deferred update to be queued, then for it). Where the optimizer declines
(the update is not immediate: ``accumulate()``, ``max_grad_norm``, ``skip_nonfinite``, or
any optimizer that is not plain megatrain.AdamW), the end of backward waits until every
region is handed over, as without a backlog; results are the same.

With ``"host"`` the waiting gradients sit in host slabs, which grow into spare host RAM
(grad_slabs.py). With ``"device"`` they stay on the device instead while no slab is free:

- backward never blocks on slabs: a region whose first gradient finds no free slab keeps
  its gradients on the device, in one buffer copied from each gradient (a snapshot, as the
  slab path takes: Inductor reuses a gradient's memory right after the hand-off op), if
  the memory the plan leaves free (the streamer's ``pool.Reserve``, shared with device-site
  updates) has room; else it blocks on a slab as before. Never beyond ``gpu_memory``.
- whenever a slab frees, the held region whose deadline comes first crosses (two slabs by
  default: the device holds the backlog, not host RAM).

Exactness: the same gradient bytes reach the same update with the same hyperparameters
(read when backward ends, as ``submit`` during backward would); only the order of
independent per-region updates changes. Regions carrying a contribution of a tied weight
(a parameter fetched by several regions, its contributions summed on the host) never wait
on the device: their partial sums must be on the host when the last contribution's region
is handed over, which EDF could order first. They take the slab path, blocking if they must
(a freed slab goes to a blocked backward first: its region has the earliest deadline).

``GradBacklog`` holds the device buffers within the reserve, ordered by a
``deadlines.DeadlineQueue``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .deadlines import DeadlineQueue, Deadlines
from .grad_copies import GradCopy
from ..memory.pool import Reserve

_ALIGN = 64  # as in grad_slabs: every gradient starts on a cache line


@dataclass
class Held:
    """One region's gradients on the device: views into one buffer, in arrival order, with
    the copies to the host they will fill; ``ready`` (CUDA) marks the last copy done."""

    region: int
    flat: torch.Tensor | None
    nbytes: int
    used: int = 0
    views: list[tuple[torch.Tensor, GradCopy]] = field(default_factory=list)
    ready: object = None
    payload: object = None  # the streamer's (pids, parts) for the hand-off


class GradBacklog:
    """Per streamer: device buffers of backlogged regions within the shared reserve, and
    their EDF order. Thread-safe: regions are added on the runtime thread and taken by
    whichever thread frees a slab (the hand-off thread, or the runtime at drain)."""

    def __init__(self, device: torch.device, reserve: Reserve, excluded: set[int],
                 deadlines: Deadlines):
        self.device = device
        self.reserve = reserve
        self.excluded = set(excluded)  # regions with tied-weight contributions
        # Sealed regions by deadline; its `served`: each region taken, with those left waiting.
        self.queue = DeadlineQueue(deadlines)
        self.backlogged = 0  # regions that went through the backlog, for tests and benchmarks
        self._filling: dict[int, Held] = {}

    def open(self, region: int, nbytes: int) -> bool:
        """Start holding ``region``'s gradients (``nbytes``: the region's reservation, as
        its slab would have) if it may and its bytes fit the reserve; False: the slab path."""
        if region in self.excluded:
            return False
        nbytes = -(-nbytes // _ALIGN) * _ALIGN
        if not self.reserve.try_acquire(nbytes, f"gradient backlog of region {region}"):
            return False
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._filling[region] = Held(region, flat, nbytes)
        return True

    def holds(self, region: int) -> bool:
        return region in self._filling

    def hold(self, region: int, grad: torch.Tensor, entry: GradCopy, dtype: torch.dtype) -> torch.Tensor:
        """Copy ``grad`` into the region's buffer as ``dtype`` (the dtype it crosses the link
        in), on the current stream; returns the view."""
        held = self._filling[region]
        nbytes = grad.numel() * dtype.itemsize
        start = -(-held.used // _ALIGN) * _ALIGN
        assert start + nbytes <= held.nbytes, "a region's gradients exceed its reservation"
        held.used = start + nbytes
        view = held.flat[start:start + nbytes].view(dtype).view(grad.shape)
        view.copy_(grad)
        held.views.append((view, entry))
        return view

    def seal(self, region: int, payload: object) -> None:
        """All of the region's gradients are in: it waits for a slab, by deadline."""
        held = self._filling.pop(region)
        held.payload = payload
        if self.device.type == "cuda":
            held.ready = torch.cuda.Event()
            held.ready.record(torch.cuda.current_stream(self.device))
        self.queue.push(region, held, held.nbytes)
        self.backlogged += 1

    def peek(self) -> int | None:
        return self.queue.peek()

    def take(self) -> Held | None:
        taken = self.queue.pop()
        return None if taken is None else taken[1]

    def release(self, held: Held) -> None:
        """Its gradients are on the host: the device buffer and its bytes go back."""
        if held.flat is not None:
            held.flat, held.views = None, []
            self.reserve.release(held.nbytes)

    def __len__(self) -> int:
        return len(self.queue)
