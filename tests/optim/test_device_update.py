"""megatrain.AdamW.submit_on_device on device='cpu': the device-update path (copy master, m,
v into a device buffer, the same fused kernel there, copy back, asynchronously on the
updater's thread) against the host path, bitwise (the same kernel on the same device);
its ordering with wait_params/step/synchronize/state_dict; its refusals; and the cost
model that decides between the two (update_site)."""

from __future__ import annotations

import copy
import io
import math
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megatrain.optim as mo
from megatrain.plan.costs import GPU_DEFAULT, Rates
from megatrain.optim import device_update as du
from megatrain.optim import functional
from megatrain.optim.engine import HostWorker
from megatrain.memory.host_store import home_parameters
from megatrain.memory.layout import FlatLayout

# ---- a small problem: three param groups, regions that span groups -----------------------


def make_problem(seed: int, homed: bool = False) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(2000 + seed)
    d_in, h, d_out = 5, 13, 7  # 13, 7: sizes that are not multiples of 64 (padding, tails)
    shapes = {
        "w1": (h, d_in), "b1": (h,), "w2": (h, h), "b2": (h,), "gain": (h,),
        "w3": (d_out, h), "mix": (2, 3, d_out), "big": (9, 100),
    }
    P = {k: torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for k, s in shapes.items()}
    if homed:  # as the backend stores them: each region's params in one contiguous buffer
        for r in REGIONS:
            home_parameters([P[n] for n in r], pin=False)
    return P


def clone_problem(P, homed: bool = False):
    Q = {k: torch.nn.Parameter(p.detach().clone()) for k, p in P.items()}
    if homed:
        for r in REGIONS:
            home_parameters([Q[n] for n in r], pin=False)
    return Q


def loss_fn(P, x, y):
    h = torch.tanh(x @ P["w1"].T + P["b1"])
    h = torch.tanh(h @ P["w2"].T + P["b2"]) * P["gain"]
    out = h @ P["w3"].T
    out = out + P["mix"].sum(dim=(0, 1)) * torch.sin(out)
    return ((out - y) ** 2).mean() + (P["big"] ** 2).mean() * out.mean()


def batch(seed: int, step: int):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return torch.randn(9, 5, generator=g), torch.randn(9, 7, generator=g)


GROUPS = [
    (["w1", "w2", "w3", "big"], dict(lr=1e-2, weight_decay=0.1)),
    (["b1", "b2", "gain"], dict(lr=3e-2, weight_decay=0.0)),
    (["mix"], dict(lr=5e-3, weight_decay=0.05, betas=(0.8, 0.99), eps=1e-6)),
]
# As the runtime hands them in backward: last layer first; regions span param groups.
REGIONS = [["mix", "w3", "big"], ["w2", "b2", "gain"], ["w1", "b1"]]


def groups(P):
    return [{"params": [P[n] for n in names], **opts} for names, opts in GROUPS]


def schedule(total: int):
    return lambda t: (t + 1) / 2 if t < 2 else 0.5 * (1 + math.cos(math.pi * (t - 2) / total))


def grads_of(P, seed, t, dtype):
    x, y = batch(seed, t)
    names = list(P)
    gs = torch.autograd.grad(loss_fn(P, x, y), [P[n] for n in names])
    return {n: g.to(dtype) for n, g in zip(names, gs)}


def run(P, opt, *, seed, steps, sites, dtype=torch.float32, sched=None):
    """``sites(t, region_index)`` -> "host" (submit), "device" (submit_on_device on the
    CPU) or "grad" (p.grad, then step)."""
    for t in range(steps):
        grads = grads_of(P, seed, t, dtype)
        handles = []
        for ri, r in enumerate(REGIONS):
            site = sites(t, ri)
            ps, gs = [P[n] for n in r], [grads[n] for n in r]
            if site == "device":
                handles.append(opt.submit_on_device(ps, gs, "cpu"))
            elif site == "host":
                handles.append(opt.submit(ps, gs))
            else:
                for p, g in zip(ps, gs):  # laid out like the param, as autograd would
                    p.grad = g.float().contiguous()
        opt.step()
        opt.zero_grad()
        assert all(h.done() for h in handles)  # step() waited for every region
        if sched is not None:
            sched.step()


def assert_same(P, Q, opt_p, opt_q):
    for k in P:
        assert torch.equal(P[k], Q[k]), f"param {k} differs by {(P[k] - Q[k]).abs().max()}"
        sp, sq = opt_p.state[P[k]], opt_q.state[Q[k]]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sp[key], sq[key]), f"state {key} of {k} differs"


def trained(P, seed):
    return any(not torch.equal(p, q) for p, q in zip(P.values(), make_problem(seed).values()))


# ---- exactness ---------------------------------------------------------------------------


@pytest.mark.parametrize("homed", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_device_path_bitwise_equals_host_path(seed, dtype, homed):
    """Several steps, three param groups (weight decay, betas, eps of their own), regions
    spanning groups, an LR schedule, fp32 or bf16 gradients; homed (one buffer per region,
    as streamed) or separate parameters."""
    steps = 6
    P = make_problem(seed, homed)
    Q = clone_problem(P, homed)
    dev, host = mo.AdamW(groups(P)), mo.AdamW(groups(Q))
    s_dev = torch.optim.lr_scheduler.LambdaLR(dev, schedule(steps))
    s_host = torch.optim.lr_scheduler.LambdaLR(host, schedule(steps))
    run(P, dev, seed=seed, steps=steps, sites=lambda t, r: "device", dtype=dtype, sched=s_dev)
    run(Q, host, seed=seed, steps=steps, sites=lambda t, r: "host", dtype=dtype, sched=s_host)
    assert_same(P, Q, dev, host)
    assert trained(P, seed)
    assert all(float(dev.state[p]["step"]) == steps for p in P.values())
    if dtype == torch.float32:  # and torch's own fused AdamW through p.grad
        R = make_problem(seed)
        ref = torch.optim.AdamW(groups(R), fused=True)
        s_ref = torch.optim.lr_scheduler.LambdaLR(ref, schedule(steps))
        run(R, ref, seed=seed, steps=steps, sites=lambda t, r: "grad", sched=s_ref)
        assert_same(P, R, dev, ref)


def test_bf16_grads_bitwise_whatever_the_host_upcast_chunk(monkeypatch):
    """The host path upcasts 16-bit gradients in chunks (here 64 elements: every tensor
    split); the device path upcasts whole tensors. Same bits."""
    monkeypatch.setattr(functional, "UPCAST_CHUNK", 64)
    P = make_problem(3, homed=True)
    Q = clone_problem(P, homed=True)
    dev, host = mo.AdamW(groups(P)), mo.AdamW(groups(Q))
    run(P, dev, seed=3, steps=3, sites=lambda t, r: "device", dtype=torch.bfloat16)
    run(Q, host, seed=3, steps=3, sites=lambda t, r: "host", dtype=torch.bfloat16)
    assert_same(P, Q, dev, host)


def test_sites_may_change_between_steps_and_regions():
    """The planner may move a region between host and device from one step to the next,
    and mix both in one step (and p.grad left by autograd): state created by either path
    serves the other."""
    seed, steps = 4, 6
    P = make_problem(seed, homed=True)
    Q = clone_problem(P, homed=True)
    mixed, host = mo.AdamW(groups(P)), mo.AdamW(groups(Q))
    pattern = ["device", "host", "grad"]
    run(P, mixed, seed=seed, steps=steps, sites=lambda t, r: pattern[(t + r) % 3])
    run(Q, host, seed=seed, steps=steps, sites=lambda t, r: "host" if (t + r) % 3 < 2 else "grad")
    assert_same(P, Q, mixed, host)


def test_state_dict_after_device_updates_continues_exactly():
    """Moments the device path created (views of one region buffer) save, load into
    torch.optim.AdamW and megatrain.AdamW, and training continues bit for bit."""
    seed = 5
    P = make_problem(seed, homed=True)
    opt = mo.AdamW(groups(P))
    run(P, opt, seed=seed, steps=3, sites=lambda t, r: "device")
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    Q, R = clone_problem(P), clone_problem(P)
    ours, ref = mo.AdamW(groups(Q)), torch.optim.AdamW(groups(R), fused=True)
    for o in (ours, ref):
        buf.seek(0)
        o.load_state_dict(torch.load(buf, weights_only=True))
    run(P, opt, seed=seed + 1, steps=2, sites=lambda t, r: "device")
    run(Q, ours, seed=seed + 1, steps=2, sites=lambda t, r: "host")
    run(R, ref, seed=seed + 1, steps=2, sites=lambda t, r: "grad")
    assert_same(P, Q, opt, ours)
    assert_same(P, R, opt, ref)
    twin = copy.deepcopy(opt)  # waits, and copies the shared moment buffers
    assert all(torch.equal(twin.state[a]["exp_avg"], opt.state[b]["exp_avg"])
               for a, b in zip(twin.param_groups[0]["params"], opt.param_groups[0]["params"]))


def test_prepare_device_update_creates_zero_state():
    P = make_problem(6)
    Q = clone_problem(P)
    opt, ref = mo.AdamW(groups(P)), mo.AdamW(groups(Q))
    opt.prepare_device_update(list(P.values()), "cpu")
    for p in P.values():
        st = opt.state[p]
        assert float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
    run(P, opt, seed=6, steps=2, sites=lambda t, r: "device")
    run(Q, ref, seed=6, steps=2, sites=lambda t, r: "host")
    assert_same(P, Q, opt, ref)
    with pytest.raises(ValueError, match="not managed"):
        opt.prepare_device_update([torch.nn.Parameter(torch.zeros(2))], "cpu")


# ---- ordering ----------------------------------------------------------------------------


class Gate:
    """Holds every CPU device update before it starts, until opened."""

    def __init__(self, monkeypatch):
        self.open_ = threading.Event()
        self.started = threading.Event()
        inner = du._run_cpu

        def gated(handle, job):
            self.started.set()
            assert self.open_.wait(timeout=30)
            inner(handle, job)

        monkeypatch.setattr(du, "_run_cpu", gated)

    def open(self):
        self.open_.set()


def blocked(fn) -> tuple[threading.Thread, list]:
    """Run ``fn`` on a thread; it must still be blocked a moment later."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    time.sleep(0.2)
    assert t.is_alive(), "returned before the device update completed"
    return t, out


@pytest.mark.parametrize("waiter", ["wait_params", "step", "synchronize", "state_dict", "handle"])
def test_waits_for_the_copy_back(monkeypatch, waiter):
    """Until the update is back in host memory nobody sees the parameters: the runtime's
    wait_params (before its next fetch), step(), synchronize(), state_dict() and the
    handle itself all block, then see the updated values."""
    seed = 7
    P = make_problem(seed, homed=True)
    Q = clone_problem(P, homed=True)
    opt, ref = mo.AdamW(groups(P)), mo.AdamW(groups(Q))
    gate = Gate(monkeypatch)
    grads = grads_of(P, seed, 0, torch.bfloat16)
    before = {k: p.detach().clone() for k, p in P.items()}
    region = [P[n] for n in REGIONS[0]]
    handle = opt.submit_on_device(region, [grads[n] for n in REGIONS[0]], "cpu")
    assert gate.started.wait(timeout=30)
    assert not handle.done() and not handle.cancel()
    assert all(torch.equal(P[k], before[k]) for k in P)  # nothing written yet
    calls = {
        "wait_params": lambda: opt.wait_params([region[-1]]),
        "step": opt.step,
        "synchronize": opt.synchronize,
        "state_dict": opt.state_dict,
        "handle": handle.result,
    }
    t, out = blocked(calls[waiter])
    gate.open()
    t.join(timeout=30)
    assert not t.is_alive() and len(out) == 1
    assert handle.done() and handle.exception() is None
    ref.submit([Q[n] for n in REGIONS[0]], [grads[n] for n in REGIONS[0]]).result()
    for k in P:
        assert torch.equal(P[k], Q[k]), k
    if waiter == "state_dict":
        sd = out[0]
        assert torch.equal(sd["state"][2]["exp_avg"], ref.state[Q["w3"]]["exp_avg"])  # w3: index 2


def test_other_regions_and_the_host_worker_are_not_held_up(monkeypatch):
    """A pending device update blocks only its own parameters: another region's host
    update runs and is waited for meanwhile."""
    P = make_problem(8)
    opt = mo.AdamW(groups(P))
    gate = Gate(monkeypatch)
    grads = grads_of(P, 8, 0, torch.float32)
    handle = opt.submit_on_device([P[n] for n in REGIONS[0]], [grads[n] for n in REGIONS[0]], "cpu")
    before = P["w1"].detach().clone()
    opt.submit([P[n] for n in REGIONS[2]], [grads[n] for n in REGIONS[2]])
    opt.wait_params([P["w1"], P["b1"]])  # returns although the device update is held
    assert not torch.equal(P["w1"], before) and not handle.done()
    gate.open()
    opt.synchronize()
    assert handle.done()


def test_several_pending_device_updates_complete_in_order(monkeypatch):
    P = make_problem(9)
    Q = clone_problem(P)
    opt, ref = mo.AdamW(groups(P)), mo.AdamW(groups(Q))
    gate = Gate(monkeypatch)
    grads = grads_of(P, 9, 0, torch.float32)
    handles = [
        opt.submit_on_device([P[n] for n in r], [grads[n] for n in r], "cpu") for r in REGIONS
    ]
    done_order = []
    for i, h in enumerate(handles):
        h.add_done_callback(lambda _, i=i: done_order.append(i))
    gate.open()
    opt.wait_params([P["w1"]])
    assert handles[-1].done()
    opt.step()
    assert done_order == [0, 1, 2]
    for r in REGIONS:
        ref.submit([Q[n] for n in r], [grads[n] for n in r])
    ref.step()
    assert_same(P, Q, opt, ref)


def test_a_failed_device_update_surfaces_at_wait_params_and_step(monkeypatch):
    P = make_problem(10)
    opt = mo.AdamW(groups(P))

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(functional, "adamw_", broken)
    grads = grads_of(P, 10, 0, torch.float32)
    handle = opt.submit_on_device([P["w1"], P["b1"]], [grads["w1"], grads["b1"]], "cpu")
    with pytest.raises(RuntimeError, match="kernel failed"):
        opt.wait_params([P["w1"]])
    assert isinstance(handle.exception(), RuntimeError)
    opt.submit_on_device([P["w2"]], [grads["w2"]], "cpu")
    with pytest.raises(RuntimeError, match="kernel failed"):
        opt.step()


def test_host_worker_orders_later_tasks_after_tracked_work():
    """HostWorker.track: a task queued later on the same tensor starts only after the
    tracked future (the FIFO waits with it: a safety net, AdamW never queues one, since
    step() waits for device updates first); wait/wait_all include the tracked future."""
    worker = HostWorker(1)
    a, b = torch.zeros(3), torch.zeros(3)
    outside: Future = Future()
    worker.track(outside, [a])
    t, _ = blocked(lambda: worker.wait([a]))
    ran = []
    fa = worker.submit(lambda: ran.append("a"), touches=[a])
    fb = worker.submit(lambda: ran.append("b"), touches=[b])
    time.sleep(0.1)
    assert ran == [] and not fa.done()
    outside.set_result(None)
    t.join(timeout=30)
    fb.result(timeout=30)
    assert ran == ["a", "b"]
    failed: Future = Future()
    worker.track(failed, [b])
    failed.set_exception(RuntimeError("elsewhere"))
    with pytest.raises(RuntimeError, match="elsewhere"):
        worker.wait([b])
    with pytest.raises(RuntimeError, match="elsewhere"):
        worker.wait_all()
    worker.shutdown()


def test_host_worker_counts_its_busy_time_not_its_waits():
    """busy_s (AdamW.host_busy_s, the measured side of the cost model's host stream) sums
    the tasks' running time; a task's wait for tracked work elsewhere is not busy time."""
    worker = HostWorker(1)
    a = torch.zeros(3)
    worker.submit(time.sleep, 0.05).result(timeout=30)
    assert 0.05 <= worker.busy_s < 1.0
    before = worker.busy_s
    outside: Future = Future()
    worker.track(outside, [a])
    queued = worker.submit(lambda: None, touches=[a])  # waits for `outside` first
    time.sleep(0.2)
    outside.set_result(None)
    queued.result(timeout=30)
    assert worker.busy_s - before < 0.1
    worker.shutdown()


# ---- what is refused, and why ----------------------------------------------------------------


def test_deferred_modes_are_refused_with_the_reason():
    P = make_problem(11)
    g = {k: torch.zeros_like(p) for k, p in P.items()}
    w = P["w1"]
    acc = mo.AdamW(groups(P))
    with acc.accumulate():
        assert "accumulate()" in acc.device_update_blocker([w])
        with pytest.raises(ValueError, match=r"accumulate\(\).*submit\(\)"):
            acc.submit_on_device([w], [g["w1"]], "cpu")
    for option, word in ((dict(max_grad_norm=1.0), "global gradient norm"),
                         (dict(skip_nonfinite=True), "skip_nonfinite")):
        opt = mo.AdamW(groups(clone_problem(P)), **option)
        q = opt.param_groups[0]["params"][0]
        with pytest.raises(ValueError, match=word):
            opt.submit_on_device([q], [torch.zeros_like(q)], "cpu")
        assert not any(opt.state.values())
    # Earlier micro-batches summed on the host: the last one cannot go to the device.
    with acc.accumulate():
        acc.submit([w], [g["w1"]])
    with pytest.raises(ValueError, match=r"p\.grad"):
        acc.submit_on_device([w], [g["w1"]], "cpu")
    acc.zero_grad()
    assert acc.device_update_blocker([w]) is None
    acc.submit_on_device([w], [g["w1"]], "cpu")
    with pytest.raises(ValueError, match="already received its last gradient"):
        acc.submit_on_device([w], [g["w1"]], "cpu")
    with pytest.raises(ValueError, match="already received its last gradient"):
        acc.submit([w], [g["w1"]])
    acc.step()
    acc.submit([w], [g["w1"]])
    with pytest.raises(ValueError, match="already received its last gradient"):
        acc.submit_on_device([w], [g["w1"]], "cpu")


def test_subclasses_with_their_own_gradient_flow_are_refused():
    class Custom(mo.AdamW):
        def submit(self, params, grads):
            return super().submit(params, grads)

    w = torch.nn.Parameter(torch.zeros(3))
    opt = Custom([w])
    with pytest.raises(ValueError, match="Custom hands gradients"):
        opt.submit_on_device([w], [torch.zeros(3)], "cpu")


def test_bad_input_is_named_and_changes_nothing():
    P = make_problem(12)
    opt = mo.AdamW(list(P.items()))
    w, z = P["w1"], torch.zeros(P["w1"].shape)
    cases = [
        (ValueError, "one gradient per parameter", ([w], []), {}),
        (TypeError, r"'w1'.*float64", ([w], [z.double()]), {}),
        (TypeError, r"'w1'.*torch.int64", ([w], [z.long()]), {}),
        (TypeError, r"'w1'.*sparse", ([w], [z.to_sparse()]), {}),
        (TypeError, "must be a Tensor", ([w], [1.0]), {}),
        (ValueError, r"'w1'.*shape", ([w], [torch.zeros(w.numel())]), {}),
        (ValueError, r"'w1'.*is on meta", ([w], [torch.zeros(w.shape, device="meta")]), {}),
        (ValueError, "not managed", ([torch.nn.Parameter(torch.zeros(2))], [torch.zeros(2)]), {}),
        (ValueError, "twice", ([w, w], [z, z]), {}),
        (ValueError, "copy_streams and ready", ([w], [z]), dict(copy_streams=(None, None))),
    ]
    for exc, match, (ps, gs), kw in cases:
        with pytest.raises(exc, match=match):
            opt.submit_on_device(ps, gs, "cpu", **kw)
    for device in ("mps", "meta", "not-a-device"):
        with pytest.raises(ValueError, match="device="):
            opt.submit_on_device([w], [z], device)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            opt.submit_on_device([w], [z], "cuda")
    t = torch.nn.Parameter(torch.randn(6, 8).t())  # a transposed (non-contiguous) master
    opt.add_param_group({"params": [t], "param_names": ["t"]})
    with pytest.raises(ValueError, match="not contiguous.*submit()"):
        opt.submit_on_device([t], [torch.zeros(t.shape)], "cpu")
    assert all(p.grad is None for p in P.values())
    assert not any(opt.state.values()) and not opt._final


# ---- pieces --------------------------------------------------------------------------------


def test_copies_cover_exactly_the_region():
    """Host tensors back to back share one copy; a gap (another tensor may live there) is
    never copied, so the copy back cannot overwrite it."""
    P = make_problem(13, homed=True)
    region = [P[n] for n in REGIONS[0]]  # homed: mix (42 elems), w3, big: padded between
    lay = FlatLayout.of([p.shape for p in region])
    runs = du.copy_runs([p.detach() for p in region], lay)
    assert [(o, n) for o, n, _ in runs] == [(o, p.numel()) for o, p in zip(lay.offsets, region)]
    base = torch.zeros(256)
    a, _gap, b, c = base[0:64], base[64:70], base[70:134], base[134:198]
    lay = FlatLayout.of([(64,), (64,), (64,)])
    runs = du.copy_runs([a, b, c], lay)  # a|b have a gap in host memory; b|c are adjacent
    assert [(o, n) for o, n, _ in runs] == [(0, 64), (64, 128)]
    assert runs[1][2].data_ptr() == b.data_ptr()


def test_handle_reports_its_device_memory():
    P = make_problem(14)
    opt = mo.AdamW(groups(P))
    names = REGIONS[0]
    grads = grads_of(P, 14, 0, torch.bfloat16)
    h = opt.submit_on_device([P[n] for n in names], [grads[n] for n in names], "cpu")
    h.result(timeout=30)
    lay = FlatLayout.of([P[n].shape for n in names])
    numel = sum(P[n].numel() for n in names)
    assert h.numel == numel and h.device == torch.device("cpu")
    assert h.device_bytes == 4 * (3 * lay.numel + numel + len(names))
    assert h.updated is None and h.copied_back is None  # CUDA events only
    empty = opt.submit_on_device([], [], "cpu")
    assert empty.done() and empty.numel == 0


# ---- the decision ----------------------------------------------------------------------------

H200_FAST_HOST = Rates("H200, 125 GB/s host", h2d=55e9, d2h=55e9, duplex=90e9, flops=700e12,
                       adamw=125e9 / 28)
LAYER = 100_000_000  # a 3B model's layer


def test_update_site_on_the_h200_box():
    """A fast host's numbers: one region with its own fp32 weight fetch in the phase is a
    toss-up (device at 106 GB/s of host AdamW, host at 125 GB/s); balanced over a 3B
    model's backward most regions go to the device, and the phase ends 12-15% sooner."""
    fetch = du.PhaseLoad.streaming(LAYER)
    assert du.host_bandwidth(GPU_DEFAULT) == pytest.approx(106.4e9)
    assert du.update_site(LAYER, GPU_DEFAULT, load=fetch) == "device"
    assert du.update_site(LAYER, H200_FAST_HOST, load=fetch) == "host"
    for rates, on_device, mixed in ((GPU_DEFAULT, 23, 0.765), (H200_FAST_HOST, 19, 0.670)):
        base = du.PhaseLoad.streaming(28 * LAYER)
        sites, load = du.assign_sites([LAYER] * 28, rates, load=base)
        assert sites.count("device") == on_device
        assert load.seconds(rates) == pytest.approx(mixed, abs=1e-3)
        for same in ("host", "device"):
            alone = base + du.update_load(28 * LAYER, same)
            assert load.seconds(rates) < 0.9 * alone.seconds(rates)


def test_update_site_edges():
    assert du.update_site(0, GPU_DEFAULT) == "host"
    assert du.update_site(1_000_000, GPU_DEFAULT) == "host"  # the fixed cost decides
    assert du.update_site(LAYER, GPU_DEFAULT) == "device"
    need = du.device_bytes(LAYER)
    assert need == 16 * LAYER
    assert du.update_site(LAYER, GPU_DEFAULT, device_free_bytes=need - 1) == "host"
    assert du.update_site(LAYER, GPU_DEFAULT, device_free_bytes=need) == "device"
    slow_link = Rates("PCIe 4", h2d=25e9, d2h=25e9, duplex=40e9, flops=1e15, adamw=3.8e9)
    assert du.update_site(LAYER, slow_link) == "host"
    # fp32 gradients would have cost the host path 4 B/param of D2H and DMA, not 2
    assert du.update_site(LAYER, H200_FAST_HOST, grad_bytes=4) == "host"
    assert du.link_seconds(GPU_DEFAULT, 90e9, 0) == pytest.approx(90 / 55)
    assert du.link_seconds(GPU_DEFAULT, 45e9, 45e9) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="site"):
        du.update_load(1, "gpu")
    with pytest.raises(ValueError, match="region_params"):
        du.update_site(-1, GPU_DEFAULT)


rate = st.floats(1e9, 1e12)


@settings(max_examples=200, deadline=None)
@given(h2d=rate, d2h=rate, duplex=rate, adamw=st.floats(1e8, 1e11),
       n=st.integers(0, 10**9), up=st.floats(0, 1e10), down=st.floats(0, 1e10),
       host=st.floats(0, 1e10), k=st.floats(1.0, 10.0))
def test_update_site_is_monotone_in_the_rates(h2d, d2h, duplex, adamw, n, up, down, host, k):
    """A faster link never sends a region back to the host; faster host memory never
    sends one to the device."""
    r = Rates("r", h2d=h2d, d2h=d2h, duplex=duplex, flops=1e12, adamw=adamw)
    load = du.PhaseLoad(up, down, host)
    site = du.update_site(n, r, load=load)
    if site == "device":
        assert du.update_site(n, r.scaled(link=k), load=load) == "device"
    else:
        assert du.update_site(n, r.scaled(host=k), load=load) == "host"
