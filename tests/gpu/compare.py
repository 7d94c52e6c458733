"""Two CUDA training runs of the same model that must agree: how the runtime options' GPU
tests run them and check them (backlog, gradient ring, device updates, kept weights against
their plain run).

Tolerance: both runs do the same math, but CUDA reductions with atomics are not
deterministic run to run (~1e-7 relative from step 2), which AdamW amplifies where
|g| ~ eps: rtol=atol=1e-5 on fp32 parameters. A lost, doubled or stale gradient or weight
moves parameters by ~lr = 3e-3. Each parameter must also have moved (it trained)."""

from __future__ import annotations

import torch

from ..compiler.helpers import train_megatrain


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
