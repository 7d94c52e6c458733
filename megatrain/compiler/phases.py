"""Wall time of each compile phase of a graph: what a first step spends before it runs.

A user waiting on a first step wants to know where it goes; `megatrain.explain(model)
.compile_seconds` says, per graph, in seconds of wall time:

    probe         the machine's rates, measured once per process (runtime/probe.py)
    capture       re-homing dynamo's graph onto the device, regions, weight casts
    aot           AOTAutograd: tracing the joint graph, Inductor's joint passes, partition;
                  on a warm start, loading the cached graphs instead (aot_cache.py: then
                  no planning, kernel timing or lowering follows)
    planning      the schedule search, transfer nodes, the StepPlan
    kernel_timing products and attention timed at the graph's shapes (runtime/kernel_probe.py)
    lowering      Inductor (or the eager lowering) compiling the forward and backward
    homing        moving the parameters into megatrain's host store (page-locked on CUDA)

Times are exclusive: a phase entered inside another (kernel timing inside planning,
planning inside AOTAutograd's partition callback) is subtracted from the outer one, so the
phases add up to the backend's whole time. A phase may run after the backend returned
(AOTAutograd compiles the backward at the first backward call): it still counts toward its
graph. Dynamo's own tracing happens before the backend is called and is not here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

class _Frames(threading.local):
    """Per thread, the open phases: [name, times dict, start of the current stretch]."""

    def __init__(self) -> None:
        self.stack: list[list] = []


_open = _Frames()


@contextmanager
def phase(name: str, times: dict[str, float] | None = None) -> Iterator[None]:
    """Add the wall time spent inside to ``times[name]`` (the enclosing phase's dict when
    ``times`` is None; nothing is recorded outside any phase). Exclusive of nested phases."""
    frames = _open.stack
    if times is None:
        if not frames:
            yield
            return
        times = frames[-1][1]
    now = time.perf_counter()
    if frames:   # pause the enclosing phase
        outer_name, outer_times, outer_start = frames[-1]
        outer_times[outer_name] = outer_times.get(outer_name, 0.0) + now - outer_start
    frames.append([name, times, now])
    try:
        yield
    finally:
        end = time.perf_counter()
        _, _, start = frames.pop()
        times[name] = times.get(name, 0.0) + end - start
        if frames:   # resume it
            frames[-1][2] = end
