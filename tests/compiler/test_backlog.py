"""The gradient backlog (option backlog=True, megatrain.runtime.grad_backlog): gradients
that find no free host slab wait on the device and cross earliest deadline first.

The ordering and the bookkeeping are tested on CPU tensors directly; through the backend
(device="cpu", where every "device" buffer is a real separate copy) the optimizer is slowed
down so that slabs run out and regions really go through the backlog. Results must equal
backlog=False bitwise (same gradients, same updates, only the order of independent
per-region updates changes) and eager torch.optim.AdamW to test_backend_cpu.py's bounds.
"""

from __future__ import annotations

import time

import pytest
import torch

import megatrain
from megatrain.models import Llama
from megatrain.optim import engine
from megatrain.runtime.grad_backlog import EdfQueue, GradBacklog
from megatrain.runtime.grad_slabs import GradSlabs
from megatrain.runtime.pool import DevicePool, Reserve

from .helpers import (SMALL_VOCAB, breaking_llama, rel, random_batches, small_llama_config, train_eager,
                      train_megatrain)

VOCAB = SMALL_VOCAB


@pytest.fixture(autouse=True)
def no_cached_rates(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))


# ---- ordering and bookkeeping, no backend ----------------------------------------------


def test_edf_queue_serves_the_region_the_forward_fetches_first():
    q = EdfQueue()
    for region in [0, 1, 2, 3, 4, 5]:  # the forward's fetch order
        q.learn(region)
    q.learn(2)  # fetched again later in the forward (a tied weight): its first fetch counts
    for region in [5, 4, 3]:  # backward: last layer first
        q.push(region, 10, f"r{region}")
    assert q.bytes == 30 and q.peek() == 3
    assert q.pop(lambda item: 10) == (3, "r3")
    q.push(1, 10, "r1")
    q.push(9, 10, "r9")  # never fetched in a forward: last
    q.push(0, 10, "r0")
    assert [q.pop(lambda item: 10)[0] for _ in range(len(q))] == [0, 1, 4, 5, 9]
    assert q.bytes == 0
    q.push(4, 0, {"first": 1})  # the same region twice (a graph run for several modules)
    q.push(4, 0, {"second": 2})
    assert [q.pop()[1] for _ in range(2)] == [{"first": 1}, {"second": 2}]


def test_edf_follows_the_forward_order_not_the_region_ids():
    q = EdfQueue()
    for region in [3, 0, 2]:
        q.learn(region)
    for region in [0, 2, 3]:
        q.push(region, 0, None)
    assert [q.pop()[0] for _ in range(3)] == [3, 0, 2]


def test_backlog_holds_snapshots_within_the_reserve():
    pool = DevicePool(1000)
    pool.acquire(600, "the plan's weights")
    reserve = Reserve(pool, 300)
    backlog = GradBacklog(torch.device("cpu"), reserve, excluded={7})
    assert not backlog.open(7, 64), "a region with a tied-weight contribution stays on the slab path"
    assert not backlog.open(1, 400), "beyond the reserve: wait for a slab instead"
    assert backlog.open(1, 200) and pool.live == 600 + 256 and reserve.live == 256
    assert not backlog.open(2, 64), "the reserve is shared: 256 + 64 > 300"
    g1, g2 = torch.randn(3, 5), torch.randn(7)
    e1, e2 = [None] * 4, [None] * 4
    v1 = backlog.hold(1, g1, e1, torch.float32)
    v2 = backlog.hold(1, g2, e2, torch.float32)
    g1.zero_()  # the runtime reuses the gradient's memory right after the hand-off
    assert v1.data_ptr() % 64 == 0 and v2.data_ptr() % 64 == 0
    assert torch.count_nonzero(v1) == 15 and torch.equal(v2, g2)
    backlog.seal(1, "payload")
    assert len(backlog) == 1 and backlog.backlogged == 1
    held = backlog.take()
    assert held.region == 1 and held.payload == "payload" and [e for _, e in held.views] == [e1, e2]
    assert backlog.take() is None and backlog.taken == [(1, ())]
    backlog.release(held)
    backlog.release(held)  # idempotent: the hand-off's error path releases again
    assert pool.live == 600 and reserve.live == 0


def test_a_waiting_backward_gets_the_freed_slab_before_the_backlog():
    slabs = GradSlabs(pin=False, max_slabs=1)
    slabs.reserve(64)
    assert slabs.try_open(0)
    assert not slabs.try_open(1), "no slab left and max_slabs reached"
    slab = slabs.seal(0)
    slabs._waiters = 1  # as while a backward blocks in carve()
    slabs.release(slab)
    assert not slabs.try_open("pump", yield_to_waiters=True)
    slabs._waiters = 0
    assert slabs.try_open("pump", yield_to_waiters=True)


# ---- through the backend -----------------------------------------------------------------


@pytest.fixture
def slow_optimizer(monkeypatch):
    """Every task of the optimizer's worker (update, accumulation, norm) takes >= 50 ms, far
    longer than a tiny region's backward, so the two slabs stay busy and later regions
    wait in the backlog."""
    inner = engine._run_no_grad

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return inner(*args, **kwargs)

    monkeypatch.setattr(engine, "_run_no_grad", slow)


def llama(tied=False, layers=3):
    return Llama(small_llama_config(layers, tied))


def train(model, batches, backlog, *, max_grad_norm=None, accumulate=False, **options):
    """Three steps with megatrain.AdamW, the learning rate halved after every step() like
    a scheduler (train_megatrain), plus the plan's streamer."""
    out = train_megatrain(model, batches, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                           "backlog": backlog, **options},
                          max_grad_norm=max_grad_norm, accumulate=accumulate, lr_decay=0.5)
    return dict(out, streamer=out["plan"].streamer)


@pytest.mark.parametrize("tied", [False, True])
def test_backlog_trains_bitwise_like_without_it_and_like_eager(slow_optimizer, tied):
    torch.manual_seed(0)
    model = llama(tied)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    on = train(model, batches, True)
    off = train(model, batches, False)
    assert torch.equal(on["params"], off["params"]) and on["losses"] == off["losses"]
    ref = train_eager(model, batches, lr_decay=0.5)
    for a, b in zip(on["losses"], ref["losses"]):
        assert abs(a - b) / abs(b) < 1e-5, (on["losses"], ref["losses"])
    assert rel(on["params"], ref["params"]) < 1e-3

    backlog = on["streamer"].backlog
    assert off["streamer"].backlog is None
    assert backlog.backlogged >= 3, "the slowed optimizer must push regions into the backlog"
    # Every region taken had an earlier deadline than all those left waiting: this model's
    # forward fetches its regions in id order (prologue, layers, epilogue).
    fetched = [int(e[len("prefetch("):-1]) for e in on["plan"].forward_events if e.startswith("prefetch(")]
    assert fetched == sorted(fetched)
    assert all(r < w for r, waiting in backlog.taken for w in waiting), backlog.taken
    assert any(waiting for _, waiting in backlog.taken), "EDF never had a choice to make"
    names = {r.id: r.name for r in on["plan"].regions}
    taken = [names[r] for r, _ in backlog.taken]
    if tied:  # the tied embedding's two pieces are summed on the host: the slab path
        assert not {"prologue", "epilogue"} & set(taken)
    else:
        assert "prologue" in taken, "region 0 went through the backlog"
    # step() returned while updates were still deferred: the next forward overlaps them.
    assert max(on["deferred"]) > 0
    assert backlog.reserve.live == 0 and on["streamer"].pool.live <= on["plan"].budget


@pytest.mark.parametrize("case", ["clip", "accumulate"])
def test_updates_deferred_to_step_take_todays_path_and_stay_exact(slow_optimizer, case):
    """With clipping the updates wait for step(); with accumulation p.grad holds earlier
    micro-batches: the optimizer declines to defer, so backward waits for its backlog."""
    torch.manual_seed(1)
    model = llama(layers=2)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    kw = dict(max_grad_norm=0.5) if case == "clip" else dict(accumulate=True)
    on = train(model, batches, True, **kw)
    off = train(model, batches, False, **kw)
    assert torch.equal(on["params"], off["params"]) and on["losses"] == off["losses"]
    assert on["streamer"].backlog.backlogged > 0
    assert on["deferred"] == [0, 0, 0]


def test_no_backlog_beyond_the_memory_the_plan_leaves(slow_optimizer):
    torch.manual_seed(2)
    model = llama(layers=2)
    batches = random_batches(VOCAB, 2, batch=2, seq=16)
    roomy = train(model, batches, True)
    tight = train(model, batches, True, gpu_memory=roomy["plan"].predicted_peak_bytes)
    assert roomy["streamer"].backlog.backlogged > 0
    assert tight["plan"].update_reserve == 0 and tight["streamer"].backlog.backlogged == 0
    assert torch.equal(tight["params"], roomy["params"])


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_backlog_value_is_refused(value):
    from megatrain.compiler.options import parse_options

    with pytest.raises(ValueError, match=r"backlog=.*: give True .* or False"):
        parse_options({"device": "cpu", "backlog": value})


@pytest.mark.parametrize("where", ["inside the layer loop", "after the embedding"])
def test_graph_breaks_with_the_backlog(slow_optimizer, where):
    """A break inside the layer loop runs one graph for several layers (the same region id
    sealed once per layer: the backlog's entries must not collide); a break after the
    embedding makes two graphs hand in gradients of the tied weight (p.grad path: the
    optimizer cannot defer, backward waits). Either way: bitwise like backlog=False."""

    torch.manual_seed(4)
    model = breaking_llama(where, small_llama_config(layers=4))
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    with pytest.warns(UserWarning, match="graph break"):
        on = train(model, batches, True)
        off = train(model, batches, False)
    assert torch.equal(on["params"], off["params"]) and on["losses"] == off["losses"]
    used = sum(g.streamer.backlog.backlogged for g in megatrain.explain(on["step"]).graphs)
    assert used > 0, "the slowed optimizer must push regions into the backlog"
