"""Device memory accounting for megatrain's transfers: live bytes and the high-water mark.

The buffers themselves come from torch's allocator (so Inductor can free them at their last
use); the pool counts what megatrain put on the device and refuses to exceed the budget the
planner proved, which turns a planning bug into an error instead of an out-of-memory later.
"""

from __future__ import annotations

from ..errors import format_bytes


class DevicePool:
    def __init__(self, budget: int):
        self.budget = budget
        self.live = 0
        self.peak = 0

    def acquire(self, nbytes: int, what: str) -> None:
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
        self.live -= nbytes
        assert self.live >= 0, "released more bytes than acquired"

    def reset_peak(self) -> None:
        self.peak = self.live
