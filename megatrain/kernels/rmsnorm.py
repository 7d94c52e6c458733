"""RMSNorm as a Triton kernel pair, registered as `megatrain::rms_norm`.

Numerics follow HF LlamaRMSNorm: statistics in fp32, the normalised row is cast back to
the input dtype *before* the multiply by weight, and the output has the input dtype. The
forward saves 1/rms per row (fp32) so the backward does not recompute the reduction.

Backward, two launches and no atomics (deterministic):
1. `_rms_norm_bwd_kernel`: two programs per SM each walk their own contiguous span of rows
   in tiles of BLOCK_M rows x the whole hidden size (BLOCK_M = 1 at H=4096, more for small
   H so a tile stays ~4k elements). Per tile it loads x and dy once (bf16 in, fp32 in
   registers), writes dx, and adds dy * normed into a [BLOCK_M, H] fp32 accumulator that
   stays in registers; at the end the program writes one fp32 row of dweight partials.
2. `_sum_partials_kernel`: sums the [programs, H] partials over programs in fp32 and
   writes dweight in the weight's dtype; ~128 column blocks, so it is one short wave.
The pair runs near the copy bandwidth over the 3 x T x H x 2 B it must move, faster than
4 programs/SM with torch's sum + cast for pass 2, and than Inductor's backward for the
pattern. Two programs per SM is the balance: more programs mean more partials to sum,
fewer leave bandwidth idle (bench/bench_kernels.py times the kernels).
"""

from __future__ import annotations

import functools

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
TILE_ELEMENTS = 4096  # elements of one backward tile (BLOCK_M rows x BLOCK columns)
PROGRAMS_PER_SM = 2  # backward programs per SM: one dweight partial row each


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
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program,
                         BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """dx for rows [pid * rows_per_program, +rows_per_program), and their dweight sum.

    rows_per_program is a multiple of BLOCK_M, so tiles never straddle two programs.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_M, BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        off = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + off, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        normed = x * rstd[:, None]
        dyw = dy * w[None, :]
        mean_dot = tl.sum(dyw * normed, axis=1) / n_cols
        dx = rstd[:, None] * (dyw - normed * mean_dot[:, None])
        tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=mask)
        # The forward multiplied weight by the *rounded* normalised row.
        dw += dy * normed.to(X.dtype.element_ty).to(tl.float32)
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, tl.sum(dw, axis=0), mask=cmask)


@triton.jit
def _sum_partials_kernel(P, OUT, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[c] = sum_p P[p, c] in fp32, stored in OUT's dtype; one program per column block."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        mask = (parts < n_parts)[:, None] & cmask[None, :]
        acc += tl.load(P + parts.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask,
                       other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cmask)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_programs(device: torch.device, n_rows: int) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return min(n_rows, PROGRAMS_PER_SM * _sm_count(index))
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


def _rms_norm_bwd(dy, x, weight, rstd, block_m: int | None = None,
                  programs: int | None = None):
    """(dx, dweight); block_m / programs override the heuristics (benchmark sweeps)."""
    dy, x, weight, rstd = dy.contiguous(), x.contiguous(), weight.contiguous(), rstd.contiguous()
    n_cols = x.shape[-1]
    x2 = x.view(-1, n_cols)
    n_rows = x2.shape[0]
    dx = torch.empty_like(x2)
    if n_rows == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    block = row_block(n_cols)
    if block_m is None:  # the interpreter gets small tiles so tests see several per program
        block_m = max(1, min(TILE_ELEMENTS // block, 16)) if x.is_cuda else 2
    block_m = min(block_m, triton.next_power_of_2(n_rows))
    programs = min(programs or _num_programs(x.device, n_rows), n_rows)
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, programs), block_m) * block_m
    programs = triton.cdiv(n_rows, rows_per_program)
    partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    dw = torch.empty_like(weight)
    # Pass 2 is latency-bound (a few MiB): enough column blocks for ~one program per SM.
    block_n = max(16, min(block, triton.next_power_of_2(triton.cdiv(n_cols, 128))))
    block_p = max(1, min(triton.next_power_of_2(programs), 4096 // block_n))
    with launch_context(_rms_norm_bwd_kernel, x.device):
        _rms_norm_bwd_kernel[(programs,)](
            dy.view(-1, n_cols), x2, weight, rstd, dx, partial, n_rows, n_cols,
            rows_per_program, BLOCK_M=block_m, BLOCK=block,
            num_warps=num_warps_for(block_m * block),
        )
        _sum_partials_kernel[(triton.cdiv(n_cols, block_n),)](
            partial, dw, programs, n_cols, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4,
        )
    return dx.view(x.shape), dw


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
