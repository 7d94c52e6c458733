"""Host slabs that gradients land in on their way to the optimizer.

Why not one pinned tensor per gradient: torch's pinned-memory cache rounds every block up
to a power of two and keeps it, so per-gradient buffers cost up to 2x the gradient bytes,
and as many of them as the optimizer lags behind backward: gigabytes of RSS at 1B
parameters (the host budget is 12 bytes per parameter). Here a region's gradients are
packed into one slab sized for the largest region; a slab returns to the free list once
the optimizer has consumed its gradients.

How many: a slab is added only when the backward would otherwise wait for the optimizer
(or when every slab is still filling, where waiting could only deadlock), and then:

- with ``max_slabs`` given, up to that many; beyond it the backward waits (backpressure);
- by default (``max_slabs=None``) two (one region being updated, the next one copied in),
  and past two only while ``overlap()`` says the GPU has work a lagging host can overlap
  (some regions' updates bypass the host optimizer: resident AdamW state, device-site
  updates; or the host backlog defers updates into the next forward, deadlines.py) and
  host memory has room: all slabs together stay within ``host_bytes`` (what the
  ``host_memory`` option leaves them, compiler/host_budget.py) and the new slab leaves the
  host at least ``host_store.host_margin`` of its RAM available.

Why: where the host's updates bound the step, a backward that waits for a slab holds the
GPU idle while the host works, and the host then idles through the regions that need it
not: with ``updates="resident"`` and part of the regions resident, many slabs made the
step markedly shorter than two did: the backward ran free and the host worked through the
resident regions' backward and the next forward. Where every region goes through the host,
more slabs buy nothing: the next forward's first region is the last one updated, so it
starts when the host is done either way (with nothing resident, a slab per region cost
gigabytes of host memory and no time), unless the host backlog serves that region first. A slab is only
added while the host lags, and a lagging step holds at most about one per host-updated
region (a region fills one slab at a time, and every fetch of the next forward waits for
its region's update, so the previous step's slabs are back before the next backward).

Slabs are page-locked in place (host_store.page_locked_tensor), not taken from torch's
pinned allocator: that one would round a 262 MB slab (a 1.3B model's embedding gradient
in fp32) up to 512 MB and keep every outgrown slab cached for good.

With the device backlog (grad_backlog.py) the runtime asks for a slab without blocking
(`try_open`); the backlog's pump also yields a free slab to a backward blocked on one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..errors import MegatrainValueError
from ..memory import host_store
from ..memory.host_store import host_buffer

_ALIGN = 64  # bytes: every gradient starts on a cache line
MIN_SLABS = 2  # always allowed: one region being updated, the next one copied in


class Slab:
    """One region's gradients, packed; `carve` hands out consecutive aligned views."""

    def __init__(self, nbytes: int, pin: bool):
        self.buf = host_buffer(nbytes, torch.uint8, pin)
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
    each region's gradient bytes when it first fetches the region). ``max_slabs``: the
    bound past which the backward waits, or None: two, more while ``overlap()`` holds and
    host memory has room (see the module docstring)."""

    def __init__(self, pin: bool, max_slabs: int | None = None,
                 overlap: Callable[[], bool] = lambda: False, host_bytes: int | None = None):
        self.pin = pin
        self.max_slabs = check_max_slabs(max_slabs)
        self.host_bytes = host_bytes  # the most bytes all slabs may hold past MIN_SLABS (None: no bound)
        self.overlap = overlap  # whether GPU work that needs no host update exists now
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
            elif self._may_add():
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
            if slab.buf.numel() >= self.slab_bytes and not self._over_bound():
                self._free.append(slab)
            else:  # reserved sizes grew since, or the bound was lowered: let this one go
                self.allocated -= 1
            self._cv.notify()

    def set_max_slabs(self, max_slabs: int | None) -> None:
        """Change the bound (None: the default's rule); free slabs beyond a lowered bound
        are let go now, slabs in use as they come back."""
        with self._cv:
            self.max_slabs = check_max_slabs(max_slabs)
            while self._free and self._over_bound():
                self._free.pop()
                self.allocated -= 1
            self._cv.notify_all()

    def _over_bound(self) -> bool:
        return self.max_slabs is not None and self.allocated > self.max_slabs

    def _may_add(self) -> bool:
        """Whether one more slab may be allocated now (the caller holds the lock)."""
        if self.max_slabs is not None:
            return self.allocated < self.max_slabs
        if self.allocated < MIN_SLABS:
            return True
        if not self.overlap():
            return False
        size = max(self.slab_bytes, _ALIGN)
        if self.host_bytes is not None and (self.allocated + 1) * size > self.host_bytes:
            return False
        mem = host_store.host_memory()
        if mem is None:
            return False
        available, total = mem
        return available - size >= host_store.host_margin(total)

    def _acquire(self) -> Slab:
        with self._cv:
            while not self._free:
                sealed = self.allocated - len(self._filling)
                if sealed == 0 or self._may_add():
                    # Every slab is still filling (waiting could only deadlock), or room
                    # for another: allocate.
                    self.allocated += 1
                    return Slab(max(self.slab_bytes, _ALIGN), self.pin)
                self._waiters += 1
                try:
                    self._cv.wait()
                finally:
                    self._waiters -= 1
            return self._free.pop()


def check_max_slabs(max_slabs: int | None, name: str = "max_slabs") -> int | None:
    """``max_slabs`` if it is a bound the pool can keep (an int >= 1, or None: the
    default's rule), else a MegatrainValueError naming ``name`` (the option grad_slabs
    is checked here too)."""
    if max_slabs is not None and (isinstance(max_slabs, bool) or not isinstance(max_slabs, int)
                                  or max_slabs < 1):
        raise MegatrainValueError(
            f"{name}={max_slabs!r}: give the most host gradient slabs, an int >= 1, or None "
            f"(two, more while the host optimizer lags, some updates bypass it and host "
            f"memory has room)")
    return max_slabs
