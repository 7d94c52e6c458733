"""The gradient backlog (option backlog="host" or "device"; megatrain.runtime.deadlines and
grad_backlog): sealed regions reach the host optimizer earliest deadline first, the rest
are deferred past the end of backward; with "device" gradients that find no free host slab
wait on the device.

The device side's bookkeeping is tested on CPU tensors directly (the order alone:
tests/runtime/test_deadlines.py); through the backend (device="cpu", where every "device"
buffer is a real separate copy) the optimizer is slowed down so that it lags and regions
really wait. Results must equal backlog=None bitwise (same gradients, same updates, only
the order of independent per-region updates changes) and eager torch.optim.AdamW to
test_backend_cpu.py's bounds.
"""

from __future__ import annotations

import time

import pytest
import torch

import megatrain
from megatrain.models import Llama
from megatrain.optim import engine
from megatrain.runtime.deadlines import Deadlines
from megatrain.runtime.grad_backlog import GradBacklog
from megatrain.runtime.grad_copies import GradCopy
from megatrain.runtime.grad_slabs import GradSlabs
from megatrain.memory.pool import DevicePool, Reserve

from .helpers import (SMALL_VOCAB, breaking_llama, parse_forced, rel, random_batches,
                      small_llama_config, train_eager, train_megatrain)

VOCAB = SMALL_VOCAB


@pytest.fixture(autouse=True)
def no_cached_rates(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))


# ---- ordering and bookkeeping, no backend ----------------------------------------------


def test_backlog_holds_snapshots_within_the_reserve():
    pool = DevicePool(1000)
    pool.acquire(600, "the plan's weights")
    reserve = Reserve(pool, 300)
    backlog = GradBacklog(torch.device("cpu"), reserve, excluded={7}, deadlines=Deadlines())
    assert not backlog.open(7, 64), "a region with a tied-weight contribution stays on the slab path"
    assert not backlog.open(1, 400), "beyond the reserve: wait for a slab instead"
    assert backlog.open(1, 200) and pool.live == 600 + 256 and reserve.live == 256
    assert not backlog.open(2, 64), "the reserve is shared: 256 + 64 > 300"
    g1, g2 = torch.randn(3, 5), torch.randn(7)
    e1, e2 = GradCopy(), GradCopy()
    v1 = backlog.hold(1, g1, e1, torch.float32)
    v2 = backlog.hold(1, g2, e2, torch.float32)
    g1.zero_()  # the runtime reuses the gradient's memory right after the hand-off
    assert v1.data_ptr() % 64 == 0 and v2.data_ptr() % 64 == 0
    assert torch.count_nonzero(v1) == 15 and torch.equal(v2, g2)
    backlog.seal(1, "payload")
    assert len(backlog) == 1 and backlog.backlogged == 1
    held = backlog.take()
    assert held.region == 1 and held.payload == "payload" and [e for _, e in held.views] == [e1, e2]
    assert backlog.take() is None and list(backlog.queue.served) == [(1, ())]
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


def _deadline_order_kept(served) -> bool:
    """Every region served had an earlier deadline than all those it left waiting: this
    model's forward fetches its regions in id order (prologue, layers, epilogue); on the
    CPU every copy is done at once, so readiness never reorders."""
    return all(r < w for r, waiting in served for w in waiting)


# The device backlog's untied and tied variants under -m slow: the host's cover the order
# and the device's tied case stays (keeps the default run within 15 minutes on 2 cores).
@pytest.mark.parametrize("tied,where", [(False, "host"), (True, "host"), (True, "device"),
                                        pytest.param(False, "device", marks=pytest.mark.slow)])
def test_backlog_trains_bitwise_like_without_it_and_like_eager(slow_optimizer, where, tied):
    torch.manual_seed(0)
    model = llama(tied)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    on = train(model, batches, where)
    off = train(model, batches, None)
    assert torch.equal(on["params"], off["params"]) and on["losses"] == off["losses"]
    ref = train_eager(model, batches, lr_decay=0.5)
    for a, b in zip(on["losses"], ref["losses"]):
        assert abs(a - b) / abs(b) < 1e-5, (on["losses"], ref["losses"])
    assert rel(on["params"], ref["params"]) < 1e-3

    fetched = [int(e[len("prefetch("):-1]) for e in on["plan"].forward_events if e.startswith("prefetch(")]
    assert fetched == sorted(fetched)
    streamer = on["streamer"]
    assert off["streamer"].deadlines is None and off["streamer"].backlog is None
    # The last step's host updates by phase: without a backlog none begins in the forward.
    on_phases, off_phases = (x["streamer"].last_stats.host_updates_by_phase() for x in (on, off))
    # The hand-off served regions by deadline, and had choices to make.
    served = list(streamer._sealed.served)
    assert _deadline_order_kept(served), served
    assert any(waiting for _, waiting in served), "the hand-off never had a choice to make"
    # step() returned while updates were still deferred: the next forward overlaps them.
    assert max(on["deferred"]) > 0
    assert on["deferred"][-2] > 0, "the last step's forward had updates to overlap"
    # The updates that begin in the forward are the deferred ones (step() waited for the
    # rest), give or take one: the hand-off serves them one at a time, and the one it held
    # when step() returned is not counted as deferred, while the first may begin between
    # step() and the next forward and count as the previous step's (updates take 50 ms
    # here, that gap ~1 ms).
    deferred = on["deferred"][-2]
    assert abs(on_phases["forward"]["updates"] - deferred) <= 1, (on_phases, deferred)
    assert "forward" not in off_phases
    if where == "host":
        assert streamer.backlog is None
        assert streamer._slabs.allocated > 2, "slabs grow past two while the host lags"
        assert off["streamer"]._slabs.allocated == 2, "without a backlog nothing overlaps the lag"
        return
    backlog = streamer.backlog
    assert backlog.backlogged >= 3, "the slowed optimizer must push regions into the backlog"
    assert _deadline_order_kept(backlog.queue.served), list(backlog.queue.served)
    assert any(waiting for _, waiting in backlog.queue.served), "EDF never had a choice to make"
    names = {r.id: r.name for r in on["plan"].regions}
    taken = [names[r] for r, _ in backlog.queue.served]
    if tied:  # the tied embedding's two pieces are summed on the host: the slab path
        assert not {"prologue", "epilogue"} & set(taken)
    else:
        assert "prologue" in taken, "region 0 went through the backlog"
    assert backlog.reserve.live == 0 and streamer.pool.live <= on["plan"].budget
    assert streamer._slabs.allocated == 2, "the device holds the backlog, not host slabs"


@pytest.mark.parametrize("case,where", [("clip", "host"), ("accumulate", "host"),
                                       pytest.param("clip", "device", marks=pytest.mark.slow),
                                       pytest.param("accumulate", "device", marks=pytest.mark.slow)])
def test_updates_deferred_to_step_take_todays_path_and_stay_exact(slow_optimizer, case, where):
    """With clipping the updates wait for step(); with accumulation p.grad holds earlier
    micro-batches: the optimizer declines to defer, so backward waits for its backlog (and
    host slabs do not grow for it)."""
    torch.manual_seed(1)
    model = llama(layers=2)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    kw = dict(max_grad_norm=0.5) if case == "clip" else dict(accumulate=True)
    on = train(model, batches, where, **kw)
    off = train(model, batches, None, **kw)
    assert torch.equal(on["params"], off["params"]) and on["losses"] == off["losses"]
    assert on["deferred"] == [0, 0, 0]
    streamer = on["streamer"]
    if where == "device":
        assert streamer.backlog.backlogged > 0
    elif case == "clip":
        # The first backward may grow slabs before its end learns that the optimizer
        # declines; later ones do not add more.
        assert streamer._defer_declined


def test_no_backlog_beyond_the_memory_the_plan_leaves(slow_optimizer):
    torch.manual_seed(2)
    model = llama(layers=2)
    batches = random_batches(VOCAB, 2, batch=2, seq=16)
    roomy = train(model, batches, "device")
    tight = train(model, batches, "device", gpu_memory=roomy["plan"].predicted_peak_bytes)
    assert roomy["streamer"].backlog.backlogged > 0
    assert tight["plan"].update_reserve == 0 and tight["streamer"].backlog.backlogged == 0
    assert torch.equal(tight["params"], roomy["params"])


@pytest.mark.parametrize("value", [True, False, "yes", 1])
def test_a_bad_backlog_value_is_refused(value):
    with pytest.raises(ValueError, match=r"backlog=.*: give 'host' .* 'device' .* or None"):
        parse_forced({"device": "cpu", "backlog": value})


def test_the_backlog_and_the_gradient_ring_exclude_each_other():
    with pytest.raises(ValueError, match=r"grad_chunk='64MiB' with backlog='host'.*drop one"):
        parse_forced({"device": "cpu", "backlog": "host", "grad_chunk": "64MiB"})


@pytest.mark.parametrize("where,backlog", [("inside the layer loop", "host"),
                                           pytest.param("after the embedding", "host", marks=pytest.mark.slow),
                                           pytest.param("inside the layer loop", "device", marks=pytest.mark.slow),
                                           pytest.param("after the embedding", "device", marks=pytest.mark.slow)])
def test_graph_breaks_with_the_backlog(slow_optimizer, where, backlog):
    """A break inside the layer loop runs one graph for several layers (the same region id
    sealed once per layer: the queues' entries must not collide); a break after the
    embedding makes two graphs hand in gradients of the tied weight (p.grad path: the
    optimizer cannot defer, backward waits). Either way: bitwise like no backlog."""

    torch.manual_seed(4)
    model = breaking_llama(where, small_llama_config(layers=4))
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    with pytest.warns(UserWarning, match="graph break"):
        on = train(model, batches, backlog)
        off = train(model, batches, None)
    assert torch.equal(on["params"], off["params"]) and on["losses"] == off["losses"]
    graphs = megatrain.explain(on["step"]).graphs
    if backlog == "device":
        used = sum(g.streamer.backlog.backlogged for g in graphs)
        assert used > 0, "the slowed optimizer must push regions into the backlog"
    else:
        assert any(waiting for g in graphs for _, waiting in g.streamer._sealed.served), \
            "the slowed optimizer must leave regions waiting for the hand-off"


@pytest.mark.parametrize("case", ["resident", "kept weights"])
def test_the_host_backlog_beside_other_runtime_options(slow_optimizer, case):
    """The host backlog orders and defers what still goes through the host optimizer; the
    regions whose AdamW state is resident on the device (here: the budget holds two) and
    the weights kept for the backward are left as they were: bitwise like no backlog with
    the same options."""
    from megatrain.optim import resident as resident_mod

    torch.manual_seed(5)
    model = llama(layers=2)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    options = dict(keep_weights=True)
    if case == "resident":
        roomy = train(model, batches[:1], None, prefetch=0)["plan"]
        params = dict(model.named_parameters())
        need = sorted(resident_mod.resident_bytes([params[f].shape for f in r.param_fqns])
                      for r in roomy.regions if r.param_fqns)
        scratch = 4 * resident_mod.upcast_scratch_numel(p.numel() for p in model.parameters())
        options = dict(updates="resident", prefetch=0,
                       gpu_memory=roomy.predicted_peak_bytes + scratch + need[0] + need[1] + need[2] // 2)
    on = train(model, batches, "host", **options)
    streamer = on["streamer"]
    assert streamer._sealed.served, "no region went through the host's hand-off"
    if case == "resident":  # (before the next compiled graph sends them home)
        assert 0 < len(streamer.resident.regions) < len(on["plan"].regions)
    else:
        assert streamer.last_stats.kept_hits > 0 and max(on["deferred"]) > 0
    off = train(model, batches, None, **options)
    assert torch.equal(on["params"], off["params"]) and on["losses"] == off["losses"]
