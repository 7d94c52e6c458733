"""The step planner: the search for the fastest schedule whose peak fits the budget.

Input: a `Problem` (problem.py: regions in forward order with their weights,
boundary-activation and working-set bytes as sympy expressions or ints, FLOPs, the DAG of
activations), a budget and probed `Rates`. Output: a `Plan` holding the chosen
`Schedule` (simulate.py): one task sequence per stream (compute, h2d, d2h, host), the slot
of every weight buffer, the simulated start and end of every task, the predicted peak
device bytes and step time; `graph_events` (events.py) turns it into the `Transfer` lists
the FX pass materialises.

Peaks follow from the program order alone (program.py), so the search needs no
simulation to know what fits. The planner searches prefetch depth, weight lead, reload
lead, release lag and which boundary activations to offload (a nested family:
longest-lived first), keeps the configurations whose peak fits the budget and simulates
those; the fastest predicted wins. Because the candidate set and every peak are
independent of budget and rates, and a fixed graph's longest path only shrinks when tasks
get shorter, more budget or faster links can never predict a slower step: a heuristic
free to reorder streams would lose that (list-scheduling anomalies).
With `PlannerOptions.keep`, a post-pass then lets the chosen schedule keep the forward
weights of as many regions as fit for their backward (`_with_kept`: their second fetch
goes); that claim covers the search, not the post-pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ..errors import MegatrainValueError, format_bytes
from .costs import Rates
from .events import GraphEvents, RegionUse, graph_events
from .inputs import note_parked
from .problem import Problem, _env, _Shape
from .program import (
    PlanConfig,
    _PeakCurve,
    _program,
    describe_live,
    live_at,
    peak_expression,
    program_peak,
)
from .simulate import Schedule, _no_cyclic_gc, _simulate


class InfeasibleBudget(MegatrainValueError):
    """No configuration fits: `min_budget` is the smallest budget that would."""

    def __init__(self, message: str, min_budget: int):
        super().__init__(message)
        self.min_budget = min_budget


class OffloadRoomExceeded(MegatrainValueError):
    """Schedules fit the device budget, but each parks more activations in host memory than
    `PlannerOptions.offload_room` allows."""


@dataclass(frozen=True)
class PlannerOptions:
    """The search space. The leanest point (1 slot issued just in time, reload lead 0,
    release lag 0, every boundary output offloaded) is always included, so the planner
    fails only when no schedule of this model fits.

    offload: whether boundary outputs may go to host memory between the passes (False
    while the runtime has no activation offload: every output stays on the device).
    keep: whether regions may keep their forward weights for their backward where the
        budget has room beside the chosen schedule (`_with_kept`).
    offload_room: the most bytes of activations a schedule may park in host memory (what
        host_memory leaves beside the optimizer's state); None: no limit. A schedule whose
        offloads exceed it does not fit, however fast.
    """

    max_slots: int = 3
    reload_leads: tuple[int, ...] = (0, 1, 2)
    release_lags: tuple[int, ...] = (0, 1)
    steps: int = 2
    offload: bool = True
    keep: bool = False
    offload_room: int | None = None


@dataclass
class Plan:
    schedule: Schedule
    budget: int
    simulated: int  # schedules simulated to choose this one
    symbolic: Problem | None = None  # the problem before substitution, if it had symbols
    candidates: tuple[PlanConfig, ...] = ()  # every configuration that fit the budget
    dims: dict = field(default_factory=dict)  # the symbolic dims' values planned for

    @property
    def config(self) -> PlanConfig:
        return self.schedule.config

    @property
    def peak_bytes(self) -> int:
        return self.schedule.peak_bytes

    @property
    def step_time(self) -> float:
        return self.schedule.step_time

    @property
    def gpu_idle(self) -> float:
        return self.schedule.gpu_idle

    def peak_expression(self):
        """The chosen schedule's peak as a sympy expression in the problem's dims."""
        return peak_expression(self.symbolic or self.schedule.problem, self.config)

    def events(self, forward_uses: list[RegionUse], backward_uses: list[RegionUse]) -> GraphEvents:
        return graph_events(self.schedule, forward_uses, backward_uses)


def plan_step(problem: Problem, budget: int, rates: Rates, dims: Mapping | None = None,
              options: PlannerOptions = PlannerOptions()) -> Plan:
    """The fastest schedule (predicted) whose peak device bytes fit `budget`.

    Raises InfeasibleBudget (a MegatrainValueError) naming the minimum budget when none fits.
    """
    with _no_cyclic_gc():
        return _plan_step(problem, budget, rates, dims, options)


def _plan_step(problem: Problem, budget: int, rates: Rates, dims: Mapping | None,
               options: PlannerOptions) -> Plan:
    if options.max_slots < 1 or options.steps < 1 or min(options.reload_leads + options.release_lags, default=0) < 0:
        raise ValueError(f"{options}: max_slots and steps must be >= 1, leads and lags >= 0")
    symbolic = problem if problem.free_symbols else None
    concrete = problem.substitute(dims) if symbolic is not None or dims else problem
    sh = _Shape(concrete)
    n_weight_regions = sum(1 for r in concrete.regions if r.weights)
    modes = [(1, 0)] + [(k, None) for k in range(1, max(1, min(options.max_slots, n_weight_regions)) + 1)]
    offl = sh.offloadable if options.offload else ()
    leads = sorted(set(options.reload_leads) | {0}) if offl else [0]
    lags = sorted(set(options.release_lags) | {0}) if (offl or sh.owned) else [0]
    fits: list[PlanConfig] = []
    leanest: tuple | None = None
    room = options.offload_room
    out_bytes = {r.id: int(r.out_bytes) for r in concrete.regions} if room is not None else {}
    host_short: int | None = None  # the fewest offloaded bytes of a schedule the room refused
    for slots, wlead in modes:
        for rlead in leads:
            least_m = None  # offloads needed with the next-smaller release lag
            for lag in lags:
                curve = _PeakCurve(sh, slots, wlead, rlead, lag)
                p_full, at = curve.peak(len(offl))
                if leanest is None or p_full < leanest[0]:
                    leanest = (p_full, at, curve.config(len(offl)))
                if p_full > budget:
                    continue
                lo, hi = 0, len(offl)  # peak is non-increasing in m: the least m that fits
                while lo < hi:
                    mid = (lo + hi) // 2
                    if curve.peak(mid)[0] <= budget:
                        hi = mid
                    else:
                        lo = mid + 1
                cfg = curve.config(lo)
                if not cfg.offloaded:
                    cfg = replace(cfg, reload_lead=0)
                if room is not None:
                    parked = sum(out_bytes[u] for u in cfg.offloaded)
                    note_parked(parked, admitted=parked <= room)
                    if parked > room:
                        host_short = parked if host_short is None else min(host_short, parked)
                        continue
                if least_m is not None and least_m[0] == lo and least_m[1] in fits:
                    # A longer lag only moves waits later: same offloads, never slower.
                    fits.remove(least_m[1])
                least_m = (lo, cfg)
                if cfg not in fits:
                    fits.append(cfg)
    if not fits and host_short is not None:
        raise OffloadRoomExceeded(
            f"every schedule within gpu_memory={budget} bytes ({format_bytes(budget)}) parks at "
            f"least {host_short} bytes ({format_bytes(host_short)}) of activations in host memory, "
            f"but host_memory leaves {room} bytes ({format_bytes(room)}) for them beside the "
            f"optimizer's state; give more host_memory, or more gpu_memory so fewer activations "
            f"leave the device")
    if not fits:
        p, at, cfg = leanest
        where = f" (during the {'forward' if at.phase == 'fw' else 'backward'} of region {at.region}: " \
                f"{describe_live(live_at(sh, cfg, at))})" if at else ""
        raise InfeasibleBudget(
            f"gpu_memory={budget} bytes ({format_bytes(budget)}) is too small: the leanest "
            f"schedule of this step ({cfg.describe()}) still peaks at {p} bytes ({format_bytes(p)})"
            f"{where}; give gpu_memory >= {p} bytes or use a smaller batch/sequence", int(p))
    best = None
    for i, cfg in enumerate(fits):
        sched = _simulate(concrete, cfg, rates, options.steps)
        key = (sched.step_time, sched.peak_bytes, i)
        if best is None or key < best[0]:
            best = (key, sched)
    chosen, simulated = best[1], len(fits)
    if options.keep and sh.keepable:
        cfg = _with_kept(sh, chosen.config, budget)
        if cfg.kept_weights:
            sched = _simulate(concrete, cfg, rates, options.steps)
            simulated += 1
            fits.append(cfg)
            if sched.step_time <= chosen.step_time:
                chosen = sched
    return Plan(chosen, budget, simulated, symbolic, tuple(fits), _env(dims, problem.free_symbols))


def _with_kept(sh: _Shape, cfg: PlanConfig, budget: int) -> PlanConfig:
    """`cfg` with the most regions keeping their forward weights for the backward (the
    soonest needed first, `_Shape.keepable`) whose peak still fits `budget`. Each kept
    region saves a fetch of its weights: PCIe bytes and, for the host optimizer's memory
    bandwidth, a read of its masters; it costs device memory from its forward to its
    backward. Peaks grow with the count, so a binary search (which only ever settles on a
    count it saw fit)."""
    def fits(n: int) -> bool:
        trial = replace(cfg, kept_weights=frozenset(sh.keepable[:n]))
        return program_peak(_program(sh, trial, 1, memory_only=True), sh.problem.base_bytes)[0] <= budget

    lo, hi = 0, len(sh.keepable)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return replace(cfg, kept_weights=frozenset(sh.keepable[:lo]))
