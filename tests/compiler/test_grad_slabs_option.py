"""The option grad_slabs (runtime/grad_slabs.py): how many host slabs gradients may wait in
for megatrain.AdamW. With the optimizer slowed down so the backward lags, and GPU work
that needs no host update to overlap, the default adds slabs (host memory permitting)
where a bound makes the backward wait; the results are the same either way, bitwise."""

from __future__ import annotations

import time

import pytest
import torch

import megatrain
from megatrain.errors import MegatrainValueError
from megatrain.models import Llama
from megatrain.memory import host_store
from megatrain.runtime.streamer import Streamer

from .helpers import SMALL_VOCAB, random_batches, small_llama_config, train_megatrain


@pytest.fixture(autouse=True)
def no_cached_rates(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))


def train(model, batches, **options):
    out = train_megatrain(model, batches, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                           **options})
    (graph,) = megatrain.explain(out["step"]).graphs
    return dict(out, slabs=graph.streamer._slabs)


@pytest.fixture
def lagging_host(monkeypatch):
    """Every region update takes 40 ms longer, the host has room to spare, and the
    streamer says the GPU has work to overlap the lag with (as resident regions would on a
    GPU, which on the CPU either take every region or leave the host path alone)."""
    apply = megatrain.AdamW._apply_region

    def slow_apply(self, parts, hypers):
        time.sleep(0.04)
        return apply(self, parts, hypers)

    monkeypatch.setattr(megatrain.AdamW, "_apply_region", slow_apply)
    monkeypatch.setattr(host_store, "host_memory", lambda: (48 << 30, 64 << 30))
    monkeypatch.setattr(Streamer, "_host_lag_overlaps", lambda self: True)


def test_slabs_grow_while_the_host_lags_and_a_bound_holds(lagging_host):
    torch.manual_seed(0)
    model = Llama(small_llama_config(4))
    batches = random_batches(SMALL_VOCAB, 2, batch=2, seq=16)
    grown = train(model, batches)
    bounded = train(model, batches, grad_slabs=2)
    assert grown["slabs"].max_slabs is None and bounded["slabs"].max_slabs == 2
    assert grown["slabs"].allocated > 2, "the lagging optimizer's backward got no more slabs"
    assert bounded["slabs"].allocated == 2
    assert torch.equal(grown["params"], bounded["params"]) and grown["losses"] == bounded["losses"]


def test_the_device_backlog_keeps_two_slabs_and_the_option_is_checked():
    model = Llama(small_llama_config(1))
    batches = random_batches(SMALL_VOCAB, 1, batch=1, seq=8)
    assert train(model, batches, backlog="device")["slabs"].max_slabs == 2
    assert train(model, batches, backlog="host")["slabs"].max_slabs is None
    for bad in (0, "many", True):
        with pytest.raises(MegatrainValueError, match=f"grad_slabs={bad!r}"):
            train(model, batches, grad_slabs=bad)


@pytest.mark.parametrize("updates, backlog, overlap", [
    ("host", None, False), ("resident", None, True), ("device", None, True), ("host", "host", True)])
def test_slabs_grow_only_where_the_gpu_has_work_beside_the_lag(updates, backlog, overlap):
    """Where every update goes through the host in arrival order the next forward waits
    for the host's last update whatever the slabs, so they stay at two; updates that
    bypass the host, or the host backlog's deferred ones, overlap GPU work."""
    model = Llama(small_llama_config(2))
    batches = random_batches(SMALL_VOCAB, 2, batch=1, seq=8)
    slabs = train(model, batches, updates=updates, backlog=backlog)["slabs"]
    assert slabs.overlap() is overlap
