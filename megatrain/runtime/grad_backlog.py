"""The gradient backlog: gradients that wait on the device for a host slab, handed to the
host optimizer earliest deadline first (compile option ``backlog=True``).

Why: the host AdamW is slower than backward (1.3B on the H200: ~0.46 s of updates against
~0.2 s of backward). Without the backlog, backward blocks whenever every host slab holds a
region the optimizer has not consumed yet, and updates run in gradient arrival order (last
layer first), so region 0 (embeddings, whose gradient arrives last) is updated last and the
next forward, which needs region 0 first, waits for every update: step = optimizer + forward.

With it:
- backward never blocks on slabs: a region whose first gradient finds no free slab keeps
  its gradients on the device, in one buffer copied from each gradient (a snapshot, as the
  slab path takes: Inductor reuses a gradient's memory right after the hand-off op), if
  the memory the plan leaves free (the streamer's ``pool.Reserve``, shared with device-site
  updates) has room; else it blocks on a slab as before. Never beyond ``gpu_memory``.
- whenever a slab frees, the region sent to the host next is the one whose deadline comes
  first, the deadline being the position of the region's first fetch in the forward. So
  after backward, region 0 crosses and is updated before the backlog's later layers, and
  the next forward starts as soon as region 0 is updated while the other updates run
  beside it: each fetch waits for its own region only (Streamer.wait_updates ->
  AdamW.wait_params, which also waits for a deferred update to be queued, then for it).
- at the end of backward the regions not yet handed to their optimizer are deferred
  (``AdamW.defer``): ``step()`` returns without them. Where the optimizer declines (the
  update is not immediate: ``accumulate()``, ``max_grad_norm``, ``skip_nonfinite``, or
  any optimizer that is not plain megatrain.AdamW), the end of backward waits until the
  whole backlog is handed over, as today's path does; results are the same.

Why EDF only at the choice of what crosses next, with the host worker staying FIFO: the
hand-off thread submits one region and waits for its update before the next, and there are
only two slabs in backlog mode, so at most one region sits in the worker queue and one
copied region waits behind it. Submitting in EDF order therefore already runs updates in
EDF order, up to one region. A priority queue in the worker would buy at most that.

Exactness: the same gradient bytes reach the same update with the same hyperparameters
(read when backward ends, as ``submit`` during backward would); only the order of
independent per-region updates changes. Regions carrying a contribution of a tied weight
(a parameter fetched by several regions, its contributions summed on the host) never enter
the backlog: their partial sums must be on the host when the last contribution's region is
handed over, which EDF could order first. They take the slab path, blocking if they must
(a freed slab goes to a blocked backward first: its region has the earliest deadline).

``EdfQueue`` is the ordering and the byte count alone, testable without a device;
``GradBacklog`` adds the device buffers and the reserve.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from dataclasses import dataclass, field

import torch

from .pool import Reserve

_ALIGN = 64  # as in grad_slabs: every gradient starts on a cache line


class EdfQueue:
    """Regions waiting for a slab, served earliest deadline first.

    ``learn(region)`` is called at each forward fetch: a region's deadline is the position
    of its first fetch in the first forward seen; regions never fetched in a forward come
    last, by id. The same region may wait twice (a graph dynamo runs for several modules):
    then first come, first served."""

    def __init__(self) -> None:
        self._rank: dict[int, int] = {}
        self._heap: list[tuple[tuple[float, int], int, int, object]] = []
        self._seq = itertools.count()
        self.bytes = 0

    def learn(self, region: int) -> None:
        self._rank.setdefault(region, len(self._rank))

    def deadline(self, region: int) -> tuple[float, int]:
        return (self._rank.get(region, math.inf), region)

    def push(self, region: int, nbytes: int, item: object) -> None:
        heapq.heappush(self._heap, (self.deadline(region), next(self._seq), region, item))
        self.bytes += nbytes

    def peek(self) -> int | None:
        return self._heap[0][2] if self._heap else None

    def waiting(self) -> tuple[int, ...]:
        return tuple(region for _, _, region, _ in self._heap)

    def pop(self, nbytes_of=lambda item: 0) -> tuple[int, object]:
        _, _, region, item = heapq.heappop(self._heap)
        self.bytes -= nbytes_of(item)
        return region, item

    def __len__(self) -> int:
        return len(self._heap)


@dataclass
class Held:
    """One region's gradients on the device: views into one buffer, in arrival order, with
    the runtime's entries they belong to; ``ready`` (CUDA) marks the last copy done."""

    region: int
    flat: torch.Tensor | None
    nbytes: int
    used: int = 0
    views: list = field(default_factory=list)  # (view, entry)
    ready: object = None
    payload: object = None  # the streamer's (pids, parts) for the hand-off


class GradBacklog:
    """Per streamer: device buffers of backlogged regions within the shared reserve, and
    their EDF order. Thread-safe: regions are added on the runtime thread and taken by
    whichever thread frees a slab (the hand-off thread, or the runtime at drain)."""

    def __init__(self, device: torch.device, reserve: Reserve, excluded: set[int]):
        self.device = device
        self.reserve = reserve
        self.excluded = set(excluded)  # regions with tied-weight contributions
        self.queue = EdfQueue()
        self.backlogged = 0  # regions that went through the backlog, for tests and benchmarks
        # Every region taken, in order, with the regions it left waiting (tests, benchmarks).
        self.taken: list[tuple[int, tuple[int, ...]]] = []
        self._filling: dict[int, Held] = {}
        self._lock = threading.Lock()

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

    def hold(self, region: int, grad: torch.Tensor, entry: list, dtype: torch.dtype) -> torch.Tensor:
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
        with self._lock:
            self.queue.push(region, held.nbytes, held)
            self.backlogged += 1

    def peek(self) -> int | None:
        with self._lock:
            return self.queue.peek()

    def take(self) -> Held | None:
        with self._lock:
            if not len(self.queue):
                return None
            region, held = self.queue.pop(lambda h: h.nbytes)
            self.taken.append((region, self.queue.waiting()))
            return held

    def release(self, held: Held) -> None:
        """Its gradients are on the host: the device buffer and its bytes go back."""
        if held.flat is not None:
            held.flat, held.views = None, []
            self.reserve.release(held.nbytes)

    def __len__(self) -> int:
        with self._lock:
            return len(self.queue)
