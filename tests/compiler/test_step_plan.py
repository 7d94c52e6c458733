"""The StepPlan (plan/step_plan.py): every decision for a compiled graph pair in one frozen
value, the one thing the runtime is configured from and explain shows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import megatrain
from megatrain.models import Llama

from .helpers import SMALL_VOCAB as VOCAB
from .helpers import compile_streamed, random_batches, small_llama_config


@pytest.fixture(autouse=True)
def no_cached_rates(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))


def compiled_plan(model, **options):
    torch._dynamo.reset()
    opt = megatrain.AdamW(model.parameters(), lr=1e-3)
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager", **options})
    ids, labels = random_batches(VOCAB, 1, batch=2, seq=16)[0]
    step(ids, labels=labels).backward()
    opt.step()
    return megatrain.explain(step).graphs[0]


@pytest.mark.parametrize("forced", [{}, {"updates": "resident", "backlog": "host"},
                                    {"updates": "device", "grad_chunk": 8192}],
                         ids=["defaults", "resident+backlog", "device+ring"])
def test_the_runtime_is_built_from_one_frozen_plan_that_holds_every_decision(forced):
    torch.manual_seed(0)
    model = Llama(small_llama_config(2, False))
    graph = compiled_plan(model, **forced)
    step = graph.step_plan
    assert graph.streamer.step_plan is step
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.prefetch = 3
    # every region of the graph, named; the gradient regions with the parameters they send
    assert [r.id for r in step.regions] == [r.id for r in graph.regions]
    assert {r.id: r.params for r in step.regions if r.params} == graph.update_params
    assert sorted(p for r in step.regions for p in r.params) == list(range(len(list(model.parameters()))))
    # what explain shows is what the runtime runs
    assert step.sites == graph.update_sites and step.update_reserve == graph.update_reserve
    runtime = graph.streamer
    device_sites = {r for r, s in step.sites.items() if s == "device"}
    assert set(runtime.device_updates.regions if runtime.device_updates else ()) == device_sites
    route = {"backlog": runtime.deadlines is not None, "ring": runtime._ring is not None}
    assert route == {"backlog": step.gradients.route == "backlog", "ring": step.gradients.route == "ring"}
    assert step.prefetch == graph.schedule.slots - 1
    assert step.predicted_peak_bytes == graph.predicted_peak_bytes
    assert all(r.name in step.describe() for r in step.regions)


def test_the_same_model_and_options_give_an_equal_plan_and_a_second_plan_is_refused():
    """Equal inputs, equal plans (host_memory given: its default is the RAM free now)."""
    torch.manual_seed(1)
    model = Llama(small_llama_config(2, False))
    first = compiled_plan(model, host_memory="4GiB").step_plan
    again = compiled_plan(model, host_memory="4GiB")
    assert again.step_plan == first
    runtime = again.streamer
    runtime.configure(first)  # equal: nothing to do
    with pytest.raises(AssertionError, match="one StepPlan"):
        runtime.configure(dataclasses.replace(first, prefetch=first.prefetch + 1))
