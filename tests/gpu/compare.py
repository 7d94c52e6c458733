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
