"""RMSNorm as a Triton kernel pair, registered as `megatrain::rms_norm`.

Numerics follow HF LlamaRMSNorm: statistics in fp32, the normalised row is cast back to
the input dtype *before* the multiply by weight, and the output has the input dtype. The
forward saves 1/rms per row (fp32) so the backward does not recompute the reduction. The
backward reduces dweight over the rows each program owns (fp32, in registers) and a small
torch sum over the per-program partials finishes it; no atomics, so it is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatrain.kernels._common import (
    check_float,
    check_same_device,
    launch_context,
    num_warps_for,
    row_block,
)

MAX_HIDDEN = 65536  # one row lives in registers; beyond this a looped kernel is needed


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    # HF rounds the normalised row to the input dtype before scaling by weight.
    normed = (x * rstd).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * n_cols + cols, (w * normed).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    base = row_start.to(tl.int64) * n_cols
    X += base
    DY += base
    DX += base
    RSTD += row_start
    for _ in range(row_start, row_end):
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD)
        normed = x * rstd
        dyw = dy * w
        dx = rstd * (dyw - normed * (tl.sum(dyw * normed, axis=0) / n_cols))
        tl.store(DX + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * normed.to(X.dtype.element_ty).to(tl.float32)
        X += n_cols
        DY += n_cols
        DX += n_cols
        RSTD += 1
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


def _num_programs(device: torch.device, n_rows: int) -> int:
    if device.type == "cuda":
        return min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n_rows, 4)  # interpreter: few programs, still several partials to reduce


def _rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float):
    x, weight = x.contiguous(), weight.contiguous()
    n_cols = x.shape[-1]
    x2 = x.view(-1, n_cols)
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0] > 0:
        block = row_block(n_cols)
        with launch_context(_rms_norm_fwd_kernel, x.device):
            _rms_norm_fwd_kernel[(x2.shape[0],)](
                x2, weight, y, rstd, n_cols, eps, BLOCK=block, num_warps=num_warps_for(block)
            )
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _rms_norm_bwd(dy, x, weight, rstd):
    dy, x, weight, rstd = dy.contiguous(), x.contiguous(), weight.contiguous(), rstd.contiguous()
    n_cols = x.shape[-1]
    x2 = x.view(-1, n_cols)
    n_rows = x2.shape[0]
    dx = torch.empty_like(x2)
    if n_rows == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    programs = _num_programs(x.device, n_rows)
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    block = row_block(n_cols)
    with launch_context(_rms_norm_bwd_kernel, x.device):
        _rms_norm_bwd_kernel[(programs,)](
            dy.view(-1, n_cols), x2, weight, rstd, dx, partial,
            n_rows, n_cols, rows_per_program, BLOCK=block, num_warps=num_warps_for(block),
        )
    return dx.view(x.shape), partial.sum(0).to(weight.dtype)


@torch.library.custom_op("megatrain::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, rstd); rstd is fp32 1/rms per row, kept for the backward."""
    return _rms_norm_fwd(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("megatrain::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm_bwd(dy, x, weight, rstd)


@rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def _validate(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_float("x", x)
    check_float("weight", weight)
    check_same_device(x=x, weight=weight)
    if x.dim() < 1 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm needs x [..., H] and weight [H]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if not 0 < weight.shape[0] <= MAX_HIDDEN:
        raise ValueError(f"rms_norm hidden size {weight.shape[0]} must be in 1..{MAX_HIDDEN}")
    if not eps >= 0:
        raise ValueError(f"rms_norm eps={eps} must be >= 0")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF-style RMSNorm over the last dim; output in x.dtype, math in fp32."""
    _validate(x, weight, eps)
    return rms_norm_op(x.contiguous(), weight.contiguous(), float(eps))[0]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF LlamaRMSNorm in plain torch (fp32 statistics, cast back, then weight)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(x.dtype)
