"""Training's host update rate, held to the plan's and written beside the probe's rates.

A plan charges the host's AdamW updates at the probe's rate; the runtime measures the rate
training reaches and, where the two differ by more than the tolerance, scales the cached
rates so the next compile plans with training's. These tests fill a probe cache by hand
(the test session's cache folder is private, tests/conftest.py), so the rates are known.
"""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch

import megatrain
from megatrain.compiler import rates as compile_rates_mod
from megatrain.models import Llama, LlamaConfig
from megatrain.plan import costs
from megatrain.plan.problem import Problem
from megatrain.plan.program import PlanConfig
from megatrain.plan.simulate import simulate
from megatrain.runtime import host_rate, probe

from ..compiler.helpers import compile_streamed, random_batches


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(host_rate, "_settled", set())


def write_cache(adamw: float, quiet: float | None = None) -> costs.Rates:
    rates = costs.Rates(probe.device_name("cpu"), h2d=1e10, d2h=1e10, duplex=1.5e10, flops=1e11,
                        adamw=adamw, memory=1e10, adamw_quiet=quiet)
    path = probe.cache_path(rates.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rates": rates.to_json(), "meta": {}}))
    return rates


def rows(rate: float, n: int = 4, at_once: bool = True) -> list[tuple]:
    """Host update rows of one step: `n` updates of random sizes at `rate` params/s."""
    out, t = [], random.uniform(0, 10)
    for region in range(n):
        numel = random.randint(1_000, 1_000_000)
        out.append((region, t, t + numel / rate, numel, at_once))
        t += numel / rate + random.uniform(0, 1e-3)
    return out


def test_the_rate_counts_only_updates_applied_at_once():
    fast, slow = rows(4e9), rows(1e9, at_once=False)
    assert host_rate.update_rate(fast + slow) == pytest.approx(4e9, rel=1e-9)
    assert host_rate.update_rate(slow) is None
    assert host_rate.update_rate([]) is None


def test_a_rate_within_the_tolerance_leaves_the_cache_alone():
    write_cache(2e9)
    watch = host_rate.HostRateWatch(torch.device("cpu"), planned=2e9)
    observed = 2e9 * (1 + host_rate.TOLERANCE * random.uniform(-0.9, 0.9))
    for _ in range(host_rate.SKIPPED_STEPS + host_rate.OBSERVED_STEPS):
        watch.observe(rows(observed))
    assert watch.done and watch.observed == pytest.approx(observed, rel=1e-9)
    assert watch.written_scale is None
    assert "training" not in json.loads(probe.cache_path(probe.device_name("cpu")).read_text())


def test_a_slower_host_scales_the_cached_rates_for_the_next_compile():
    """The skipped step does not count, accumulation steps neither; the median of the
    observed steps does; the cache's scale compounds with the one the plan was made with."""
    probed = write_cache(2e9, quiet=3e9)
    watch = host_rate.HostRateWatch(torch.device("cpu"), planned=2e9)
    watch.observe(rows(0.1e9))                       # skipped: the compile's step
    watch.observe(rows(5e9, at_once=False))          # a micro-batch's accumulation: not a step
    observed = [random.uniform(1.2e9, 1.6e9) for _ in range(host_rate.OBSERVED_STEPS)]
    with pytest.warns(UserWarning, match="later compiles here plan with the measured rate"):
        for r in observed:
            watch.observe(rows(r))
    median = sorted(observed)[len(observed) // 2]
    assert watch.observed == pytest.approx(median, rel=1e-9)
    assert watch.written_scale == pytest.approx(median / 2e9, rel=1e-9)
    scaled = compile_rates_mod.cached_rates(torch.device("cpu"))
    assert scaled.adamw == pytest.approx(probed.adamw * median / 2e9, rel=1e-9)
    assert scaled.adamw_quiet == pytest.approx(probed.adamw_quiet * median / 2e9, rel=1e-9)
    assert scaled.h2d == probed.h2d and scaled.flops == probed.flops

    # A second run planned with the scaled rate and still off compounds the scale.
    again = host_rate.record_training_rate("cpu", observed=0.5 * scaled.adamw, planned=scaled.adamw)
    assert again == pytest.approx(0.5 * median / 2e9, rel=1e-9)
    # Once per process and device: another graph's watch compares but writes nothing.
    other = host_rate.HostRateWatch(torch.device("cpu"), planned=2e9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(host_rate.SKIPPED_STEPS + host_rate.OBSERVED_STEPS):
            other.observe(rows(0.5e9))
    assert other.done and other.written_scale is None


def test_nothing_is_written_without_a_probe_cache_or_for_an_implausible_ratio():
    assert host_rate.record_training_rate("cpu", observed=1e9, planned=2e9) is None
    write_cache(2e9)
    assert host_rate.record_training_rate("cpu", observed=1e6, planned=2e9) is None
    assert compile_rates_mod.cached_rates(torch.device("cpu")).adamw == 2e9


def test_the_schedule_names_the_rate_it_charged_host_updates_at():
    """Without a quiet-link rate every update is charged at the busy one; with the
    optimizer waiting for the step's end (clipping) there is no one update's rate."""
    rates = costs.Rates("test", h2d=1e10, d2h=1e10, duplex=1.5e10, flops=1e12,
                        adamw=random.uniform(1e9, 4e9))
    problem = Problem.chain([random.randint(1_000, 100_000) * 2 for _ in range(4)],
                            out_bytes=100, flops=10**9)
    sched = simulate(problem, PlanConfig(2, None, 0, 1), rates)
    assert sched.host_update_rate == pytest.approx(rates.adamw, rel=1e-9)
    waiting = Problem(problem.regions, problem.weights, updates_wait=True)
    assert simulate(waiting, PlanConfig(2, None, 0, 1), rates).host_update_rate is None


def test_a_compiled_step_feeds_its_rate_back(monkeypatch):
    """End to end on the CPU, made a calibrated device for the test: the plan names the
    probe's rate, training measures its own, and the next compile reads the scaled one.
    The cached rate is set far above what this machine reaches, so the scale is written
    (the bounds on a plausible scale widened to admit it)."""
    monkeypatch.setattr(compile_rates_mod, "CALIBRATED", ("cuda", "cpu"))
    monkeypatch.setattr(host_rate, "_SCALE_BOUNDS", (1e-12, 1e12))
    write_cache(1e13)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=96, hidden=32, layers=2, heads=2, kv_heads=1, ffn=64,
                              rope_theta=10000.0))
    opt = megatrain.AdamW(model.parameters(), lr=1e-3)
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager"})
    with pytest.warns(UserWarning, match="later compiles here plan with the measured rate"):
        for ids, labels in random_batches(96, host_rate.SKIPPED_STEPS + host_rate.OBSERVED_STEPS + 1,
                                          batch=2, seq=8):
            step(ids, labels=labels).backward()
            opt.step()
            opt.zero_grad()
    watch = next(g.streamer.host_rate for g in megatrain.explain(step).graphs
                 if g.streamer is not None and g.streamer.host_rate is not None)
    assert watch.planned == pytest.approx(1e13, rel=1e-6)
    assert watch.done and watch.observed < 1e13
    assert compile_rates_mod.cached_rates(torch.device("cpu")).adamw == pytest.approx(watch.observed, rel=1e-6)
