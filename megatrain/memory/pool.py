"""Device memory accounting for megatrain's transfers: live bytes and the high-water mark.

The buffers themselves come from torch's allocator (so Inductor can free them at their last
use); the pool counts what megatrain put on the device and refuses to exceed the budget the
planner proved, which turns a planning bug into an error instead of an out-of-memory later.

`Reserve` lends the memory the plan leaves free (gpu_memory - predicted peak - staging) to
optional holders that the plan does not schedule: device-site updates (device_updates.py)
and the gradient backlog (grad_backlog.py). They share one reserve, so together they never
take more than the plan leaves. Bytes may be released from the runtime's hand-off thread,
hence the lock.
"""

from __future__ import annotations

import threading

from ..errors import format_bytes


class DevicePool:
    def __init__(self, budget: int):
        self.budget = budget
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, what: str) -> None:
        with self._lock:
            self.live += nbytes
            if self.live > self.budget:
                live = self.live
                self.live -= nbytes
                raise RuntimeError(
                    f"megatrain: {what} needs {format_bytes(nbytes)} but the transfer pool would hold "
                    f"{format_bytes(live)} > gpu_memory {format_bytes(self.budget)}; this is a planning "
                    f"bug, please report it with megatrain.explain(...)")
            self.peak = max(self.peak, self.live)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes
            assert self.live >= 0, "released more bytes than acquired"

    def reset_peak(self) -> None:
        self.peak = self.live


class Reserve:
    """Up to `nbytes` of the pool for holders outside the plan; `try_acquire` says no
    (rather than raising) when the bytes fit neither the reserve nor the pool's budget."""

    def __init__(self, pool: DevicePool, nbytes: int):
        self.pool = pool
        self.nbytes = nbytes
        self.live = 0
        self._lock = threading.Lock()

    def fits(self, nbytes: int) -> bool:
        return self.live + nbytes <= self.nbytes and self.pool.live + nbytes <= self.pool.budget

    def try_acquire(self, nbytes: int, what: str) -> bool:
        with self._lock:
            if not self.fits(nbytes):
                return False
            self.pool.acquire(nbytes, what)
            self.live += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes
            assert self.live >= 0, "released more reserve bytes than acquired"
            self.pool.release(nbytes)
