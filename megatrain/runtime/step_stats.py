"""What one step of a streamed graph moved and waited for, and where the device peaked.

A `Streamer` starts a fresh `StepStats` at each `begin_step` and keeps the finished one as
`last_stats`; its parts (weight_fetch.py, grad_routes.py, grad_handoff.py, host_grads.py)
add to the current one through their `StreamContext`. The CUDA event pairs are recorded
as the work is queued and read only here, after the fact: reading them blocks until the
last one has completed, so nothing on the step's path ever does.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


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
    # backward deferred included), (region, start, end, parameters, applied at once) on the
    # host's perf_counter clock (the last field False where the optimizer accumulated the
    # gradients or held them for step()), and when the step's phases began on that clock
    # ("forward": begin_step, "backward": the forward's end, "drained": backward's end).
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
        device backlog's updates ran much slower beside the forward's copies). Host
        clock: a phase starts when the host thread got there, ahead of
        the GPU by what it has queued."""
        marks = sorted((t, name) for name, t in self.phase_starts.items())
        out: dict[str, dict[str, float]] = {}
        for _, start, end, params, _ in self.host_updates:
            phase = next((name for t, name in reversed(marks) if t <= start), "between steps")
            row = out.setdefault(phase, {"updates": 0, "params": 0, "busy_s": 0.0})
            row["updates"] += 1
            row["params"] += params
            row["busy_s"] += end - start
        return out

