"""The host update's cost (plan/costs.py, plan/simulate.py): the probe measures fused AdamW
beside a link copying both ways and on a quiet one; a step's updates are charged between
the two by the share of the step its planned copies keep the link busy."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatrain.plan import costs
from megatrain.plan.costs import ADAMW_BYTES_PER_PARAM, GPU_DEFAULT
from megatrain.plan.program import PlanConfig
from megatrain.plan.simulate import simulate
from tests.compiler.test_plan_waits import _chain


@given(busy=st.floats(1e8, 1e11), speedup=st.floats(1.0, 4.0), share=st.floats(0.0, 1.0))
def test_the_update_rate_lies_between_the_busy_and_the_quiet_links(busy, speedup, share):
    rates = dataclasses.replace(GPU_DEFAULT, adamw=busy, adamw_quiet=busy * speedup)
    bw = costs.host_bandwidth(rates, share)
    lo, hi = busy * ADAMW_BYTES_PER_PARAM, busy * speedup * ADAMW_BYTES_PER_PARAM
    assert lo * (1 - 1e-9) <= bw <= hi * (1 + 1e-9)
    assert costs.host_bandwidth(rates, 0.0) == pytest.approx(hi)
    assert costs.host_bandwidth(rates, 1.0) == pytest.approx(lo)
    # seconds per parameter are the shares' weighted sum of the two rates' seconds
    want = (1 - share) / (busy * speedup) + share / busy
    assert costs.host_step_seconds(10**9, rates, share) == pytest.approx(1e9 * want)
    assert costs.host_bandwidth(rates, min(1.0, share + 0.1)) <= bw * (1 + 1e-9)
    # rates without a quiet-link measurement (a CPU device, older caches) charge the busy one
    assert costs.host_bandwidth(dataclasses.replace(rates, adamw_quiet=None), share) == pytest.approx(lo)


def test_the_link_share_is_the_planned_copies_over_both_directions_of_the_compute():
    assert costs.link_busy_share(1.0, 1.0) == 0.5
    assert costs.link_busy_share(3.0, 1.0) == 1.0
    assert costs.link_busy_share(0.0, 2.0) == 0.0
    assert costs.link_busy_share(1.0, 0.0) == 1.0


@pytest.mark.parametrize("trial", range(3))
def test_a_simulated_update_is_charged_at_the_steps_link_share(trial):
    """Fresh sizes and rates: each host update's simulated seconds equal the update's
    bytes at the bandwidth the step's own copies and compute give; a quiet rate equal to
    the busy one charges the busy rate, as before it was measured."""
    rng = random.Random(trial * 7919 + random.randrange(10**6))
    n, numel = rng.randint(2, 6), rng.randint(10**6, 10**8)
    problem = _chain(n, numel)
    rates = dataclasses.replace(GPU_DEFAULT, adamw=rng.uniform(1e9, 5e9), flops=rng.uniform(1e9, 1e13))
    rates = dataclasses.replace(rates, adamw_quiet=rates.adamw * rng.uniform(1.1, 2.0))
    sched = simulate(problem, PlanConfig(2, None, 0, 1), rates)
    tasks = sched.graph.nodes
    link = sum(d["seconds"] for t, d in tasks(data=True) if d["stream"] in ("h2d", "d2h"))
    compute = sum(d["seconds"] for t, d in tasks(data=True) if t.kind == "compute")
    share = costs.link_busy_share(link, compute)
    assert 0.0 < share < 1.0 or share == 1.0
    steps = [(t, d) for t, d in tasks(data=True) if t.kind == "host_step"]
    assert steps
    for t, d in steps:
        assert d["seconds"] == pytest.approx(costs.host_step_seconds(numel, rates, share), rel=1e-9)
        assert costs.host_step_seconds(numel, rates, 1.0) >= d["seconds"] >= costs.host_step_seconds(numel, rates, 0.0)
    same = simulate(problem, PlanConfig(2, None, 0, 1), dataclasses.replace(rates, adamw_quiet=rates.adamw))
    for t, d in same.graph.nodes(data=True):
        if t.kind == "host_step":
            assert d["seconds"] == pytest.approx(numel * ADAMW_BYTES_PER_PARAM / (rates.adamw * ADAMW_BYTES_PER_PARAM))
