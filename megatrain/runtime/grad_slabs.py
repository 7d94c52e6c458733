"""Host slabs that gradients land in on their way to the optimizer.

Why not one pinned tensor per gradient: torch's pinned-memory cache rounds every block up
to a power of two and keeps it, so per-gradient buffers cost up to 2x the gradient bytes,
and as many of them as the optimizer lags behind backward: gigabytes of RSS at 1B
parameters (the host budget is 12 bytes per parameter). Here a region's gradients are
packed into one slab sized for the largest region; a slab returns to the free list once
the optimizer has consumed its gradients, and the runtime waits for one (backpressure)
rather than growing past `max_slabs`. Host memory for gradients is then a few regions.
Two by default: one region being updated, the next one copied in and waiting. The host
never starves with two (a region's copy takes a fraction of its update), and more only
let backward run further ahead of an optimizer that bounds the step anyway: at 1.3B four
slabs cost 0.78 B/param of the 12.5 B/param host budget.
Slabs are page-locked in place (host_store.page_locked_tensor), not taken from torch's
pinned allocator: that one would round a 262 MB slab (a 1.3B model's embedding gradient
in fp32) up to 512 MB and keep every outgrown slab cached for good.

With the gradient backlog (grad_backlog.py) the runtime asks for a slab without blocking
(`try_open`); the backlog's pump also yields a free slab to a backward blocked on one.
"""

from __future__ import annotations

import threading

import torch

from .host_store import page_locked_tensor

_ALIGN = 64  # bytes: every gradient starts on a cache line


class Slab:
    """One region's gradients, packed; `carve` hands out consecutive aligned views."""

    def __init__(self, nbytes: int, pin: bool):
        self.buf = page_locked_tensor(nbytes, torch.uint8) if pin else torch.empty(nbytes, dtype=torch.uint8)
        self.used = 0

    def carve(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = shape.numel() * dtype.itemsize
        start = -(-self.used // _ALIGN) * _ALIGN
        if start + nbytes > self.buf.numel():
            return None
        self.used = start + nbytes
        return self.buf[start:start + nbytes].view(dtype).view(shape)


class GradSlabs:
    """Slabs per region for one backward at a time (fill on the runtime thread, release
    from the hand-off thread). `slab_bytes` grows with `reserve` (the runtime reserves
    each region's gradient bytes when it first fetches the region)."""

    def __init__(self, pin: bool, max_slabs: int = 2):
        self.pin = pin
        self.max_slabs = max_slabs
        self.slab_bytes = 0
        self.allocated = 0
        self.own_buffers = 0  # gradients that did not fit their region's slab (see carve)
        self._free: list[Slab] = []
        self._filling: dict[int, Slab] = {}
        self._waiters = 0  # callers blocked in _acquire
        self._cv = threading.Condition()

    def reserve(self, nbytes: int) -> None:
        self.slab_bytes = max(self.slab_bytes, -(-nbytes // _ALIGN) * _ALIGN)

    def carve(self, region: int, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, Slab | None]:
        """A host view for one gradient of `region`, and the slab it lives in (None: it did
        not fit any slab, so it got a buffer of its own)."""
        slab = self._filling.get(region)
        if slab is None:
            slab = self._acquire()
            with self._cv:
                self._filling[region] = slab
        view = slab.carve(shape, dtype)
        if view is None:  # more than the region reserved (should not happen): own buffer
            self.own_buffers += 1
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin), None
        return view, slab

    def is_open(self, region: int) -> bool:
        """Whether ``region`` has a slab being filled."""
        with self._cv:
            return region in self._filling

    def try_open(self, region: int, yield_to_waiters: bool = False) -> bool:
        """Give ``region`` a slab now if one is free or may be allocated, without waiting;
        ``yield_to_waiters``: not while a caller is blocked waiting for one."""
        with self._cv:
            if region in self._filling:
                return True
            if yield_to_waiters and self._waiters:
                return False
            if self._free:
                self._filling[region] = self._free.pop()
            elif self.allocated < self.max_slabs:
                self.allocated += 1
                self._filling[region] = Slab(max(self.slab_bytes, _ALIGN), self.pin)
            else:
                return False
            return True

    def seal(self, region: int) -> Slab | None:
        """The region's gradients are all in: its slab goes to the hand-off, which releases it."""
        with self._cv:
            return self._filling.pop(region, None)

    def release(self, slab: Slab) -> None:
        with self._cv:
            slab.used = 0
            if slab.buf.numel() >= self.slab_bytes:
                self._free.append(slab)
            else:  # reserved sizes grew since: let this one go
                self.allocated -= 1
            self._cv.notify()

    def _acquire(self) -> Slab:
        with self._cv:
            while not self._free:
                sealed = self.allocated - len(self._filling)
                if self.allocated < self.max_slabs or sealed == 0:
                    # Room for another, or every slab is still filling (waiting could only
                    # deadlock): allocate.
                    self.allocated += 1
                    return Slab(max(self.slab_bytes, _ALIGN), self.pin)
                self._waiters += 1
                try:
                    self._cv.wait()
                finally:
                    self._waiters -= 1
            return self._free.pop()
