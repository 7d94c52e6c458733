"""What planning read beyond its graphs, its options and its key, noted while a compile
plans, so that a plan cached across processes is reused only where planning afresh would
read the same (compiler/aot_cache.py).

Three things a plan depends on change between two processes compiling the same graph
with the same options, so they cannot sit in the cache key:
- the host memory left for activations parked between the passes (`host_memory`
  defaults to the RAM free at each compile): the planner refuses a schedule parking more
  than that room (search.py), so a plan stands for every room that admits exactly the
  schedules its own room admitted: at least the most any admitted one parked, less than
  the least any refused one parked;
- the kernel timings read from their cache per shape (runtime/kernel_probe.py): other
  graphs add timings to the same file, so the timings this plan read are noted by shape;
- the kept-activations choice remembered across processes (compiler/decision_cache.py),
  which a later process may find made, changed or gone.
A note made outside `recording()` is dropped: only a compile that caches its plan asks.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class PlanInputs:
    """What one compile's planning read (module docstring)."""

    room_floor: int = 0  # the most bytes a schedule the room admitted parks
    room_ceiling: float = math.inf  # the fewest bytes a schedule the room refused parks
    kernels: dict[str, float] = field(default_factory=dict)  # timing key -> seconds read
    # (joint graph fingerprint, "remembered" | "decided", the decision cache's entry as JSON)
    decision: tuple[str, str, str] | None = None
    unrepeatable: str | None = None  # why planning again might differ (None: it would not)

    def admits_room(self, room: int | None) -> bool:
        """Whether a planner given `room` (None: no limit) admits the same schedules."""
        if room is None:
            return self.room_floor == 0 and self.room_ceiling == math.inf
        return self.room_floor <= room < self.room_ceiling


class _Open(threading.local):
    def __init__(self) -> None:
        self.inputs: PlanInputs | None = None


_open = _Open()


@contextlib.contextmanager
def recording() -> Iterator[PlanInputs]:
    """Note what planning reads inside the block (on this thread) into the PlanInputs
    yielded; blocks nest, each noting into its own."""
    outer, _open.inputs = _open.inputs, PlanInputs()
    try:
        yield _open.inputs
    finally:
        _open.inputs = outer


def note_parked(parked: int, admitted: bool) -> None:
    """The planner compared a schedule parking `parked` bytes with its room."""
    inputs = _open.inputs
    if inputs is None:
        return
    if admitted:
        inputs.room_floor = max(inputs.room_floor, parked)
    else:
        inputs.room_ceiling = min(inputs.room_ceiling, parked)


def note_kernel(key: str, seconds: float | None) -> None:
    """The cost model read `seconds` for the kernel shape `key` (None: it could not be timed,
    so a later compile times it again)."""
    inputs = _open.inputs
    if inputs is None:
        return
    if seconds is None:
        inputs.unrepeatable = f"kernel shape {key} could not be timed"
    else:
        inputs.kernels[key] = seconds


def note_decision(graph: str, how: str, entry: str) -> None:
    """The kept-activations choice for the joint graph fingerprinted `graph` was `how`
    ("remembered" from the decision cache, or "decided" and stored there as `entry`)."""
    if _open.inputs is not None:
        _open.inputs.decision = (graph, how, entry)


def note_unrepeatable(why: str) -> None:
    """Planning did something a later compile might not repeat (a failed timing, a failed
    decision): its plan is not to be reused."""
    if _open.inputs is not None:
        _open.inputs.unrepeatable = why
