"""Rotary position embedding (HF rotate_half convention), registered as `megatrain::rope`.

out = x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1), applied to q and
k in one launch. q [B, Hq, S, D] and k [B, Hk, S, D] may have different head counts
(GQA); cos/sin are [B or 1, S, D]. Each program takes BLOCK_S consecutive positions of one
(batch, head) row, a contiguous [BLOCK_S, D] tile of q or k (the first B * Hq rows of the
grid are q's, the rest k's), and the matching tile of cos/sin, which the other heads of
the batch re-read from L2. Contiguous tiles put the kernel near the copy bandwidth, ahead
of one program per token looping over its heads (strided 256-byte rows). The backward
is the same kernel rotating by -theta. Any even D works: the two halves are padded to a
power-of-two block and masked. Math is fp32, outputs in q/k dtype.

cos/sin are treated as constants (they come from a non-trainable inv_freq buffer); the
wrapper refuses ones that require grad rather than silently dropping their gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatrain.kernels._common import check_float, check_same_device, launch_context


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, n_q_rows, n_q_heads, n_k_heads, seq_len, half,
                 cos_batch_stride, BACKWARD: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """One program rotates BLOCK_S consecutive positions of one (batch, head) row of q or k."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(seq_len, BLOCK_S)
    row = pid // n_blocks  # q's B * Hq rows first, then k's
    s0 = (pid % n_blocks) * BLOCK_S
    if row < n_q_rows:
        X = Q
        Y = QO
        b = row // n_q_heads
    else:
        row = row - n_q_rows
        X = K
        Y = KO
        b = row // n_k_heads
    head_dim = 2 * half
    s = s0 + tl.arange(0, BLOCK_S)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (s < seq_len) & (d < half)
    cs = b.to(tl.int64) * cos_batch_stride + s * head_dim + d
    c1 = tl.load(COS + cs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # The gradient is the transposed rotation, i.e. the rotation by -theta: the forward
        # with sin negated. Its halves also swap places, which keeps the transpose exact for
        # any table; HF's tables are cat(f, f), where the swap changes nothing.
        s1, s2 = -s2, -s1
    off = row.to(tl.int64) * seq_len * head_dim + s * head_dim + d
    x1 = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + off + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + off, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + off + half, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=mask)


def _launch(q, k, cos, sin, backward: bool, block_s: int | None = None, num_warps: int = 4):
    """(q', k') = rotation of q and k by +theta (forward) or -theta (backward), one launch."""
    q, k, cos, sin = q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous()
    batch, n_q, seq, dim = q.shape
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0 and k.numel() == 0:
        return qo, ko
    block_d = max(triton.next_power_of_2(dim // 2), 16)
    block_s = block_s or max(1, min(triton.next_power_of_2(seq), 1024 // block_d))
    cos_batch_stride = 0 if cos.shape[0] == 1 else seq * dim
    grid = (batch * (n_q + k.shape[1]) * triton.cdiv(seq, block_s),)
    with launch_context(_rope_kernel, q.device):
        _rope_kernel[grid](
            q, k, qo, ko, cos, sin, batch * n_q, n_q, k.shape[1], seq, dim // 2,
            cos_batch_stride, BACKWARD=backward, BLOCK_S=block_s, BLOCK_D=block_d,
            num_warps=num_warps,
        )
    return qo, ko


@torch.library.custom_op("megatrain::rope", mutates_args=())
def rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, cos, sin, backward=False)


@torch.library.custom_op("megatrain::rope_backward", mutates_args=())
def rope_backward_op(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(dq, dk, cos, sin, backward=True)


def _fake(q, k, cos, sin):
    """Forward and backward both map (q-like, k-like) to new tensors of the same shapes."""
    return q.new_empty(q.shape), k.new_empty(k.shape)


rope_op.register_fake(_fake)
rope_backward_op.register_fake(_fake)


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
