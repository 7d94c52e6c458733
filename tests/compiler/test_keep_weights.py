"""Option keep_weights: the forward's weight buffers of the regions whose backward comes
first stay on the device for that backward instead of being fetched again (planner:
PlanConfig.kept_weights; runtime: Streamer.keep and wait). On the CPU device the results must equal
fetching twice bitwise, since the masters do not change between a forward and its backward;
the memory side is held to the plan by test_memory_contract.py."""

from __future__ import annotations

import copy

import pytest
import torch

import megatrain
from megatrain.errors import MegatrainValueError
from megatrain.models import Llama

from .helpers import compile_streamed, SMALL_VOCAB, breaking_llama, flat, random_batches, small_llama_config, train_megatrain

VOCAB = SMALL_VOCAB


def llama(tied: bool, layers: int = 3) -> Llama:
    return Llama(small_llama_config(layers, tied))


def options(keep: bool, lowering: str = "eager") -> dict:
    return {"device": "cpu", "precision": "fp32", "lowering": lowering, "keep_weights": keep}


@pytest.mark.parametrize("tied,lowering", [(False, "eager"), (True, "eager"), (False, "inductor")])
def test_kept_weights_train_bitwise_like_fetching_twice(tied, lowering):
    torch.manual_seed(0)
    model = llama(tied)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    kept = train_megatrain(model, batches, options(True, lowering))
    twice = train_megatrain(model, batches, options(False, lowering))
    assert torch.equal(kept["params"], twice["params"]) and kept["losses"] == twice["losses"]
    graph = kept["plan"]
    layers = set(graph.schedule.plan.config.kept_weights)
    assert len(layers) >= 3, graph.schedule.plan.config  # every layer: the budget is roomy
    assert not twice["plan"].schedule.plan.config.kept_weights
    bw_fetched = {int(e[len("prefetch("):-1]) for e in graph.backward_events if e.startswith("prefetch(")}
    assert not bw_fetched & layers
    assert sum(e.startswith("keep(") for e in graph.forward_events) == len(layers)
    assert graph.streamer.last_stats.kept_hits == len(layers)  # taken, not fetched again


def test_kept_weights_with_accumulation_and_clipping():
    torch.manual_seed(1)
    model = llama(False)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    kept = train_megatrain(model, batches, options(True), max_grad_norm=0.5, accumulate=True)
    twice = train_megatrain(model, batches, options(False), max_grad_norm=0.5, accumulate=True)
    assert torch.equal(kept["params"], twice["params"]) and kept["losses"] == twice["losses"]


def test_a_forward_without_backward_gives_its_kept_weights_back():
    """A forward whose loss is dropped (say, a loss logged with grad on) leaves kept
    buffers; the next forward releases them, so the budget's accounting stays exact and
    training goes on as without keeping."""
    torch.manual_seed(2)
    base = llama(False)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    out = {}
    for keep in (True, False):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        opt = megatrain.AdamW(model.parameters(), lr=3e-3)
        step = compile_streamed(model, options(keep))
        losses = []
        for ids, labels in batches:
            step(ids, labels=labels)  # dropped: no backward
            loss = step(ids, labels=labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        (graph,) = megatrain.explain(step).graphs
        assert graph.streamer.pool.live == 0 or keep, graph.streamer.pool.live
        out[keep] = (losses, flat(model.parameters()))
        if keep:
            step(*batches[0])  # one more dropped forward, then a fresh one: nothing leaks
            held = graph.streamer.pool.live
            step(*batches[0])
            assert graph.streamer.pool.live == held
    assert out[True][0] == out[False][0] and torch.equal(out[True][1], out[False][1])


def test_keep_weights_option_is_checked():
    with pytest.raises(MegatrainValueError, match="keep_weights='yes'"):
        compile_streamed(llama(False), {"device": "cpu", "keep_weights": "yes"})(
            torch.zeros(1, 4, dtype=torch.long))


def test_kept_weights_with_a_graph_run_for_every_layer():
    """A graph break inside the layer loop: dynamo compiles one layer's graph and runs it
    for every layer, so its forwards all run before the backwards, each module with its
    own weights. A backward takes a kept buffer only if it holds its own module's weights
    (else it fetches them); results equal fetching twice."""
    torch.manual_seed(3)
    model = breaking_llama("inside the layer loop", small_llama_config())
    batches = random_batches(VOCAB, 2, batch=2, seq=16)
    with pytest.warns(UserWarning, match="graph break"):
        kept = train_megatrain(model, batches, options(True))
        twice = train_megatrain(model, batches, options(False))
    assert torch.equal(kept["params"], twice["params"]) and kept["losses"] == twice["losses"]
    graphs = megatrain.explain(kept["step"]).graphs
    assert any(g.schedule.plan.config.kept_weights for g in graphs if g.schedule is not None)
