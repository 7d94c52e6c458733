"""plan/waits.py: the GPU's waits in a simulated step, traced to what held each one, and
the warning a plan much slower than its compute gets."""

from __future__ import annotations

import dataclasses
import random
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import megatrain
from megatrain.compiler import rates
from megatrain.models import Llama
from megatrain.plan.costs import GPU_DEFAULT
from megatrain.plan.problem import Problem, RegionSpec, Weight
from megatrain.plan.program import PlanConfig
from megatrain.plan.simulate import simulate
from megatrain.plan.waits import REASONS, gpu_waits, slow_plan_warning
from tests.compiler.helpers import compile_streamed, random_batches, small_llama_config
from tests.compiler.test_planner import budget_settings, problems, rates_st


def _chain(n: int, numel: int) -> Problem:
    """n layers in a chain, each with one weight of `numel` bf16 parameters (fp32 over the
    link both ways) and a little compute."""
    w = [Weight(i, 2 * numel, numel, link_nbytes=4 * numel, grad_link_nbytes=4 * numel) for i in range(n)]
    regions = [RegionSpec(i, (i,), (i - 1,) if i else (), 10, 1, 1, 10**9) for i in range(n)]
    return Problem(tuple(regions), tuple(w))


def _idle_in_last_step(sched) -> float:
    """The compute stream's idle seconds from the previous step's last kernel to this
    step's last: what the waits must add up to."""
    compute = sched.streams["compute"]
    last = sched.steps - 1
    mine = [t for t in compute if t.step == last]
    before = [t for t in compute if t.step < last]
    begin = sched.end[before[-1]] if before else 0.0
    busy = sum(sched.end[t] - sched.start[t] for t in mine)
    return sched.end[mine[-1]] - begin - busy


@pytest.mark.parametrize("bound", ["host", "h2d"])
def test_a_host_or_link_bound_step_is_traced_to_its_bound_and_warned_of(bound):
    """A slow host optimizer (with clipping, so every update waits for the backward) or a
    slow link to the GPU makes the step many times its compute: the waits add up to the GPU's idle time,
    the largest is the bound's, and the warning names it with a region and a remedy."""
    n, numel = random.randint(3, 6), random.randint(10**6, 10**7)
    problem = _chain(n, numel)
    if bound == "host":
        problem = dataclasses.replace(problem, updates_wait=True)
        rates = GPU_DEFAULT.scaled(host=0.02)
    else:  # weights come in slowly; gradients leave at the usual rate
        rates = dataclasses.replace(GPU_DEFAULT, h2d=GPU_DEFAULT.h2d * 0.002)
    sched = simulate(problem, PlanConfig(2, None, 0, 1), rates, steps=2)
    waits = gpu_waits(sched)
    assert waits and waits[0].reason == bound and 0 <= waits[0].region < n
    assert sum(w.seconds for w in waits) == pytest.approx(_idle_in_last_step(sched), rel=1e-6)
    names = {i: f"layers.{i}" for i in range(n)}
    text = slow_plan_warning(sched, 1.5, names)
    assert text is not None and REASONS[bound] in text and names[waits[0].region] in text
    assert f"{sched.step_time / sched.compute_seconds:.1f}x" in text
    assert slow_plan_warning(sched, 1.01 * sched.step_time / sched.compute_seconds) is None


def test_a_compute_bound_step_gets_no_warning():
    """Fast links and host, heavy compute: the step is its compute, nothing is warned of."""
    problem = _chain(4, 10**5)
    problem = dataclasses.replace(problem, regions=tuple(
        dataclasses.replace(r, flops_fw=10**13) for r in problem.regions))
    sched = simulate(problem, PlanConfig(2, None, 0, 1), GPU_DEFAULT.scaled(link=100, host=100), steps=2)
    assert sched.step_time < 1.5 * sched.compute_seconds
    assert slow_plan_warning(sched, 1.5) is None


@budget_settings(150)
@given(problem=problems(max_regions=6), rates=rates_st, wait=st.booleans(), steps=st.integers(1, 3))
def test_the_waits_add_up_to_the_gpus_idle_time(problem, rates, wait, steps):
    """On random problems and rates, every idle gap of the last step is traced to one
    reason and region of the problem, and together they are the compute stream's idle
    time in that step."""
    problem = dataclasses.replace(problem, updates_wait=wait)
    sched = simulate(problem, PlanConfig(2, None, 0, 1), rates, steps=steps)
    waits = gpu_waits(sched)
    ids = {r.id for r in problem.regions}
    assert all(w.reason in REASONS and w.region in ids and w.seconds > 0 for w in waits)
    assert sum(w.seconds for w in waits) == pytest.approx(_idle_in_last_step(sched), rel=1e-6, abs=1e-9 * len(sched.streams["compute"]))


@pytest.mark.parametrize("ratio", [1e-3, None])
def test_the_backend_warns_of_a_slow_plan_naming_a_region(monkeypatch, ratio):
    """Where predictions hold (a CUDA device; the CPU let in here), the backend warns once a
    graph's predicted step is `slow_plan_ratio` times its compute, naming a region of the
    model by its name and what it waits for; slow_plan_ratio=None warns of nothing."""
    monkeypatch.setattr(rates, "CALIBRATED", ("cuda", "cpu"))
    torch.manual_seed(random.randint(0, 10**6))
    model = Llama(small_llama_config(layers=2))
    (ids, labels), = random_batches(model.config.vocab_size, 1, batch=2, seq=8)
    with megatrain.config.patch(slow_plan_ratio=ratio), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = compile_streamed(model, {"device": "cpu", "lowering": "eager"})
        step(ids, labels=labels).backward()
    slow = [str(w.message) for w in seen if "its GPU compute" in str(w.message)]
    if ratio is None:
        assert not slow
        return
    assert len(slow) == 1, slow
    names = megatrain.explain(step).graphs[0].streamer.region_names.values()
    assert "the GPU waits: region" in slow[0] and any(f"({n})" in slow[0] for n in names), slow[0]
