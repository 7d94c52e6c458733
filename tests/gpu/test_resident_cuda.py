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

from .compare import assert_runs_agree, seeded_llama_and_batches, train_fp32_on_cuda

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


def test_bf16_resident_training_matches_host_updates_on_cuda():
    """bf16 compute: gradients upcast into the scratch on the compute stream, in order."""
    from ..compiler.helpers import train_megatrain

    model, batches = seeded_llama_and_batches()
    out = {u: train_megatrain(model, batches, {"device": "cuda", "updates": u, "gpu_memory": "2GiB"})
           for u in ("resident", "host")}
    assert out["resident"]["plan"].streamer.resident.updates > 0
    for a, b in zip(out["resident"]["losses"], out["host"]["losses"]):
        assert abs(a - b) / abs(b) < 1e-3, (out["resident"]["losses"], out["host"]["losses"])
    torch.testing.assert_close(out["resident"]["params"], out["host"]["params"], rtol=1e-3, atol=1e-4)
