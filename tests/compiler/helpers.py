"""Shared helpers: train a model eagerly and through megatrain side by side."""

from __future__ import annotations

import copy

import torch

import megatrain


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def train_side_by_side(model, batches, options, steps=3, lr=1e-3, device="cpu"):
    """Train `model` eagerly (on `device`) and a copy through megatrain; return both histories."""
    ref = copy.deepcopy(model).to(device)
    streamed = copy.deepcopy(model)
    step = torch.compile(streamed, backend="megatrain", options=options)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1)
    opt = torch.optim.AdamW(streamed.parameters(), lr=lr, weight_decay=0.1)
    out = {"loss_ref": [], "loss": [], "grads_ref": None, "grads": None}
    for i, (ids, labels) in enumerate(batches[:steps]):
        loss_ref = ref(ids.to(device), labels=labels.to(device))
        loss_ref.backward()
        loss = step(ids, labels=labels)
        assert loss.device.type == "cpu", "the loss must come back on the CPU"
        loss.backward()
        if i == 0:
            out["grads_ref"] = flat(p.grad for p in ref.parameters()).cpu()
            out["grads"] = flat(p.grad for p in streamed.parameters())
            for p in streamed.parameters():
                assert p.grad.device.type == "cpu" and p.grad.dtype == torch.float32
        out["loss_ref"].append(loss_ref.item())
        out["loss"].append(loss.item())
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    out["params_ref"] = flat(ref.parameters()).cpu()
    out["params"] = flat(streamed.parameters())
    out["plan"] = megatrain.explain(step)
    out["step"] = step
    return out


def random_batches(vocab: int, n: int, batch: int, seq: int, generator=None):
    return [(torch.randint(0, vocab, (batch, seq), generator=generator),
             torch.randint(0, vocab, (batch, seq), generator=generator)) for _ in range(n)]
