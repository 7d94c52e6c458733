"""megatrain.AdamW.submit_on_device on CUDA: a region's AdamW run on the GPU (page-locked
master, m, v copied in on a copy stream, torch._fused_adamw_ there, copied back on the D2H
stream) against the host update, and the ordering of the copy back before the runtime's
next fetch of the region.

Tolerance, and why not bitwise: the CUDA fused kernel is not the CPU one. nvcc contracts
``beta1 * m + (1 - beta1) * g`` and friends into FMAs and orders the bias corrections
differently, so each step may round m, v and the update differently by an ulp or two. The
gradients here are the same tensors on both sides (no feedback through a loss), so the
difference does not grow beyond that: after S steps |dp| <= ~S ulp(p) (p ~ 0.5: 6e-8 per
ulp), hence params rtol=1e-5, atol=1e-6; m (magnitude ~|g| <= ~4, may cancel towards 0):
rtol=1e-5, atol=1e-6. v (a sum of squares, no cancellation) differs by more than ulps, by
design of the two kernels: the CUDA one forms ``1 - beta2`` in fp32 (1 - 0.999f =
1.0000467e-3, 4.7e-5 off), the CPU one in double; on the H200 the largest relative gap in
v was 1.31e-5, exactly what fp32 vs double coefficients give on the CPU (measured
in session 4). Hence v: rtol=3e-5, atol=1e-9; a wrong beta2 or a missed step moves v by
>= 1e-3 relative. One
update moves parameters by ~lr = 1e-2 and a missed weight decay by ~lr * wd * |p| = 5e-4
per step: both far above these tolerances, so a wrong step, hyperparameter or group
would fail. Step counts must be equal exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

import megatrain.optim as mo
from megatrain.memory.host_store import home_parameters, is_page_locked
from megatrain.memory.layout import FlatLayout

from .compare import assert_gpu_and_host_updates_agree, seeded_llama_and_batches, train_fp32_on_cuda

pytestmark = pytest.mark.gpu

PARAM_TOL = dict(rtol=1e-5, atol=1e-6)
TOL = {"exp_avg": dict(rtol=1e-5, atol=1e-6), "exp_avg_sq": dict(rtol=3e-5, atol=1e-9)}

SHAPES = {"w1": (64, 33), "b1": (64,), "w2": (257, 64), "gain": (257,), "mix": (2, 3, 7)}
GROUPS = [
    (["w1", "w2"], dict(lr=1e-2, weight_decay=0.1)),
    (["b1", "gain"], dict(lr=3e-2, weight_decay=0.0)),
    (["mix"], dict(lr=5e-3, weight_decay=0.05, betas=(0.8, 0.99), eps=1e-6)),
]
REGIONS = [["mix", "w2", "gain"], ["w1", "b1"]]


def problem(seed: int, pin: bool):
    g = torch.Generator().manual_seed(seed)
    P = {k: torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for k, s in SHAPES.items()}
    for r in REGIONS:
        home_parameters([P[n] for n in r], pin=pin)
    return P


def groups(P):
    return [{"params": [P[n] for n in names], **opts} for names, opts in GROUPS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_update_matches_host_update_within_fp32_rounding(dtype):
    steps = 5
    P, Q = problem(0, pin=True), problem(0, pin=False)
    start = {k: p.detach().clone() for k, p in P.items()}
    dev, host = mo.AdamW(groups(P)), mo.AdamW(groups(Q))

    def lam(t):
        return (t + 1) / 2 if t < 2 else 0.5 * (1 + math.cos(math.pi * t / steps))

    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lam) for o in (dev, host)]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = {k: torch.randn(s, generator=g).to(dtype) for k, s in SHAPES.items()}
        handles = []
        for r in REGIONS:
            cuda_grads = [grads[n].to("cuda") for n in r]
            handles.append(dev.submit_on_device([P[n] for n in r], cuda_grads, "cuda"))
            host.submit([Q[n] for n in r], [grads[n] for n in r])
        for o, s in zip((dev, host), scheds):
            o.step()
            o.zero_grad()
            s.step()
        assert all(h.done() for h in handles)
    for k in P:
        assert float(dev.state[P[k]]["step"]) == float(host.state[Q[k]]["step"]) == steps
        torch.testing.assert_close(P[k].detach(), Q[k].detach(), **PARAM_TOL, msg=k)
        for key, tol in TOL.items():
            torch.testing.assert_close(dev.state[P[k]][key], host.state[Q[k]][key], **tol,
                                       msg=lambda m, key=key: f"{k}.{key}: {m}")
        assert (P[k] - start[k]).abs().max() > 1e3 * PARAM_TOL["atol"]  # it trained
        for key in TOL:
            assert is_page_locked(dev.state[P[k]][key])  # moved once into page-locked memory


def _big_region(seed: int, pin: bool):
    g = torch.Generator().manual_seed(seed)
    shapes = [(4096, 4096), (4096,)]  # 16.8 M parameters: 200 MB each of master, m, v
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for s in shapes]
    home_parameters(params, pin=pin)
    return params, shapes


def _delayed_grads(params, seed: int):
    """Gradients on the GPU whose producer (the compute stream) is still busy ~0.2 s."""
    g = torch.Generator().manual_seed(seed)
    host = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in params]
    cuda = [h.to("cuda") for h in host]
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of compute-stream work before "backward ends"
    return host, cuda


def test_copy_back_is_ordered_before_the_next_fetch():
    """The runtime's next fetch of the region (Streamer.prefetch -> opt.wait_params) reads
    the updated master, never the stale one, even while the update is still queued behind
    compute; the copy streams are the streamer's own, as the wiring will pass them."""
    from megatrain.runtime import streamer as streamer_mod

    params, shapes = _big_region(2, pin=True)
    ref_params, _ = _big_region(2, pin=False)
    stale = [p.detach().to(torch.bfloat16) for p in params]
    opt = mo.AdamW(params, lr=1e-2, weight_decay=0.1)
    ref = mo.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    numel = FlatLayout.of(shapes).numel
    s = streamer_mod.Streamer(torch.device("cuda"), torch.bfloat16, 1 << 32, params)
    host_grads, cuda_grads = _delayed_grads(params, 3)
    handle = opt.submit_on_device(params, cuda_grads, "cuda",
                                  copy_streams=(s.h2d_stream, s.d2h_stream))
    del cuda_grads  # the handle keeps them alive until the kernel has read them
    assert not handle.done()  # the race window is open: the update waits for compute
    s.begin_step()
    s.prefetch(0, params)  # must wait for the copy back
    assert handle.done() and handle.copied_back.query()
    assert s.stats.optimizer_wait_s > 0.05
    flat = s.wait(0, numel)
    torch.cuda.synchronize()
    ref.submit(ref_params, host_grads).result()
    for p, q, v, old in zip(params, ref_params, FlatLayout.of(shapes).views(flat), stale):
        assert torch.equal(v.cpu(), p.detach().to(torch.bfloat16))  # the fetch saw the update
        assert not torch.equal(v.cpu(), old)
        torch.testing.assert_close(p.detach(), q.detach(), **PARAM_TOL)
    s.evict(0, flat)


@pytest.mark.parametrize("waiter", ["wait_params", "step", "state_dict"])
def test_host_readers_wait_and_device_memory_is_returned(waiter):
    params, _ = _big_region(4, pin=True)
    opt = mo.AdamW(params, lr=1e-2)
    opt.prepare_device_update(params, "cuda")  # page-lock the moments ahead of time
    host_grads, cuda_grads = _delayed_grads(params, 5)
    before = [p.detach().clone() for p in params]
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    handle = opt.submit_on_device(params, cuda_grads, "cuda")
    del cuda_grads
    assert not handle.done()
    {"wait_params": lambda: opt.wait_params(params), "step": opt.step,
     "state_dict": opt.state_dict}[waiter]()
    assert handle.done() and handle.copied_back.query()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))
    # The device buffer, the upcast gradients and the gradients themselves are gone.
    grads_bytes = sum(g.numel() * 2 for g in host_grads)
    assert torch.cuda.memory_allocated() <= base - grads_bytes + (1 << 20)
    assert torch.cuda.max_memory_allocated() - base <= handle.device_bytes + (4 << 20)


def test_cuda_refusals():
    params, _ = _big_region(6, pin=False)  # pageable masters
    opt = mo.AdamW(params)
    grads = [torch.zeros(p.shape, device="cuda") for p in params]
    with pytest.raises(ValueError, match="page-locked"):
        opt.submit_on_device(params, grads, "cuda")
    pinned, _ = _big_region(7, pin=True)
    opt = mo.AdamW(pinned)
    with pytest.raises(ValueError, match="is on cpu"):
        opt.submit_on_device(pinned, [torch.zeros(p.shape) for p in pinned], "cuda")
    with pytest.raises(TypeError, match="copy_streams"):
        opt.submit_on_device(pinned, grads, "cuda", copy_streams=("a", "b"))
    assert not any(opt.state.values()) and not opt._final


@pytest.mark.usefixtures("no_tf32")
def test_backend_device_updates_match_host_updates_on_cuda():
    """The streaming runtime with every region's AdamW on the GPU (gradients kept there,
    master, m, v over the streamer's copy streams) against host updates, fp32, TF32 off,
    within compare.py's GPU-against-host tolerance."""
    model, batches = seeded_llama_and_batches(layers=3)
    dev, dev_losses, plan = train_fp32_on_cuda(model, batches, updates="device")
    host, host_losses, host_plan = train_fp32_on_cuda(model, batches, updates="host")
    assert set(plan.update_sites.values()) == {"device"} and len(plan.update_sites) == 3 + 2
    assert plan.streamer.device_updates.launched == 3 * 5
    assert set(host_plan.update_sites.values()) == {"host"}
    assert_gpu_and_host_updates_agree(model, dev, host, dev_losses, host_losses)
    assert plan.measured_peak_bytes <= plan.budget
