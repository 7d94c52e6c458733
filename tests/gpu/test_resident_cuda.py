"""updates="resident" on CUDA: AdamW state kept on the GPU between steps (megatrain.optim.
resident, megatrain.runtime.resident_regions) against the device-site update, which runs
the same fused CUDA kernel on the same upcast gradients but streams master, m and v in and
out every step. The two must agree like any two CUDA runs (compare.py's tolerance: the
embedding's atomic-add backward is not deterministic); a stale master, a fetch that does
not wait for its region's update, or an update reading an overwritten gradient moves
parameters by ~lr = 3e-3. The fetches must have come from the GPU copies (the CPU tests,
tests/compiler/test_resident.py, hold the host copies stale until synchronize())."""

from __future__ import annotations

import pytest
import torch

from .compare import (assert_gpu_and_host_updates_agree, assert_runs_agree, seeded_llama_and_batches,
                      train_fp32_on_cuda)

pytestmark = pytest.mark.gpu


def test_resident_state_matches_device_updates_on_cuda():
    model, batches = seeded_llama_and_batches()
    res, res_losses, plan = train_fp32_on_cuda(model, batches, updates="resident", gpu_memory="2GiB")
    dev, dev_losses, _ = train_fp32_on_cuda(model, batches, updates="device", gpu_memory="2GiB")
    resident = plan.streamer.resident
    assert resident.regions and not resident.demoted, (plan.update_sites, resident.demoted)
    assert resident.updates == 3 * sum(len(p) for p in resident.regions.values())
    assert plan.streamer.last_stats.fetch_paths["resident"] > 0
    assert plan.measured_peak_bytes <= plan.budget
    assert_runs_agree(model, res, dev, res_losses, dev_losses)


def test_bf16_gradients_are_upcast_in_stream_order_on_cuda():
    """The runtime's hand-off for a resident region (ResidentRegions.take): each bf16
    gradient is upcast into the one scratch and applied, on the compute stream, while that
    stream is still busy (so every kernel queues): a scratch overwritten before its update
    read it would show. Against the host update of the same gradients, within the CUDA
    kernel's rounding (test_device_update_cuda.py's tolerances)."""
    from megatrain.optim import AdamW
    from megatrain.memory.host_store import home_parameters
    from megatrain.memory.pool import DevicePool, Reserve
    from megatrain.runtime.resident_regions import ResidentRegions

    from .test_device_update_cuda import PARAM_TOL, TOL

    g = torch.Generator().manual_seed(0)
    shapes = [(257, 64), (64,), (3, 5, 7)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    home_parameters(params, pin=True)
    opt, host = (AdamW(ps, lr=1e-2, weight_decay=0.1) for ps in (params, ref))
    device = torch.device("cuda")
    regions = ResidentRegions(device, params, {0: [0, 1, 2]}, Reserve(DevicePool(1 << 30), 1 << 30))
    assert regions.regions == {0: [0, 1, 2]} and regions.sources(0, params) is not None
    for _ in range(3):
        grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
        on_device = [x.to(device) for x in grads]
        torch.cuda._sleep(100_000_000)  # the compute stream stays busy while we queue
        for p, x in zip(params, on_device):
            assert regions.take(x, 0, p)
        host.submit(ref, grads)
        for o in (opt, host):
            o.step()
            o.zero_grad()
    assert regions.updates == 9 and not regions.demoted
    opt.synchronize()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach(), **PARAM_TOL)
        for key, tol in TOL.items():
            torch.testing.assert_close(opt.state[p][key], host.state[q][key], **tol)
        assert float(opt.state[p]["step"]) == float(host.state[q]["step"]) == 3


def test_clipped_resident_training_matches_the_host_path_on_cuda():
    """With max_grad_norm the gradients wait in device buffers; step() takes their norms on
    the GPU beside the host's and applies the clipped update there. The global norms must
    agree step by step (clipping active: above 0.5), the parameters within compare.py's
    GPU-against-host tolerance (AdamW on the GPU against AdamW on the host: the first CUDA
    run failed the two-CUDA-runs tolerance by 3 elements of 131072, by up to 3.0e-5)."""
    from ..compiler.helpers import train_megatrain

    model, batches = seeded_llama_and_batches()
    options = {"device": "cuda", "precision": "fp32", "gpu_memory": "2GiB"}
    res = train_megatrain(model, batches, {**options, "updates": "resident"}, max_grad_norm=0.5)
    host = train_megatrain(model, batches, {**options, "updates": "host"}, max_grad_norm=0.5)
    resident = res["plan"].streamer.resident
    assert resident.regions and not resident.demoted and set(resident.buffered) == set(resident.regions)
    params = [p.detach() for p in res["model"].parameters()]
    reference = [p.detach() for p in host["model"].parameters()]
    for a, b in zip(res["norms"], host["norms"]):
        assert b > 0.5 and abs(a - b) / b < 1e-5, (res["norms"], host["norms"])
    assert_gpu_and_host_updates_agree(model, params, reference, res["losses"], host["losses"])


def test_a_parameter_larger_than_the_scratch_is_updated_in_pieces_bitwise_on_cuda(monkeypatch):
    """A parameter larger than the upcast scratch (resident.UPCAST_PIECE elements, made
    65536 here: CUDA's multi_tensor_apply chunk, of which the real one is a multiple) is
    upcast and updated piece by piece, its step counted once, a transposed gradient too:
    bitwise torch.optim.AdamW(fused=True) on the whole fp32 gradient on the GPU (the same
    kernel, its blocks over the same elements)."""
    from megatrain.optim import AdamW
    from megatrain.optim import resident as resident_mod
    from megatrain.memory.host_store import home_parameters
    from megatrain.memory.pool import DevicePool, Reserve
    from megatrain.runtime.resident_regions import ResidentRegions

    piece = 1 << 16
    monkeypatch.setattr(resident_mod, "UPCAST_PIECE", piece)
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    shapes = [(700, 300), ((1 << 16) + 5,), (64, 3), (5, 7)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().to(device)) for p in params]
    home_parameters(params, pin=True)
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    reserve = Reserve(DevicePool(1 << 30), 1 << 30)
    regions = ResidentRegions(device, params, {0: [0, 1, 2, 3]}, reserve)
    assert reserve.live == regions.held_bytes == resident_mod.resident_bytes(shapes) + 4 * piece
    assert regions.sources(0, params) is not None
    for _ in range(3):
        grads = [torch.randn(s[::-1], generator=g).to(torch.bfloat16).t() if len(s) == 2 and s[0] > 64
                 else torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
        on_device = [x.to(device) for x in grads]
        assert not on_device[0].is_contiguous()
        torch.cuda._sleep(100_000_000)  # the compute stream stays busy while we queue
        for p, x in zip(params, on_device):
            assert regions.take(x, 0, p)
        for q, x in zip(ref, on_device):
            q.grad = x.float().contiguous()
        torch_opt.step()
        opt.step()
        opt.zero_grad()
    assert regions.updates == 12 and not regions.demoted
    opt.synchronize()
    for p, q in zip(params, ref):
        assert torch.equal(p.detach(), q.detach().cpu())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], torch_opt.state[q][key].cpu()), key


def test_the_main_jobs_device_peak_counts_the_resident_state_on_cuda():
    """The main job's `device_peak_bytes` is what the card held at most in the last step:
    the step's own peak (explain's measured_peak_bytes, counted from the step's start) plus
    the AdamW state that stayed resident through it."""
    from megatrain.train import metrics

    model, batches = seeded_llama_and_batches()
    _, _, plan = train_fp32_on_cuda(model, batches, updates="resident", gpu_memory="2GiB")
    resident = plan.streamer.resident
    held = sum(resident.held.values())
    assert resident.regions and held > 0
    assert metrics.device_peak_bytes("cuda") >= plan.measured_peak_bytes + held


def test_the_main_job_turns_on_expandable_segments_on_cuda(monkeypatch):
    """memory/allocator.py on a real card: with no allocator configuration given, turning
    expandable segments on at run time makes the next new segment expandable (so resident
    growth can fill the room a measured step left without fragmentation refusing a large
    block); the process's setting is put back after."""
    from megatrain.memory import allocator

    for k in allocator._ENV:
        monkeypatch.setenv(k, "")  # unset for the test, restored after it
    torch.cuda.empty_cache()
    x = None
    try:
        assert allocator.enable_expandable_segments() and allocator.expandable_segments()
        x = torch.empty(96 << 20, device="cuda")  # 384 MiB: a segment of its own
        ours = [s for s in torch.cuda.memory_snapshot()
                if any(b["size"] >= x.numel() * 4 and b["state"] == "active_allocated"
                       for b in s["blocks"])]
        assert ours and all(s["is_expandable"] for s in ours), ours
    finally:
        del x
        torch.cuda.empty_cache()
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:False")
