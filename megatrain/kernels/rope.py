"""Rotary position embedding (HF rotate_half convention), registered as `megatrain::rope`.

out = x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1), applied to q and
k in one launch: each program owns one (batch, position) and loops over the q heads then
the k heads, so cos/sin are read once per token. q [B, Hq, S, D] and k [B, Hk, S, D] may
have different head counts (GQA); cos/sin are [B or 1, S, D]. Any even D works: the two
halves are padded to a power-of-two block and masked. Math is fp32, outputs in q/k dtype.

cos/sin are treated as constants (they come from a non-trainable inv_freq buffer); the
wrapper refuses ones that require grad rather than silently dropping their gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatrain.kernels._common import check_float, check_same_device, launch_context


@triton.jit
def _rope_heads(X, Y, C1, C2, S1, S2, n_heads, half, heads_stride,
                BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate n_heads rows of one token; X/Y point at head 0 of that token."""
    d = tl.arange(0, BLOCK_D)[None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (h < n_heads) & (d < half)
        off = h.to(tl.int64) * heads_stride + d
        x1 = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + off + half, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:  # transpose of the forward rotation
            y1 = x1 * C1 + x2 * S2
            y2 = x2 * C2 - x1 * S1
        else:
            y1 = x1 * C1 - x2 * S1
            y2 = x2 * C2 + x1 * S2
        tl.store(Y + off, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + off + half, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, n_q_heads, n_k_heads, seq_len, half, cos_batch_stride,
                 BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    b = token // seq_len
    s = token % seq_len
    head_dim = 2 * half
    heads_stride = seq_len * head_dim
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < half
    cs = b.to(tl.int64) * cos_batch_stride + s * head_dim + d
    c1 = tl.load(COS + cs, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs + half, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs + half, mask=dmask, other=0.0).to(tl.float32)
    q_base = b.to(tl.int64) * n_q_heads * heads_stride + s * head_dim
    k_base = b.to(tl.int64) * n_k_heads * heads_stride + s * head_dim
    _rope_heads(Q + q_base, QO + q_base, c1, c2, s1, s2, n_q_heads, half, heads_stride,
                BACKWARD, BLOCK_H, BLOCK_D)
    _rope_heads(K + k_base, KO + k_base, c1, c2, s1, s2, n_k_heads, half, heads_stride,
                BACKWARD, BLOCK_H, BLOCK_D)


def _launch(q, k, cos, sin, backward: bool):
    q, k, cos, sin = q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous()
    batch, n_q, seq, dim = q.shape
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0 and k.numel() == 0:
        return qo, ko
    block_d = max(triton.next_power_of_2(dim // 2), 16)
    block_h = max(1, min(triton.next_power_of_2(max(n_q, k.shape[1])), 4096 // block_d, 16))
    cos_batch_stride = 0 if cos.shape[0] == 1 else seq * dim
    with launch_context(_rope_kernel, q.device):
        _rope_kernel[(batch * seq,)](
            q, k, qo, ko, cos, sin, n_q, k.shape[1], seq, dim // 2, cos_batch_stride,
            BACKWARD=backward, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
        )
    return qo, ko


@torch.library.custom_op("megatrain::rope", mutates_args=())
def rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, cos, sin, backward=False)


@rope_op.register_fake
def _(q, k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("megatrain::rope_backward", mutates_args=())
def rope_backward_op(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(dq, dk, cos, sin, backward=True)


@rope_backward_op.register_fake
def _(dq, dk, cos, sin):
    return dq.new_empty(dq.shape), dk.new_empty(dk.shape)


def _setup_context(ctx, inputs, output):
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq, dk = rope_backward_op(dq, dk, cos, sin)
    return dq, dk, None, None


rope_op.register_autograd(_backward, setup_context=_setup_context)


def _validate(q, k, cos, sin) -> None:
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
    check_same_device(q=q, k=k, cos=cos, sin=sin)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [batch, heads, seq, head_dim]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    batch, _, seq, dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq, dim):
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, seq "
                         "and head_dim")
    if k.dtype != q.dtype:
        raise ValueError(f"q dtype {q.dtype} and k dtype {k.dtype} must match")
    if dim % 2:
        raise ValueError(f"head_dim={dim} must be even for rotate_half")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, batch) \
            or cos.shape[1:] != (seq, dim):
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be "
                         f"[1 or {batch}, {seq}, {dim}]")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("cos/sin require grad, but apply_rotary treats them as constants; "
                         "detach them (they normally come from a non-trainable buffer)")


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, Hq, S, D] and k [B, Hk, S, D] by cos/sin [B or 1, S, D] (HF convention).

    A 2-D cos/sin [S, D] is accepted as [1, S, D].
    """
    if cos.dim() == 2 and sin.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    _validate(q, k, cos, sin)
    return rope_op(q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF apply_rotary_pos_emb in plain torch, computed in fp32 and cast back once.

    (HF itself computes in the input dtype; fp32 with one rounding is the exact answer the
    kernel aims for.)
    """
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    qf, kf = q.float(), k.float()
    return ((qf * c + _rotate_half(qf) * s).to(q.dtype),
            (kf * c + _rotate_half(kf) * s).to(k.dtype))
