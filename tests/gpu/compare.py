"""Two CUDA training runs of the same model that must agree: how the runtime options' GPU
tests run them and check them (backlog, gradient ring, device updates, kept weights against
their plain run).

Tolerance: both runs do the same math, but CUDA reductions with atomics are not
deterministic run to run (~1e-7 relative from step 2), which AdamW amplifies where
|g| ~ eps: rtol=atol=1e-5 on fp32 parameters. A lost, doubled or stale gradient or weight
moves parameters by ~lr = 3e-3. Each parameter must also have moved (it trained)."""

from __future__ import annotations

import torch

from megatrain.models import Llama, LlamaConfig

from ..compiler.helpers import random_batches, train_megatrain


def seeded_llama_and_batches(layers: int = 4):
    """The runtime options' GPU tests' problem: a 256-wide untied Llama of `layers` layers
    from seed 0, and three batches of 2 x 64 tokens drawn after it."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=512, hidden=256, layers=layers, heads=4, kv_heads=2, ffn=688,
                              rope_theta=10000.0, tie_embeddings=False))
    return model, random_batches(512, 3, batch=2, seq=64)


def train_fp32_on_cuda(model, batches, **options):
    """Three fp32 steps of a copy of `model` through the backend on CUDA with megatrain.AdamW
    and `options`: (trained parameters, losses, the first graph's plan)."""
    out = train_megatrain(model, batches, {"device": "cuda", "precision": "fp32", **options})
    return [p.detach().clone() for p in out["model"].parameters()], out["losses"], out["plan"]


def assert_runs_agree(model, params, reference, losses, reference_losses, loss_rtol=1e-5,
                      compare_params=True) -> None:
    """`params`/`reference`: the two runs' trained parameters, in `model.named_parameters()`
    order (`model`: the untrained start)."""
    for a, b in zip(losses, reference_losses):
        assert abs(a - b) / abs(b) < loss_rtol, (losses, reference_losses)
    for (name, start), p, q in zip(model.named_parameters(), params, reference):
        if compare_params:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        assert (p - start.detach()).abs().max() > 1e-3, name  # it trained


def assert_gpu_and_host_updates_agree(model, params, reference, losses, reference_losses) -> None:
    """Like `assert_runs_agree`, for a run whose AdamW ran on the GPU (updates="device" or
    "resident") against one whose AdamW ran on the host.

    Step 1 sees the same gradients on both sides, so its parameters differ by the few ulp
    of the two kernels (test_device_update_cuda.py). From step 2 each side's gradients also
    differ, by ~1e-7 relative to the terms they are summed from; AdamW's step
    lr * m / (sqrt(v) + eps) is most sensitive to that where |g| ~ eps, by lr / (4 eps) per
    unit of g. An element whose gradient cancels to ~eps from terms of ~1e-2 can then move
    by a few percent of lr: on the H200 one embedding element of 131072 differed by 5.9e-5
    (lr / 50), the same element in two runs; on an H100 with max_grad_norm, 3 of them by up
    to 3.0e-5. Hence: every element within lr / 10 (3e-4), and all but 1e-4 of them within
    rtol=1e-5, atol=1e-5 (= lr / 300). A missed, stale or doubled update, or a gradient
    clipped on one side only, moves most parameters by well over lr / 300."""
    for a, b in zip(losses, reference_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, reference_losses)
    for (name, start), p, q in zip(model.named_parameters(), params, reference):
        torch.testing.assert_close(p, q, rtol=0, atol=3e-4, msg=lambda m, name=name: f"{name}: {m}")
        outside = ((p - q).abs() > 1e-5 + 1e-5 * q.abs()).float().mean().item()
        assert outside <= 1e-4, f"{name}: {outside:.2e} of the elements beyond rtol=atol=1e-5"
        assert (p - start.detach()).abs().max() > 1e-3, name  # it trained
