"""Where each region's AdamW runs, through the backend (issue 4, item 7): the `updates`
option, the plan's `update_sites`, and device-site updates in the streaming runtime.

On the CPU device the device update is the same kernel on the same device as the host
update, so updates="device" and updates="host" train bitwise alike; against eager training
with torch.optim.AdamW the bounds are test_backend_cpu.py's. Eager lowering keeps these
fast; the copy that protects a gradient from Inductor's buffer reuse is tested directly.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

import megatrain
from megatrain.plan import costs
from megatrain.optim import device_update as du
from megatrain.runtime.device_updates import DeviceUpdates
from megatrain.memory.host_store import home_parameters
from megatrain.memory.pool import DevicePool
from megatrain.models import Llama, LlamaConfig

from .helpers import compile_streamed, flat, parse_forced, rel, random_batches, train_eager

VOCAB = 160


def llama(tied: bool = False, layers: int = 2) -> Llama:
    return Llama(LlamaConfig(vocab_size=VOCAB, hidden=64, layers=layers, heads=4, kv_heads=2, ffn=176,
                             rope_theta=10000.0, tie_embeddings=tied))


@pytest.fixture(autouse=True)
def no_cached_rates(tmp_path, monkeypatch):
    """Compile with the default CPU rates, whatever this machine has cached."""
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))


class Spy:
    """Counts the optimizer's device updates."""

    def __init__(self, opt):
        self.calls = 0
        inner = opt.submit_on_device

        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        opt.submit_on_device = counted


def train(model, updates, batches, *, max_grad_norm=None, **options):
    """Three steps through the backend with megatrain.AdamW; parameters, losses, plan and
    how many device updates ran."""
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    opt = megatrain.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, max_grad_norm=max_grad_norm)
    spy = Spy(opt)
    step = compile_streamed(model, {
        "device": "cpu", "precision": "fp32", "lowering": "eager", "updates": updates, **options})
    losses = []
    for ids, labels in batches:
        loss = step(ids, labels=labels)
        loss.backward()
        if max_grad_norm is None:
            assert all(p.grad is None for p in model.parameters()), "no persistent gradient"
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return dict(params=flat(model.parameters()), losses=losses, plan=megatrain.explain(step).graphs[0],
                device_updates=spy.calls)


def assert_close_to_eager(r, ref):
    for a, b in zip(r["losses"], ref["losses"]):
        assert abs(a - b) / abs(b) < 1e-5, (r["losses"], ref["losses"])
    assert rel(r["params"], ref["params"]) < 1e-3


@pytest.mark.parametrize("tied", [False, True])
def test_device_and_host_updates_train_bitwise_alike_and_like_eager(tied):
    torch.manual_seed(0)
    model = llama(tied)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    host = train(model, "host", batches)
    dev = train(model, "device", batches)
    assert torch.equal(dev["params"], host["params"]) and dev["losses"] == host["losses"]
    assert_close_to_eager(dev, train_eager(model, batches))
    assert set(host["plan"].update_sites.values()) == {"host"} and host["device_updates"] == 0
    sites = dev["plan"].update_sites
    names = {r.id: r.name for r in dev["plan"].regions}
    # The tied embedding's gradient comes in two pieces (prologue and epilogue): summed on
    # the host. Every other region updates on the device, every step.
    expect = {r: "host" if tied and names[r] in ("prologue", "epilogue") else "device" for r in sites}
    assert sites == expect and len(sites) == 2 + 2
    assert dev["device_updates"] == 3 * list(sites.values()).count("device")
    # Their buffers were counted in the pool, within the budget.
    plan = dev["plan"]
    params = dict(model.named_parameters())
    largest = max(du.held_bytes([params[f].shape for f in r.param_fqns])
                  for r in plan.regions if sites.get(r.id) == "device")
    assert largest <= plan.measured_peak_bytes <= plan.budget
    assert plan.update_reserve == plan.budget - plan.predicted_peak_bytes
    # explain's predicted step leaves the device sites' updates off the host, and sends
    # their state both ways over the link instead of their gradients one way
    planned, sited = plan.schedule.plan.schedule, plan.predicted_schedule
    host_params = {pid for r, s in sites.items() if s == "host" for pid in plan.update_params[r]}
    device_params = {pid for r, s in sites.items() if s == "device" for pid in plan.update_params[r]}
    numel = {w.id: w.numel for w in planned.problem.weights}
    moved = [w for w in sited.problem.weights if w.id in device_params]
    assert moved and all(w.numel == 0 < numel[w.id] and w.grad_link_nbytes == 24 * numel[w.id] for w in moved)
    assert [w for w in sited.problem.weights if w.id in host_params] == [
        w for w in planned.problem.weights if w.id in host_params]
    assert sited.config == planned.config and sited.peak_bytes == planned.peak_bytes


def test_auto_places_regions_as_assign_sites_says(monkeypatch):
    """With rates where these small regions are worth moving (the H200 box 1000x slower, so
    the device update's fixed cost does not decide), "auto" mixes host and device exactly as
    the cost model's assign_sites does over the regions in backward order, with the
    backward's weight fetches as the phase's load; and still trains exactly."""
    slow = costs.Rates("H200 / 1000", h2d=55e6, d2h=55e6, duplex=90e6, flops=700e9, adamw=3.8e6)
    monkeypatch.setattr("megatrain.compiler.schedule.compile_rates", lambda device: slow)
    torch.manual_seed(1)
    model = llama(tied=False, layers=3)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    auto = train(model, "auto", batches)
    plan = auto["plan"]
    assert plan.schedule.rates == slow
    numel = {n: p.numel() for n, p in model.named_parameters()}
    order = [r for r in reversed(plan.regions) if r.param_fqns]  # the backward's
    size = {r.id: sum(numel[f] for f in r.param_fqns) for r in order}
    fetched = [int(e[len("prefetch("):-1]) for e in plan.backward_events if e.startswith("prefetch(")]
    load = du.PhaseLoad.streaming(sum(size[r] for r in fetched))
    expect, _ = du.assign_sites([size[r.id] for r in order], slow, load=load, grad_bytes=4)
    assert plan.update_sites == {r.id: s for r, s in zip(order, expect)}
    assert set(expect) == {"host", "device"}
    assert auto["device_updates"] == 3 * expect.count("device")
    assert torch.equal(auto["params"], train(model, "host", batches)["params"])


def test_gradient_accumulation_takes_the_host_path_and_stays_exact():
    """Micro-batches are summed into p.grad on the host: inside accumulate() and for the
    last micro-batch (p.grad holds the others) device_update_blocker refuses."""
    torch.manual_seed(5)
    model = llama(layers=1)
    (ids0, labels0), (ids1, labels1) = random_batches(VOCAB, 2, batch=2, seq=8)
    out = {}
    for updates in ("device", "host"):
        torch._dynamo.reset()
        streamed = copy.deepcopy(model)
        opt = megatrain.AdamW(streamed.parameters(), lr=3e-3, weight_decay=0.1)
        spy = Spy(opt)
        step = compile_streamed(streamed, {
            "device": "cpu", "precision": "fp32", "lowering": "eager", "updates": updates})
        for _ in range(2):
            with opt.accumulate():
                (step(ids0, labels=labels0) / 2).backward()
            (step(ids1, labels=labels1) / 2).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        assert set(megatrain.explain(step).graphs[0].update_sites.values()) == {updates}
        assert spy.calls == 0
        out[updates] = flat(streamed.parameters())
    assert torch.equal(out["device"], out["host"])


def test_device_regions_must_fit_the_memory_the_plan_leaves():
    """A region whose device update does not fit gpu_memory beside the plan's peak stays on
    the host, even with updates="device"."""
    torch.manual_seed(3)
    model = llama()
    batches = random_batches(VOCAB, 1, batch=2, seq=8)
    roomy = train(model, "device", batches, prefetch=0)["plan"]
    params = dict(model.named_parameters())
    need = {r.id: du.held_bytes([params[f].shape for f in r.param_fqns]) for r in roomy.regions}
    small, large = min(need.values()), max(need.values())
    tight = train(model, "device", batches, prefetch=0,
                  gpu_memory=roomy.predicted_peak_bytes + (small + large) // 2)["plan"]
    reserve = tight.update_reserve
    assert small <= reserve < large
    assert tight.update_sites == {r: "device" if need[r] <= reserve else "host"
                                  for r in tight.update_sites}


def test_megatrain_decides_where_updates_run_unless_forced():
    """None (the default) is the planner's choice: state kept on the device where a GPU
    computes, the host on the CPU device (where device memory is host memory)."""
    assert parse_forced({"device": "cpu"}).updates == "host"
    assert parse_forced({"device": "cpu", "updates": "resident"}).updates == "resident"


@pytest.mark.parametrize("value", ["optimizer", "", True])
def test_a_bad_updates_value_is_refused(value):
    with pytest.raises(ValueError, match=r"updates=.* use one of \('auto', 'host', 'device', 'resident'\)"):
        parse_forced({"device": "cpu", "updates": value})
    step = compile_streamed(llama(), {"device": "cpu", "updates": value})
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(ValueError, match=rf"updates={value!r}: use one of"):
        step(ids, labels=ids)


def test_clipping_takes_the_host_path_and_stays_exact():
    """max_grad_norm needs every gradient before any update: device_update_blocker says so,
    and each device-site region falls back to the host path, every step."""
    torch.manual_seed(4)
    model = llama()
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    dev = train(model, "device", batches, max_grad_norm=0.05)
    host = train(model, "host", batches, max_grad_norm=0.05)
    assert set(dev["plan"].update_sites.values()) == {"device"}  # the plan's choice ...
    assert dev["device_updates"] == 0  # ... refused by the optimizer at run time
    assert torch.equal(dev["params"], host["params"])
    assert_close_to_eager(dev, train_eager(model, batches, max_grad_norm=0.05))


# ---- the runtime's DeviceUpdates, directly -------------------------------------------------


def region_problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    regions = [[(13, 7), (13,)], [(5, 9), (9,), (2, 3)]]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for r in regions for s in r]
    pids = {0: [0, 1], 1: [2, 3, 4]}
    for ps in pids.values():
        home_parameters([params[i] for i in ps], pin=False)
    return params, pids


def test_gradients_are_copied_when_handed_off():
    """Inductor reuses a gradient's memory for the next kernel right after the hand-off:
    overwriting the tensor afterwards must not change the update."""
    params, pids = region_problem(0)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = megatrain.AdamW(params, lr=1e-2), megatrain.AdamW(twins, lr=1e-2)
    pool = DevicePool(1 << 20)
    updates = DeviceUpdates(torch.device("cpu"), pool, params, None, pids, 1 << 20)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g) for p in params]
    for region, ps in pids.items():
        for i in ps:
            scratch = grads[i].clone()
            assert updates.take(scratch, region, i)
            scratch.fill_(float("nan"))  # the next kernel writes the reused buffer
        ref.submit([twins[i] for i in ps], [grads[i] for i in ps]).result()
    assert not updates.take(grads[0], 7, 0)  # a region without a device site
    opt.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(params, twins))
    assert updates.launched == 2
    updates.retire()
    assert pool.live == 0


def test_updates_in_flight_stay_within_the_reserve(monkeypatch):
    """With room for one region's update at a time, the second region's first gradient
    waits for the first update to finish rather than exceeding the reserve."""
    params, pids = region_problem(2)
    opt = megatrain.AdamW(params, lr=1e-2)
    need = [du.held_bytes([params[i].shape for i in ps]) for ps in pids.values()]
    pool = DevicePool(1 << 20)
    updates = DeviceUpdates(torch.device("cpu"), pool, params, None, pids, max(need))
    release = threading.Event()
    inner = du._run_cpu
    monkeypatch.setattr(du, "_run_cpu", lambda handle, job: (release.wait(30), inner(handle, job)))
    g = torch.Generator().manual_seed(3)
    for i in pids[0]:
        updates.take(torch.randn(params[i].shape, generator=g), 0, i)
    assert pool.live == need[0]  # the first update is in flight, held back
    threading.Timer(0.2, release.set).start()
    start = time.perf_counter()
    updates.take(torch.randn(params[2].shape, generator=g), 1, 2)
    assert time.perf_counter() - start >= 0.15  # waited for the first to finish
    assert pool.live == need[1] and pool.peak == max(need)
    for i in pids[1][1:]:
        updates.take(torch.randn(params[i].shape, generator=g), 1, i)
    opt.synchronize()
    updates.retire()
    assert pool.live == 0 and updates.launched == 2


def test_a_weight_tied_across_a_graph_break_is_summed_on_the_host():
    """Each graph's backward hands in a contribution of the tied weight: a device-site
    update at either hand-off would apply one contribution and lose the other, and here it
    even wrote the weight before the other graph's backward read it (autograd refused);
    the host sums them in p.grad (runtime/handoff_graphs.py)."""
    from .helpers import breaking_llama, small_llama_config, train_megatrain

    torch.manual_seed(11)
    model = breaking_llama("after the embedding", small_llama_config(2, tied=True))
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    out = {u: train_megatrain(model, batches, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                               "updates": u})["params"] for u in ("device", "host")}
    assert torch.equal(out["device"], out["host"])


def test_a_clipping_optimizer_makes_the_prediction_wait_for_the_norm():
    """The prediction reads the optimizer as it is now: with max_grad_norm its host updates
    start after the backward's last gradient (plan.problem.Problem.updates_wait); without,
    each follows its own gradient."""
    torch.manual_seed(7)
    torch._dynamo.reset()
    model = llama(layers=2)
    opt = megatrain.AdamW(model.parameters(), lr=3e-3, max_grad_norm=1.0)
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                    "updates": "host"})
    for ids, labels in random_batches(VOCAB, 2, batch=2, seq=8):
        step(ids, labels=labels).backward()
        opt.step()
        opt.zero_grad()
    plan = megatrain.explain(step).graphs[0]

    def first_update_after_last_copy(sched) -> bool:
        copies = [t for t in sched.streams["d2h"] if t.kind == "d2h" and t.step == 0]
        updates = [t for t in sched.streams["host"] if t.kind == "host_step" and t.step == 0]
        return min(sched.start[u] for u in updates) >= max(sched.end[d] for d in copies)

    assert plan.updates_wait and plan.predicted_schedule.problem.updates_wait
    assert first_update_after_last_copy(plan.predicted_schedule) and plan.predicted_step_s > 0
    opt.max_grad_norm = None
    assert not plan.updates_wait and not plan.predicted_schedule.problem.updates_wait
    assert not first_update_after_last_copy(plan.predicted_schedule)
