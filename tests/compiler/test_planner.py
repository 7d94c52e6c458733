"""The step planner: property tests (hypothesis) against the independent validator, plus
metamorphic properties and hand-built cases.

Example counts scale with MEGATRAIN_PLANNER_SCALE (default 1: the whole file in well under
90 s on two cores; CI may raise it for a soak run). Every example plans (several simulated
schedules each) and validates the result.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import sympy
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from megatrain.plan.costs import GPU_DEFAULT, Rates, link_rates
from megatrain.plan.problem import Problem, RegionSpec, Weight, with_update_sites
from megatrain.plan.program import PlanConfig, largest_fitting
from megatrain.plan.search import InfeasibleBudget, OffloadRoomExceeded, PlannerOptions, plan_step
from megatrain.plan.simulate import simulate
from megatrain.plan.validate import ScheduleInvalid, min_budget, validate, violations
from megatrain.errors import MegatrainValueError

SCALE = float(os.environ.get("MEGATRAIN_PLANNER_SCALE", "1"))


def budget_settings(n: int):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


# --------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------

# Sizes spread over nine orders of magnitude, zero included: very different regions.
def log_uniform(lo_exp: int, hi_exp: int, zeros: int = 2):
    """Zero (now and then) or a number of 2**lo_exp .. 2**hi_exp with a uniform exponent."""
    return st.integers(lo_exp - zeros, hi_exp).flatmap(
        lambda e: st.just(0) if e < lo_exp else st.integers(1 << e, (2 << e) - 1))


sizes = log_uniform(0, 30)
flops = log_uniform(20, 44)


def rate(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


rates_st = st.builds(lambda h, d, x, f, a, m: Rates("hypothesis", h, d, x, f, a, m),
                     rate(1e8, 1e11), rate(1e8, 1e11), rate(1e8, 2e11), rate(1e9, 1e15), rate(1e6, 1e10),
                     st.one_of(st.none(), rate(1e9, 1e13)))


@st.composite
def problems(draw, max_regions: int = 10, min_regions: int = 1):
    """Chains and DAGs: branches (a region reading an earlier one only), skip connections,
    several sources and sinks, weights shared by several regions, weightless regions,
    backwards that read fewer weights (an embedding's) or another region's (a hoisted
    recompute), gradients held or streamed, any valid backward order, gradient
    accumulation, forward-only (inference) steps."""
    n = draw(st.integers(min_regions, max_regions))
    rng = draw(st.randoms(use_true_random=False))
    outs = sizes if rng.random() < 0.5 else log_uniform(16, 32)  # half: activation-heavy
    regions = []
    weights = [Weight(i, draw(sizes), draw(st.integers(0, 1 << 30)), draw(st.one_of(st.none(), sizes)),
                      rng.random() < 0.8) for i in range(n)]
    for i in range(n):
        inputs = set()
        if i and rng.random() < 0.85:
            inputs.add(i - 1)  # the chain
        if i > 1 and rng.random() < 0.3:
            inputs.add(rng.randrange(i - 1))  # a skip connection or a branch
        ws = set()
        if rng.random() < 0.8:
            ws.add(i)
        if rng.random() < 0.15:
            ws.add(rng.randrange(n))  # a weight shared with another region (tied)
        bw_ws = None
        if rng.random() < 0.2:  # fewer weights in backward, or one hoisted from another region
            bw_ws = tuple(sorted({w for w in ws if rng.random() < 0.5}
                                 | ({rng.randrange(n)} if rng.random() < 0.3 else set())))
        regions.append(RegionSpec(i, tuple(sorted(ws)), tuple(sorted(inputs)), draw(outs), draw(sizes),
                                  draw(sizes), draw(flops), draw(st.one_of(st.none(), flops)), bw_ws,
                                  draw(sizes), draw(st.one_of(st.none(), sizes))))
    backward = None
    if rng.random() < 0.3:  # some other valid backward order: consumers before producers
        consumers = {r.id: [c.id for c in regions if r.id in c.inputs] for r in regions}
        left = {r.id: len(consumers[r.id]) for r in regions}
        ready = [r for r, c in left.items() if c == 0]
        backward = []
        while ready:
            r = ready.pop(rng.randrange(len(ready)))
            backward.append(r)
            for i in regions[r].inputs:
                left[i] -= 1
                if left[i] == 0:
                    ready.append(i)
    used = {w for r in regions for w in r.weights + (r.bw_weights or ())}
    weights = [w for w in weights if w.id in used]
    return Problem(tuple(regions), tuple(weights), tuple(backward) if backward else None,
                   draw(st.one_of(st.just(0), sizes)), draw(st.integers(1, 3)), rng.random() > 0.1)


# Below the least budget (must raise), at it, just above it (offloading pays), roomy.
budget_factors = st.one_of(st.floats(0.3, 1.0), st.just(1.0), st.floats(1.0, 1.5), st.floats(1.0, 4.0))
SMALL = PlannerOptions(max_slots=2, reload_leads=(0, 1), release_lags=(0, 1))
OPTIONS = st.sampled_from([SMALL, PlannerOptions()])
# keep=True adds a post-pass to the chosen schedule (plan.search._with_kept): plans stay valid
# and within budget, but "more budget never predicts a slower step" is claimed without it.
VALID_OPTIONS = st.sampled_from([SMALL, PlannerOptions(), PlannerOptions(keep=True)])


def plan_or_none(problem, budget, rates, options):
    try:
        return plan_step(problem, budget, rates, options=options)
    except InfeasibleBudget:
        return None


# --------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------


def check_plan(problem, factor, rates, options):
    lb = min_budget(problem)
    budget = max(1, int(lb * factor))
    try:
        plan = plan_step(problem, budget, rates, options=options)
    except InfeasibleBudget as e:
        # The validator's own lower bound confirms that nothing fits, and the error names it.
        assert budget < lb
        assert e.min_budget == lb
        assert str(lb) in str(e)
        event("infeasible")
        return
    assert budget >= lb
    validate(plan.schedule, budget)
    assert lb <= plan.peak_bytes <= budget
    assert plan.step_time >= plan.schedule.compute_seconds * (1 - 1e-9)
    cfg = plan.config
    event(f"slots={cfg.slots} lead={cfg.weight_lead} reload={cfg.reload_lead} lag={cfg.release_lag}")
    event("some outputs offloaded" if cfg.offloaded else "no output offloaded")
    event(f"{plan.simulated} schedules simulated")


@budget_settings(1000)
@given(problem=problems(), factor=budget_factors, rates=rates_st, options=VALID_OPTIONS)
def test_plans_pass_the_validator_or_no_schedule_fits(problem, factor, rates, options):
    check_plan(problem, factor, rates, options)


def random_problem(rng: random.Random, n: int) -> Problem:
    """A large DAG like `problems` draws, from one seed (hypothesis would need thousands of
    draws for 200 regions)."""

    def size(lo=0, hi=30):
        return 0 if rng.random() < 0.06 else rng.randint(1 << lo, 2 << rng.randint(lo, hi))

    regions = []
    for i in range(n):
        inputs = {i - 1} if i and rng.random() < 0.85 else set()
        if i > 1 and rng.random() < 0.3:
            inputs.add(rng.randrange(i - 1))
        ws = {i} if rng.random() < 0.8 else set()
        if rng.random() < 0.15:
            ws.add(rng.randrange(n))
        regions.append(RegionSpec(i, tuple(sorted(ws)), tuple(sorted(inputs)), size(), size(), size(),
                                  size(20, 44), None))
    used = sorted({w for r in regions for w in r.weights})
    weights = [Weight(w, size(), rng.randint(0, 1 << 30)) for w in used]
    return Problem(tuple(regions), tuple(weights), None, size(), rng.randint(1, 2))


@budget_settings(6)
@given(n=st.integers(100, 200), seed=st.integers(0, 2**32), factor=budget_factors, rates=rates_st)
def test_large_dags_plan_and_validate(n, seed, factor, rates):
    check_plan(random_problem(random.Random(seed), n), factor, rates, PlannerOptions())


@budget_settings(1500)
@given(problem=problems(max_regions=8), rates=rates_st, data=st.data())
def test_every_configuration_simulates_to_a_valid_schedule(problem, rates, data):
    """Not only the planner's pick: any point of the search space is a valid schedule."""
    offloadable = [r.id for r in problem.regions if any(r.id in c.inputs for c in problem.regions)] \
        if problem.training else []
    from megatrain.plan.problem import _Shape

    keepable = _Shape(problem).keepable
    cfg = PlanConfig(slots=data.draw(st.integers(1, 4)),
                     weight_lead=data.draw(st.one_of(st.none(), st.integers(0, 3))),
                     reload_lead=data.draw(st.integers(0, 3)),
                     release_lag=data.draw(st.integers(0, 3)),
                     offloaded=frozenset(data.draw(st.lists(st.sampled_from(offloadable), unique=True)))
                     if offloadable else frozenset(),
                     kept_weights=frozenset(data.draw(st.lists(st.sampled_from(keepable), unique=True)))
                     if keepable else frozenset())
    problem = dataclasses.replace(problem, updates_wait=data.draw(st.booleans()))
    sched = simulate(problem, cfg, rates, steps=data.draw(st.integers(1, 3)))
    validate(sched, sched.peak_bytes)
    assert sched.peak_bytes >= min_budget(problem)
    if problem.updates_wait:
        _assert_updates_wait(sched)


def _assert_updates_wait(sched):
    """Each host update starts once its step's last gradient copy ended, and a step's
    updates run in forward order."""
    order = {r.id: i for i, r in enumerate(sched.problem.regions)}
    copies = [t for t in sched.streams["d2h"] if t.kind == "d2h"]
    steps = [t for t in sched.streams["host"] if t.kind == "host_step"]
    for h in steps:
        last = max(sched.end[d] for d in copies if d.step == h.step)
        assert sched.start[h] >= last - 1e-12, (h, sched.start[h], last)
    for a, b in zip(steps, steps[1:]):
        assert a.step < b.step or order[a.region] < order[b.region], (a, b)
    # each final gradient is held (copied out, its norm taken) after its copy, before its update
    holds = {(t.region, t.step): t for t in sched.streams["host"] if t.kind == "host_hold"}
    assert len(holds) == len(steps)
    for h in steps:
        hold = holds[(h.region, h.step)]
        copy = next(d for d in copies if d.region == h.region and d.step == h.step)
        assert sched.end[copy] - 1e-12 <= sched.start[hold] <= sched.end[hold] <= sched.start[h] + 1e-12


@budget_settings(300)
@given(problem=problems(max_regions=8), rates=rates_st, data=st.data())
def test_peak_curve_matches_the_program_walk(problem, rates, data):
    """The planner's fast peak (prefix sums over one program) equals walking each program."""
    from megatrain.plan.problem import _Shape
    from megatrain.plan.program import _PeakCurve, _program, program_peak

    sh = _Shape(problem)
    curve = _PeakCurve(sh, data.draw(st.integers(1, 3)), data.draw(st.one_of(st.none(), st.integers(0, 2))),
                       data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2)))
    m = data.draw(st.integers(0, len(sh.offloadable)))
    want = program_peak(_program(sh, curve.config(m), 1, memory_only=True), problem.base_bytes)[0]
    assert curve.peak(m)[0] == want


@budget_settings(300)
@given(problem=problems(max_regions=8), f1=st.floats(0.9, 3.0), more=st.floats(1.0, 3.0),
       rates=rates_st, options=OPTIONS)
def test_more_budget_never_predicts_a_slower_step(problem, f1, more, rates, options):
    lb = min_budget(problem)
    small = plan_or_none(problem, int(lb * f1), rates, options)
    assume(small is not None)
    large = plan_step(problem, int(lb * f1 * more), rates, options=options)
    assert large.step_time <= small.step_time


@budget_settings(300)
@given(problem=problems(max_regions=8), factor=st.floats(1.0, 3.0), rates=rates_st,
       faster=st.tuples(*[st.floats(1.0, 10.0)] * 3), others=st.tuples(st.floats(1.0, 10.0), st.floats(1.0, 10.0)),
       options=OPTIONS)
def test_faster_machines_never_predict_a_slower_step(problem, factor, rates, faster, others, options):
    budget = int(min_budget(problem) * factor)
    slow = plan_step(problem, budget, rates, options=options)
    quick = Rates(rates.device, rates.h2d * faster[0], rates.d2h * faster[1], rates.duplex * faster[2],
                  rates.flops, rates.adamw, rates.memory)
    assert plan_step(problem, budget, quick, options=options).step_time <= slow.step_time
    quicker = quick.scaled(compute=others[0], host=others[1])
    assert plan_step(problem, budget, quicker, options=options).step_time <= slow.step_time


# --------------------------------------------------------------------------------------
# Hand-built cases: what the planner chooses, and why
# --------------------------------------------------------------------------------------

GB = 10**9


def llama_like(n=8, micro=1, weight=200_000_000, act=100_000_000, flops=4 * 10**12):
    return Problem.chain([weight] * n, out_bytes=act, flops=flops, work_fw=3 * act, work_bw=6 * act,
                         micro_batches=micro)


def test_budget_buys_prefetch_depth_then_keeps_activations():
    p = llama_like()
    lean = plan_step(p, min_budget(p), GPU_DEFAULT)
    assert lean.config.slots == 1 and lean.config.offloaded  # everything offloaded, no overlap
    roomy = plan_step(p, 100 * GB, GPU_DEFAULT)
    assert roomy.config.slots >= 2 and not roomy.config.offloaded
    assert roomy.step_time < lean.step_time
    assert roomy.gpu_idle < lean.gpu_idle
    for plan, budget in ((lean, min_budget(p)), (roomy, 100 * GB)):
        validate(plan.schedule, budget)


def _parked(plan) -> int:
    """Bytes of activations the plan parks in host memory between the passes."""
    return sum(int(r.out_bytes) for r in plan.schedule.problem.regions if r.id in plan.config.offloaded)


def test_offloads_stay_within_the_host_room():
    """host_memory leaves the plan a room for offloaded activations: a schedule parking more
    does not fit, so the planner takes one that parks less (never predicted faster than
    the one it could not have), or says no schedule fits both budgets."""
    p = llama_like()
    lean = min_budget(p)
    with pytest.raises(OffloadRoomExceeded, match="host_memory"):
        plan_step(p, lean, GPU_DEFAULT, options=PlannerOptions(offload_room=0))
    tighter = 0
    for budget in (int(lean * f) for f in (1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.2)):
        free = plan_step(p, budget, GPU_DEFAULT)
        parked = _parked(free)
        assert plan_step(p, budget, GPU_DEFAULT, options=PlannerOptions(offload_room=parked)).config == free.config
        if not parked:
            continue
        try:
            tight = plan_step(p, budget, GPU_DEFAULT, options=PlannerOptions(offload_room=parked - 1))
        except OffloadRoomExceeded:
            continue
        tighter += 1
        assert _parked(tight) < parked and tight.step_time >= free.step_time
        validate(tight.schedule, budget)
    assert tighter


def test_infeasible_budget_names_the_minimum():
    p = llama_like()
    need = min_budget(p)
    with pytest.raises(MegatrainValueError, match=f"gpu_memory >= {need} bytes") as info:
        plan_step(p, need - 1, GPU_DEFAULT)
    assert isinstance(info.value, ValueError) and info.value.min_budget == need
    # ... and says what fills the device there, so the user knows what to shrink.
    assert "working set" in str(info.value) and "boundary activations" in str(info.value)
    # One region larger than the whole budget: nothing can fit, whatever else is small.
    big = Problem.chain([10, 5 * GB, 10])
    with pytest.raises(InfeasibleBudget) as info:
        plan_step(big, GB, GPU_DEFAULT)
    assert info.value.min_budget == min_budget(big) >= 5 * GB


@budget_settings(100)
@given(problems(), st.integers(1, 3), st.integers(0, 1))
def test_live_bytes_at_the_peak_sum_to_the_peak(problem, slots, lag):
    from megatrain.plan.problem import _Shape
    from megatrain.plan.program import _program, live_at, program_peak

    sh = _Shape(problem)
    cfg = PlanConfig(slots, None, 0, lag, frozenset(sh.offloadable))
    peak, at = program_peak(_program(sh, cfg, 1, memory_only=True), problem.base_bytes)
    if at is not None:
        assert sum(n for n, _ in live_at(sh, cfg, at).values()) == peak


def test_symbolic_sizes_peak_expression_and_longest_fitting_sequence():
    B, T = sympy.symbols("batch seq", positive=True, integer=True)
    hidden = 4096
    act = 2 * B * T * hidden
    p = Problem.chain([400_000_000] * 6, out_bytes=act, flops=2 * B * T * 200_000_000,
                      work_fw=6 * act, work_bw=12 * act)
    plan = plan_step(p, 8 * GB, GPU_DEFAULT, dims={B: 1, "seq": 4096})
    expr = plan.peak_expression()
    assert expr.free_symbols == {B, T}
    assert int(expr.subs({B: 1, T: 4096})) == plan.peak_bytes
    longest = largest_fitting(expr, T, 8 * GB, {B: 1})
    assert int(expr.subs({B: 1, T: longest})) <= 8 * GB < int(expr.subs({B: 1, T: longest + 1}))
    with pytest.raises(MegatrainValueError, match="batch"):
        plan_step(p, 8 * GB, GPU_DEFAULT, dims={T: 4096})


def test_shared_weight_gradient_leaves_once_after_its_last_producer():
    # Tied embedding: region 0 (embed) and region 3 (head) read weight 0.
    w = [Weight(0, 1000, 500), Weight(1, 100, 50), Weight(2, 100, 50)]
    regions = [RegionSpec(0, (0,), (), 10, 1, 1, 10**9), RegionSpec(1, (1,), (0,), 10, 1, 1, 10**9),
               RegionSpec(2, (2,), (1,), 10, 1, 1, 10**9), RegionSpec(3, (0,), (2,), 10, 1, 1, 10**9)]
    p = Problem(tuple(regions), tuple(w), micro_batches=2)
    plan = plan_step(p, 10**6, GPU_DEFAULT)
    validate(plan.schedule, 10**6)
    d2h = [t for t in plan.schedule.streams["d2h"] if t.kind == "d2h" and 0 in plan.schedule.graph.nodes[t]["weights"]]
    assert [t.region for t in d2h] == [0] * 4  # owner: region 0, last in backward; 2 micro x 2 steps
    hosts = [t for t in plan.schedule.streams["host"] if t.region == 0]
    assert [(t.kind, t.micro) for t in hosts] == [("host_acc", 0), ("host_step", 1)] * 2


def test_copies_are_charged_link_bytes_and_a_host_update_its_own_bytes():
    """Weights cross the link as fp32 masters and gradients as fp32 (link_nbytes), not at
    their bf16 device size; a host update is charged its 28 B/param at the probed rate,
    whatever its region's copies move (the probe took that rate beside a busy link), so a
    weight fetched twice costs its update nothing more."""
    numel = random.randint(10**6, 10**7)
    tied = random.random() < 0.5  # a weight read by two regions is fetched twice per pass
    w = [Weight(0, 2 * numel, numel, link_nbytes=4 * numel, grad_link_nbytes=4 * numel),
         Weight(1, 2 * numel, numel, link_nbytes=4 * numel, grad_link_nbytes=4 * numel)]
    regions = [RegionSpec(0, (0,), (), 10, 1, 1, 10**9), RegionSpec(1, (1,), (0,), 10, 1, 1, 10**9),
               RegionSpec(2, (0,) if tied else (), (1,), 10, 1, 1, 10**9)]
    s = simulate(Problem(tuple(regions), tuple(w)), PlanConfig(2, None, 0, 1), GPU_DEFAULT, steps=1)

    def seconds(kind, region):
        (t,) = [t for t in s.graph if t.kind == kind and t.region == region and t.phase in ("fw", "host")]
        return s.end[t] - s.start[t]

    assert seconds("h2d", 1) == pytest.approx(4 * numel / GPU_DEFAULT.h2d)  # forward: h2d alone
    owner_of_0 = 0  # last in backward among its readers
    for region in (1, owner_of_0):
        assert seconds("host_step", region) == pytest.approx(numel / GPU_DEFAULT.adamw)


def test_update_sites_take_their_weights_off_the_link_and_the_host():
    """Once update_sites has moved some updates off the host, the same schedule is timed as
    the runtime runs it: a resident weight's fetches, gradient copy and update take no
    time; a device site leaves no host update and sends its state both ways (24 B/param)
    with the gradient's copy. Nothing else moves, the peak included."""
    numel = random.randint(10**6, 10**7)
    w = [Weight(i, 2 * numel, numel, link_nbytes=4 * numel, grad_link_nbytes=4 * numel) for i in range(3)]
    regions = [RegionSpec(i, (i,), (i - 1,) if i else (), 10, 1, 1, 10**9) for i in range(3)]
    problem = Problem(tuple(regions), tuple(w))
    cfg = PlanConfig(2, None, 0, 1)
    slow_host = GPU_DEFAULT.scaled(host=0.05)  # the host's updates bound the step
    planned = simulate(problem, cfg, slow_host, steps=2)
    sited = simulate(with_update_sites(problem, {0: "resident", 1: "device"}), cfg, slow_host, steps=2)

    def seconds(s, kind, region, phase):
        ts = [t for t in s.graph if t.kind == kind and t.region == region and t.phase == phase]
        assert ts, (kind, region, phase)
        return sum(s.end[t] - s.start[t] for t in ts)

    for phase in ("fw", "bw"):
        assert seconds(sited, "h2d", 0, phase) == 0 < seconds(planned, "h2d", 0, phase)
        assert seconds(sited, "h2d", 1, phase) == pytest.approx(seconds(planned, "h2d", 1, phase))
    assert seconds(sited, "d2h", 0, "bw") == 0
    shared = link_rates(GPU_DEFAULT, True, True).d2h  # the backward fetches while gradients leave
    assert seconds(sited, "d2h", 1, "bw") == pytest.approx(2 * 24 * numel / shared)  # two steps
    assert seconds(sited, "d2h", 2, "bw") == pytest.approx(seconds(planned, "d2h", 2, "bw"))
    assert seconds(sited, "host_step", 0, "host") == seconds(sited, "host_step", 1, "host") == 0
    assert seconds(sited, "host_step", 2, "host") == pytest.approx(seconds(planned, "host_step", 2, "host"))
    assert seconds(planned, "host_step", 2, "host") > 0
    assert sited.peak_bytes == planned.peak_bytes and sited.config == planned.config
    assert sited.step_time < planned.step_time
    assert with_update_sites(problem, {0: "host"}) == problem
    with pytest.raises(ValueError, match="'gpu'"):
        with_update_sites(problem, {0: "gpu"})


def test_updates_that_wait_for_the_norm_follow_the_backward():
    """With clipping the host updates wait for the step's last gradient and then run in the
    next forward's order: on a host-bound step the prediction grows by about the updates
    the backward used to hide, and the peak and configuration do not move."""
    numel = random.randint(10**6, 10**7)
    n = random.randint(3, 6)
    w = [Weight(i, 2 * numel, numel, link_nbytes=4 * numel, grad_link_nbytes=4 * numel) for i in range(n)]
    regions = [RegionSpec(i, (i,), (i - 1,) if i else (), 10, 1, 1, 10**9) for i in range(n)]
    problem = Problem(tuple(regions), tuple(w))
    cfg = PlanConfig(2, None, 0, 1)
    slow_host = GPU_DEFAULT.scaled(host=0.05)
    free = simulate(problem, cfg, slow_host, steps=2)
    waiting = simulate(dataclasses.replace(problem, updates_wait=True), cfg, slow_host, steps=2)
    _assert_updates_wait(waiting)
    host = sum(free.end[t] - free.start[t] for t in free.streams["host"]) / 2
    assert host > free.compute_seconds                     # the host bounds the step
    # what clipping adds on the host: per parameter, with fp32 gradients (4 B), the hold's
    # copy (8 B) and norm (4 B) and the update's in-place scaling (8 B)
    busy = sum(waiting.end[t] - waiting.start[t] for t in waiting.streams["host"]) / 2
    bandwidth = slow_host.adamw * 28
    assert busy == pytest.approx(host + n * numel * (8 + 4 + 8) / bandwidth, rel=1e-9)
    assert waiting.step_time > free.step_time
    assert waiting.peak_bytes == free.peak_bytes and waiting.config == free.config
    # with every update off the host nothing waits: the same timeline as without
    everywhere = with_update_sites(problem, {i: "resident" for i in range(n)})
    assert simulate(dataclasses.replace(everywhere, updates_wait=True), cfg, slow_host, 2).step_time == \
        pytest.approx(simulate(everywhere, cfg, slow_host, 2).step_time)


def test_validator_catches_broken_schedules():
    p = llama_like(4)
    plan = plan_step(p, 100 * GB, GPU_DEFAULT)
    s = plan.schedule
    validate(s, 100 * GB)
    assert violations(s, s.peak_bytes - 1)  # over budget
    # Move one compute before its weights arrive.
    c = next(t for t in s.streams["compute"] if t.kind == "compute" and t.region == 2)
    start = dict(s.start)
    start[c] = 0.0
    broken = type(s)(**{**s.__dict__, "start": start})
    with pytest.raises(ScheduleInvalid, match="before its weights"):
        validate(broken)
    # Two regions in one slot.
    slot_of = {t: 0 for t in s.slot_of}
    crowded = type(s)(**{**s.__dict__, "slot_of": slot_of})
    if s.config.slots > 1:
        assert any("holds region" in v for v in violations(crowded))
    # A host step that no longer waits for its gradient.
    h = next(t for t in s.streams["host"] if t.kind == "host_step")
    start = dict(s.start)
    start[h] = 0.0
    early = type(s)(**{**s.__dict__, "start": start})
    assert any("host step" in v for v in violations(early))


def test_problem_errors_name_the_value():
    with pytest.raises(MegatrainValueError, match="forward"):
        Problem((RegionSpec(0, (), (1,)), RegionSpec(1)))
    with pytest.raises(MegatrainValueError, match="backward_order"):
        Problem((RegionSpec(0), RegionSpec(1, (), (0,))), backward_order=(0, 1))
    with pytest.raises(MegatrainValueError, match="unknown weights"):
        Problem((RegionSpec(0, (3,)),))
    with pytest.raises(ValueError, match="rates must be"):
        Rates("x", 0, 1, 1, 1, 1)


def test_many_random_chains_stay_valid_quickly():
    """A cheap sweep beside hypothesis: plain random chains of every length up to 200."""
    rng = random.Random(7)
    for n in (1, 2, 3, 5, 17, 64, 200):
        p = Problem.chain([rng.choice([0, 10**3, 10**6, 10**9]) for _ in range(n)],
                          out_bytes=[rng.randint(0, 10**8) for _ in range(n)],
                          flops=[rng.randint(0, 10**13) for _ in range(n)], work_bw=10**7)
        budget = int(min_budget(p) * rng.uniform(1, 3))
        validate(plan_step(p, budget, GPU_DEFAULT, options=SMALL).schedule, budget)


def test_kept_weights_skip_the_backward_fetch_and_count_until_the_backward():
    """A chain of 4 layers with their own weights and a head tied to the embedding: with
    room, every layer keeps its forward weights (not the tied pair, which two regions
    read); the backward fetches only the head; each kept buffer lives from the forward's
    prefetch to the backward's free, so the peak grows by what is kept beside the
    plain plan, and the predicted step is no slower, the host reading fewer masters."""
    from megatrain.plan.problem import _Shape

    MB = 1 << 20
    w = [Weight(0, 8 * MB, MB)] + [Weight(i, 4 * MB, MB // 2) for i in range(1, 5)]
    regions = [RegionSpec(0, (0,), (), 2 * MB, 2 * MB, 2 * MB, 10**9, bw_weights=())]  # a lookup
    regions += [RegionSpec(i, (i,), (i - 1,), 2 * MB, 2 * MB, 2 * MB, 10**12) for i in range(1, 5)]
    regions += [RegionSpec(5, (0,), (4,), 2 * MB, 4 * MB, 4 * MB, 10**12)]
    problem = Problem(tuple(regions), tuple(w))
    assert _Shape(problem).keepable == (4, 3, 2, 1)
    plain = plan_step(problem, 1 << 40, GPU_DEFAULT, options=PlannerOptions())
    kept = plan_step(problem, 1 << 40, GPU_DEFAULT, options=PlannerOptions(keep=True))
    validate(kept.schedule, 1 << 40)
    assert kept.config.kept_weights == {1, 2, 3, 4}
    bw_fetches = {t.region for t in kept.schedule.streams["h2d"] if t.phase == "bw"}
    assert bw_fetches == {5}
    assert kept.step_time <= plain.step_time
    assert kept.peak_bytes > plain.peak_bytes
    # A budget between the two: fewer regions kept, the soonest needed (region 4) first.
    mid = plan_step(problem, (plain.peak_bytes + kept.peak_bytes) // 2, GPU_DEFAULT, options=PlannerOptions(keep=True))
    assert 0 < len(mid.config.kept_weights) < 4 and 4 in mid.config.kept_weights
    assert mid.peak_bytes <= (plain.peak_bytes + kept.peak_bytes) // 2
    with pytest.raises(ValueError, match="cannot keep"):
        simulate(problem, PlanConfig(2, None, 0, 1, kept_weights=frozenset({5})), GPU_DEFAULT)
