"""The host_memory option: what a compiled graph adds to host RAM (compiler/host_budget.py)
is counted from the model and the plan, held to the budget before the first step runs, and
a refusal names the parts and the fix and leaves the model as it was."""

from __future__ import annotations

import copy

import pytest
import torch

import megatrain
from megatrain.memory import host_store
from megatrain.models import Llama

from .helpers import SMALL_VOCAB as VOCAB
from .helpers import (
    compile_streamed,
    flat,
    parse_forced,
    random_batches,
    small_llama_config,
)


@pytest.fixture(autouse=True)
def no_cached_rates(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))


def first_step(model, opt, **options):
    torch._dynamo.reset()
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager", **options})
    ids, labels = random_batches(VOCAB, 1, batch=2, seq=16)[0]
    loss = step(ids, labels=labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return megatrain.explain(step)


def test_host_memory_is_parsed_and_bounded_by_the_host(monkeypatch):
    monkeypatch.setattr(host_store, "host_memory", lambda: (10 << 30, 16 << 30))
    assert parse_forced({"device": "cpu"}).host_memory == (10 << 30) - host_store.host_margin(16 << 30)
    assert parse_forced({"device": "cpu", "host_memory": "3GiB"}).host_memory == 3 << 30
    with pytest.raises(ValueError, match=r"host_memory='32GiB' is 34359738368 bytes, more than this "
                                         r"host's 17179869184 bytes of RAM"):
        parse_forced({"device": "cpu", "host_memory": "32GiB"})
    with pytest.raises(ValueError, match=r"host_memory='lots' is not a size"):
        parse_forced({"device": "cpu", "host_memory": "lots"})
    monkeypatch.setattr(host_store, "host_memory", lambda: None)
    assert parse_forced({"device": "cpu"}).host_memory is None


def test_the_graphs_host_needs_are_counted_from_the_model_and_the_plan():
    """megatrain.AdamW: the moments it will create (8 B/param) and two slabs of the largest
    region's gradients; once its state exists, a recompile counts no moments. A torch
    optimizer: the fp32 p.grad the runtime fills (4 B/param)."""
    torch.manual_seed(0)
    model = Llama(small_llama_config(2, False))
    numel = sum(p.numel() for p in model.parameters())
    regions = [list(model.embed_tokens.parameters()), *(list(m.parameters()) for m in model.layers),
               [*model.norm.parameters(), *model.lm_head.parameters()]]
    largest = max(sum(p.numel() for p in ps) for ps in regions)
    opt = megatrain.AdamW(model.parameters(), lr=1e-3)
    needs = first_step(model, opt).host_needs
    assert needs["optimizer moments to create"] == 8 * numel
    assert needs["gradient slabs (2 of the largest region's)"] == 2 * 4 * largest
    assert "fp32 gradients (p.grad)" not in needs
    again = first_step(model, opt).host_needs
    assert "optimizer moments to create" not in again

    plain = copy.deepcopy(model)
    needs = first_step(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3)).host_needs
    assert needs == {"fp32 gradients (p.grad)": 4 * numel}


def test_a_budget_one_byte_short_is_refused_before_anything_moves():
    torch.manual_seed(1)
    model = Llama(small_llama_config(2, False))
    probe = copy.deepcopy(model)
    need = sum(first_step(probe, megatrain.AdamW(probe.parameters(), lr=1e-3)).host_needs.values())

    before = flat(model.parameters()).clone()
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    opt = megatrain.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=rf"needs {need} bytes .* of host memory beyond the model's "
                                         rf"parameters \(optimizer moments to create .*give host_memory "
                                         rf"of at least {need} bytes"):
        first_step(model, opt, host_memory=need - 1)
    assert torch.equal(flat(model.parameters()), before) and not opt.state
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages
    plan = first_step(model, opt, host_memory=need)  # the corrected budget trains
    assert sum(plan.host_needs.values()) == need and plan.graphs[0].host_memory == need


def test_the_gradient_slabs_get_what_host_memory_leaves():
    """The runtime's slabs may grow into host_memory less every other need of the graph."""
    torch.manual_seed(2)
    model = Llama(small_llama_config(2, False))
    opt = megatrain.AdamW(model.parameters(), lr=1e-3)
    budget = 64 << 20
    plan = first_step(model, opt, host_memory=budget).graphs[0]
    others = sum(v for k, v in plan.host_needs.items() if not k.startswith("gradient slabs"))
    assert plan.streamer._slabs.host_bytes == budget - others > 0
