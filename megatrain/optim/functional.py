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

import threading

import torch
from torch import Tensor


# Elements of low-precision gradient upcast per fused call: 16 MiB of fp32 scratch, reused,
# so the upcast values are still in cache when the update reads them. A multiple of 64:
# the CPU kernel vectorises in cache-line units and finishes a tensor's odd tail with
# scalar code, so pieces cut at 64-element boundaries round exactly like the whole tensor.
UPCAST_CHUNK = 1 << 22
# Where a parameter may be cut into separately updated pieces (elements from its start),
# for the same reason.
PIECE_ALIGN = 64
# Largest 16-bit gradient (elements) whose norm upcasts into a reused per-thread fp32
# scratch rather than a fresh tensor (grad_norm): 512 MiB, above one layer's matrix of
# the models this trains; an embedding larger still gets a fresh one.
NORM_SCRATCH_MAX = 1 << 27
_scratch = threading.local()


def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    shadows: list[Tensor | None] | None = None,
    scale: Tensor | None = None,
    **hyper: float,
) -> None:
    """One AdamW step in place (hyper: lr, beta1, beta2, weight_decay, eps). Every grad
    must share its param's strides: the CPU fused kernel walks raw memory and would
    silently mix elements otherwise.

    A gradient in a lower precision than its parameter (bf16 handed in for fp32) is
    upcast chunk by chunk into a reused fp32 scratch right before the fused kernel reads
    it. Upcasting is exact, and AdamW is elementwise, so the result is bitwise that of
    ``adamw_`` on ``grad.float()``; but the host never writes and re-reads a full fp32
    gradient (4 + 4 bytes per parameter of memory traffic, and fresh pages to fault in).

    ``shadows``: per parameter None or a contiguous lower-precision tensor of its shape
    (the streamer's bf16 weight shadow) that receives the updated values, cast chunk by
    chunk right after each chunk's update. Meant to find the chunk still in cache; on the
    CPUs tried it ran slightly slower than a separate cast pass after the update.

    ``scale``: a 0-dim factor in the parameters' dtype (the clip coefficient) for the
    gradients in a lower precision, multiplied in after their upcast: the bits of
    ``grad.float().mul_(scale)``. Gradients in their parameter's dtype are the caller's to
    scale (in place, as ``clip_grad_norm_`` does)."""
    if not params:
        return
    torch._foreach_add_(steps, 1)
    adamw_at_step_(params, grads, exp_avgs, exp_avg_sqs, steps, shadows, scale, **hyper)


def adamw_at_step_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    shadows: list[Tensor | None] | None = None,
    scale: Tensor | None = None,
    **hyper: float,
) -> None:
    """``adamw_`` with the step counts already advanced: what pieces of one parameter
    updated in several calls use (its count moves once, before the first piece). Pieces
    must start at multiples of PIECE_ALIGN elements to round like the whole tensor."""
    if not params:
        return
    shadows = shadows or [None] * len(params)
    whole = [i for i, (p, g, sh) in enumerate(zip(params, grads, shadows)) if g.dtype == p.dtype and sh is None]
    if len(whole) == len(params):
        _fused(params, grads, exp_avgs, exp_avg_sqs, steps, hyper)
        return
    pick = lambda ts, idx: [ts[i] for i in idx]  # noqa: E731
    if whole:
        _fused(*(pick(ts, whole) for ts in (params, grads, exp_avgs, exp_avg_sqs, steps)), hyper)
    rest = sorted(set(range(len(params))) - set(whole))
    _adamw_chunked(*(pick(ts, rest) for ts in (params, grads, exp_avgs, exp_avg_sqs, steps, shadows)), hyper,
                   scale)


def _fused(params, grads, exp_avgs, exp_avg_sqs, steps, hyper) -> None:
    torch._fused_adamw_(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        amsgrad=False, maximize=False, **hyper,
    )


def _adamw_chunked(params, grads, exp_avgs, exp_avg_sqs, steps, shadows, hyper, scale=None) -> None:
    """Fused AdamW over batches of at most UPCAST_CHUNK elements: gradients in a lower
    precision are first copied (upcast) into the scratch (and multiplied by ``scale``
    there, if given), and each piece's shadow, if it
    has one, gets the piece's new values right after the batch's update. Steps were
    already incremented: each chunk of a parameter passes that parameter's step tensor."""
    chunk = UPCAST_CHUNK
    scratch = None
    if any(g.dtype != p.dtype for p, g in zip(params, grads)):
        scratch = getattr(_scratch, "buf", None)
        if scratch is None or scratch.numel() < chunk or scratch.dtype != params[0].dtype:
            scratch = _scratch.buf = torch.empty(chunk, dtype=params[0].dtype)
    batch: tuple[list, ...] = ([], [], [], [], [], [])
    used = 0

    def flush() -> None:
        nonlocal used
        ps, given, ms, vs, ss, shs = batch
        gs, off = [], 0
        for p, g in zip(ps, given):
            if g.dtype != p.dtype:
                g = scratch[off:off + g.numel()].copy_(g)
                off += g.numel()
                if scale is not None:
                    g.mul_(scale)
            gs.append(g)
        _fused(ps, gs, ms, vs, ss, hyper)
        for p, sh in zip(ps, shs):
            if sh is not None:
                sh.copy_(p)
        for part in batch:
            part.clear()
        used = 0

    for p, g, m, v, s, sh in zip(params, grads, exp_avgs, exp_avg_sqs, steps, shadows):
        if not all(t.is_contiguous() for t in (p, g, m, v)):
            if g.dtype != p.dtype:
                g = g.to(p.dtype)
                if scale is not None:
                    g.mul_(scale)
            _fused([p], [g], [m], [v], [s], hyper)
            if sh is not None:
                sh.copy_(p)
            continue
        if sh is not None and not (sh.is_contiguous() and sh.shape == p.shape):
            raise ValueError(f"a shadow must be contiguous and shaped like its parameter: "
                             f"{tuple(sh.shape)} (contiguous: {sh.is_contiguous()}) for {tuple(p.shape)}")
        flat = [t.view(-1) for t in (p, g, m, v)]
        for start in range(0, p.numel(), chunk):
            k = min(chunk, p.numel() - start)
            if used + k > chunk:
                flush()
            for part, t in zip(batch, flat):
                part.append(t[start:start + k])
            batch[4].append(s)
            batch[5].append(None if sh is None else sh.view(-1)[start:start + k])
            used += k
    if used:
        flush()


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
    """The per-tensor 2-norm exactly as clip_grad_norm_(foreach=False) computes it. A
    16-bit gradient (held for an fp32 parameter, optim/narrow_grads.py) is upcast first, to
    a temporary: the very op on the very fp32 values an fp32 buffer would hold, whatever
    the reduction would do with a 16-bit input."""
    if grad.dtype in (torch.bfloat16, torch.float16):
        grad = _upcast_for_norm(grad)
    return torch.linalg.vector_norm(grad, 2.0)


def _upcast_for_norm(grad: Tensor) -> Tensor:
    """``grad.float()``'s values and layout, in a per-thread fp32 scratch reused across
    calls for a contiguous host gradient up to NORM_SCRATCH_MAX elements. Why: a fresh
    temporary of 4 bytes per parameter is new pages for the kernel to fault in at every
    step, which made the norm 2.5x slower than the copy and the reduction it holds (two
    CPU threads, 32 M parameters); the scratch's values are the same, so the norm is
    bitwise the same. Device gradients take the caching allocator's ``float()``."""
    n = grad.numel()
    if grad.device.type != "cpu" or not grad.is_contiguous() or n > NORM_SCRATCH_MAX:
        return grad.float()
    buf = getattr(_scratch, "norm_buf", None)
    if buf is None or buf.numel() < n:
        buf = _scratch.norm_buf = torch.empty(n, dtype=torch.float32)
    return buf[:n].view(grad.shape).copy_(grad)


def to_host(tensors: list[Tensor]) -> list[Tensor]:
    """``[t.cpu() for t in tensors]`` for same-shaped tensors (the per-tensor norms),
    with one copy, and so one wait, per device instead of one per tensor: stacking and
    copying move values, so the results are the same bits."""
    out: list[Tensor | None] = list(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for k, t in enumerate(tensors):
        if t.device.type != "cpu":
            by_device.setdefault(t.device, []).append(k)
    for ks in by_device.values():
        for k, t in zip(ks, torch.stack([tensors[k] for k in ks]).cpu().unbind()):
            out[k] = t
    return out  # type: ignore[return-value]


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
