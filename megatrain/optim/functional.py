"""AdamW and gradient-clipping arithmetic, chosen to match torch bit for bit.

- Update: ``torch._fused_adamw_``, the kernel behind ``torch.optim.AdamW(fused=True)``. On
  the CPU it is one pass over param, grad, m and v (the minimum traffic for this math),
  parallel over elements inside ATen and free of the GIL. Results are bitwise those of
  ``AdamW(fused=True)``; against the default (single-tensor) ``AdamW`` they differ only by
  rounding order, about 1 ulp per step.
- Clipping: the exact op sequence of ``torch.nn.utils.clip_grad_norm_(foreach=False)``:
  per-tensor 2-norms, the 2-norm of their stack, ``max_norm / (total + 1e-6)`` clamped to
  1.0, and ``grad.mul_(coef)``. Skipping the multiply when the coefficient is exactly 1.0
  changes no bit and saves a read and a write of every gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
) -> None:
    """One AdamW step in place. Every grad must share its param's strides: the CPU fused
    kernel walks raw memory and would silently mix elements otherwise."""
    if not params:
        return
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


def same_layout(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` and ``b`` store the same element at the same memory offset."""
    return a.shape == b.shape and (
        a.stride() == b.stride() or (a.is_contiguous() and b.is_contiguous())
    )


def like_param(grad: Tensor, param: Tensor) -> Tensor:
    """``grad`` laid out like ``param`` (a copy only when the strides differ)."""
    if same_layout(grad, param):
        return grad
    return torch.empty_like(param).copy_(grad)


def grad_norm(grad: Tensor) -> Tensor:
    """The per-tensor 2-norm exactly as clip_grad_norm_(foreach=False) computes it."""
    return torch.linalg.vector_norm(grad, 2.0)


def total_norm(norms: list[Tensor]) -> Tensor:
    """The global 2-norm from per-tensor norms, in the order given (order matters for bits)."""
    if not norms:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_coefficient(total: Tensor, max_norm: float) -> Tensor:
    """``min(max_norm / (total + 1e-6), 1)`` with torch's rounding (a 0-dim tensor)."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)


def is_finite(grad: Tensor, norm: Tensor) -> bool:
    """Whether every element of ``grad`` is finite. A finite 2-norm proves it; a non-finite
    one may be overflow of finite values, so only then look at the elements."""
    if bool(torch.isfinite(norm)):
        return True
    return bool(torch.isfinite(grad).all())
