"""SwiGLU gate, silu(gate) * up, registered as `megatrain::swiglu`.

One elementwise pass in fp32 with a single rounding to the input dtype (eager HF rounds
silu(gate) to bf16 before the multiply; one rounding is the more exact of the two). The
backward recomputes sigmoid(gate) instead of saving it: memory traffic, not FLOPs, bounds
this op, and saving the activation would cost a write and a read of a full tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatrain.kernels._common import check_float, check_same_device, launch_context

BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = g * sig
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)
    dg = dy * u * (sig + silu * (1.0 - sig))
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


@torch.library.custom_op("megatrain::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    if gate.numel():
        with launch_context(_swiglu_fwd_kernel, gate.device):
            _swiglu_fwd_kernel[_grid(gate.numel())](gate, up, y, gate.numel(), BLOCK=BLOCK)
    return y


@swiglu_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("megatrain::swiglu_backward", mutates_args=())
def swiglu_backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    dy, gate, up = dy.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel():
        with launch_context(_swiglu_bwd_kernel, gate.device):
            _swiglu_bwd_kernel[_grid(gate.numel())](dy, gate, up, dg, du, gate.numel(), BLOCK=BLOCK)
    return dg, du


@swiglu_backward_op.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return swiglu_backward_op(dy, gate, up)


swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for same-shape, same-dtype tensors (no broadcasting)."""
    check_float("gate", gate)
    check_float("up", up)
    check_same_device(gate=gate, up=up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu needs gate and up of one shape and dtype; got gate "
                         f"{tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}")
    return swiglu_op(gate.contiguous(), up.contiguous())


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, cast back to the input dtype once."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
