"""Linear layer + cross entropy without the [N, V] logits, `megatrain::fused_linear_cross_entropy`.

The lm_head's logits are the largest activation of a language model (16k tokens x 128k
vocab x fp32 = 8 GiB). Liger-style, the forward walks the tokens in chunks: per chunk,
cuBLAS computes the logits in the input dtype (as HF's lm_head does), one Triton program
per row finds the log-sum-exp in fp32 with an online max, writes the row's loss, and
overwrites the logits in place with d loss / d logits = (softmax - onehot) * scale. Two
more matmuls turn that into this chunk's rows of grad_hidden (written straight into its
slice of the preallocated [N, H] gradient) and its contribution to grad_weight, which
cuBLAS adds into the preallocated [V, H] gradient in the same call (addmm_, beta=1: no
per-chunk [V, H] product, no list of partial gradients). The backward only scales the
stored gradients by grad_output, in place, so nothing is recomputed and no logits are kept.

Memory (the point of the op): besides the inputs, the gradients themselves and one chunk
of logits, nothing of size V x H or N x V exists. At N=8192, V=128256, H=4096 in bf16 that
is grad_weight 1.0 GiB + logits chunk 0.5 GiB + grad_hidden 64 MiB, against eager's ~11.7
GiB of logits, fp32 logits, log-softmax and their gradients. A full fp32 grad_weight
accumulator would not fit this budget: 2 GiB, and 1 GiB more for the cast at the end, so
for bf16/fp16 weights the running sum lives in the weight's dtype. Each chunk's product is
still summed in fp32 inside the GEMM and added to the running sum before one rounding, so
the gradient is rounded once per chunk (N / chunk times, 4 at the default size for 8k
tokens) instead of once; fp32 weights accumulate in fp32.

Reduction "mean" divides by the number of non-ignored tokens, like
F.cross_entropy(reduction="mean"). One deliberate difference: when every label is
ignored, torch returns NaN (0/0); we return loss 0 and zero gradients, so a fully padded
micro-batch does not poison the step. Labels outside [0, V) that are not ignore_index are
an error (ValueError on CPU, a device-side assert on CUDA, which avoids a host sync).
The backward scales the stored gradients in place, so it runs once per forward: a second
backward through the same graph (retain_graph=True) is an error, not a wrong answer.
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
)

LOGITS_CHUNK_BYTES = 512 * 2**20  # default budget for one chunk of logits


@triton.jit
def _tanh(y):
    """tanh in fp32 from exp alone (libdevice's does not run under TRITON_INTERPRET): the
    odd Taylor series up to y^7 where |y| < 0.1 (error < 3e-11 there, where the exp form
    would lose digits to cancellation), (1 - e^-2|y|) / (1 + e^-2|y|) with the sign beyond."""
    a = tl.abs(y)
    e = tl.exp(-2.0 * a)
    y2 = y * y
    small = a * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0))))
    t = tl.where(a < 0.1, small, (1.0 - e) / (1.0 + e))
    return tl.where(y < 0.0, -t, t)


@triton.jit
def _ce_loss_grad_kernel(LOGITS, LABELS, LOSS, SCALE, n_vocab, ignore_index, softcap,
                         WRITE_GRAD: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row: loss = lse - logit[label]; logits <- (softmax - onehot) * scale, in place.
    With SOFTCAP each logit z is first capped, softcap * tanh(z / softcap) (Gemma 2's final
    logits), and its gradient carries the cap's derivative, 1 - tanh^2."""
    row = tl.program_id(0).to(tl.int64)
    LOGITS += row * n_vocab
    label = tl.load(LABELS + row).to(tl.int64)
    valid = label != ignore_index
    m = float("-inf")
    d = 0.0
    for v0 in range(0, n_vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < n_vocab
        x = tl.load(LOGITS + cols, mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = softcap * _tanh(x / softcap)
        x = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    target = tl.load(LOGITS + label, mask=valid, other=0.0).to(tl.float32)
    if SOFTCAP:
        target = softcap * _tanh(target / softcap)
    tl.store(LOSS + row, tl.where(valid, lse - target, 0.0))
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(SCALE), 0.0)
        for v0 in range(0, n_vocab, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = cols < n_vocab
            x = tl.load(LOGITS + cols, mask=mask, other=0.0).to(tl.float32)
            if SOFTCAP:
                t = _tanh(x / softcap)
                p = tl.exp(softcap * t - lse)
                g = tl.where(cols == label, p - 1.0, p) * scale * (1.0 - t * t)
            else:
                p = tl.exp(x - lse)
                g = tl.where(cols == label, p - 1.0, p) * scale
            tl.store(LOGITS + cols, g.to(LOGITS.dtype.element_ty), mask=mask)


def default_chunk_size(n_tokens: int, vocab: int, element_size: int) -> int:
    """Tokens per chunk: a power of two whose logits fit LOGITS_CHUNK_BYTES.

    Bigger chunks make fewer, larger GEMMs and fewer read-modify-writes of grad_weight
    (one per chunk, in the GEMM's epilogue); smaller ones bound the scratch logits and so
    the peak. 512 MiB gives 2048 tokens at V=128256 in bf16: 1/4 of the logits at 8k tokens,
    1/8 at 16k. Chunks larger than that gain little time (the GEMMs are already large) but
    bring the peak close to the 4x-below-eager bound; 2048 keeps a margin
    (bench/bench_kernels.py times the op).
    """
    fit = max(1, LOGITS_CHUNK_BYTES // max(1, vocab * element_size))
    chunk = 1 << (fit.bit_length() - 1)
    return max(1, min(chunk, triton.next_power_of_2(max(n_tokens, 1))))


def _check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    bad = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
    if labels.device.type == "cpu":
        if bool(bad.any()):
            raise ValueError(f"label {int(labels[bad][0])} is outside [0, {vocab}) and is not "
                             f"ignore_index={ignore_index}")
    else:
        torch._assert_async(~bad.any(), "fused_linear_cross_entropy: label outside [0, vocab)")


def _forward(hidden, weight, labels, ignore_index, reduction, chunk_size, need_gh, need_gw, softcap=0.0):
    hidden, weight, labels = hidden.contiguous(), weight.contiguous(), labels.contiguous()
    n_tokens, _ = hidden.shape
    vocab = weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    _check_labels(labels, vocab, ignore_index)
    if reduction == "mean":
        n_valid = (labels != ignore_index).sum().clamp(min=1)
        scale = (1.0 / n_valid.to(torch.float32)).reshape(1)
    else:
        scale = torch.ones(1, dtype=torch.float32, device=dev)
    loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=dev)
    grad_h = torch.empty_like(hidden) if need_gh else hidden.new_empty(0)
    if not need_gw:
        grad_w = weight.new_empty(0)
    else:  # the first chunk overwrites it (beta=0), later chunks add into it (beta=1)
        grad_w = torch.zeros_like(weight) if n_tokens == 0 else torch.empty_like(weight)
    chunk = max(1, min(chunk_size, n_tokens))
    logits_buf = torch.empty(chunk, vocab, dtype=dtype, device=dev)
    block_v = min(triton.next_power_of_2(vocab), 8192 if dev.type == "cuda" else 256)
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        h = hidden[start:end]
        logits = logits_buf[: end - start]
        torch.mm(h, weight.t(), out=logits)
        with launch_context(_ce_loss_grad_kernel, dev):
            _ce_loss_grad_kernel[(end - start,)](
                logits, labels[start:end], loss_rows[start:end], scale, vocab, ignore_index,
                float(softcap) if softcap else 1.0, WRITE_GRAD=need_gh or need_gw, SOFTCAP=bool(softcap),
                BLOCK_V=block_v, num_warps=num_warps_for(block_v),
            )
        if need_gh:
            torch.mm(logits, weight, out=grad_h[start:end])
        if need_gw:
            if start == 0:
                torch.mm(logits.t(), h, out=grad_w)
            else:
                grad_w.addmm_(logits.t(), h)
    del logits_buf
    loss = loss_rows.sum() * scale[0]
    return loss, grad_h, grad_w


@torch.library.custom_op("megatrain::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy_op(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
    reduction: str, chunk_size: int, need_grad_hidden: bool, need_grad_weight: bool,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss fp32 scalar, grad_hidden or [0], grad_weight or [0]) for grad_output=1;
    `softcap` 0: the logits as they are, else capped to softcap * tanh(z / softcap)."""
    return _forward(hidden, weight, labels, ignore_index, reduction, chunk_size,
                    need_grad_hidden, need_grad_weight, softcap)


@fused_linear_cross_entropy_op.register_fake
def _(hidden, weight, labels, ignore_index, reduction, chunk_size, need_grad_hidden,
      need_grad_weight, softcap=0.0):
    loss = hidden.new_empty((), dtype=torch.float32)
    grad_h = hidden.new_empty(hidden.shape if need_grad_hidden else (0,))
    grad_w = weight.new_empty(weight.shape if need_grad_weight else (0,))
    return loss, grad_h, grad_w


def _eager(*tensors: torch.Tensor) -> bool:
    """Plain tensors outside any tracer (not fake, functional or compiled-autograd proxies)."""
    return not torch.compiler.is_compiling() and all(type(t) is torch.Tensor for t in tensors)


def _setup_context(ctx, inputs, output):
    _, grad_h, grad_w = output
    ctx.need = inputs[6], inputs[7]
    ctx.mark_non_differentiable(grad_h, grad_w)
    # No zero-filled incoming gradients for the two non-differentiable outputs: autograd
    # would otherwise allocate a grad_h- and a grad_w-sized tensor of zeros for the backward
    # (an allocator trace showed one extra grad_weight-sized block at the peak).
    ctx.set_materialize_grads(False)
    if _eager(grad_h, grad_w):
        # Held as attributes, not saved tensors, so that the backward can hand autograd the
        # only reference: AccumulateGrad then adopts the tensor as .grad. A saved tensor keeps
        # a second reference, which makes AccumulateGrad copy it (+1 GiB at V=128k, H=4096).
        ctx.grads = [grad_h, grad_w]
    else:  # traced (torch.compile): a pure function whose memory the compiler plans
        ctx.grads = None
        ctx.save_for_backward(grad_h, grad_w)


def _backward(ctx, grad_loss, _gh, _gw):
    need_gh, need_gw = ctx.need
    if ctx.grads is None:
        grad_h, grad_w = ctx.saved_tensors
        # grad_loss is a 0-dim fp32 tensor: the product keeps the stored gradient's dtype.
        grad_h, grad_w = grad_h * grad_loss, grad_w * grad_loss
    else:
        if not ctx.grads:
            raise RuntimeError("fused_linear_cross_entropy's backward scales the gradients it "
                               "made in the forward in place, so it runs once per forward; "
                               "recompute the loss instead of backpropagating through it twice "
                               "(retain_graph=True)")
        grad_h, grad_w = ctx.grads
        # Drop every reference ctx holds, mark_non_differentiable's tuple included (torch
        # may keep it after the forward), so the returned tensors are the only ones.
        ctx.grads, ctx.non_differentiable = [], None
        torch._foreach_mul_([grad_h, grad_w], grad_loss)  # one vectorised launch for both
    return (grad_h if need_gh else None, grad_w if need_gw else None,
            None, None, None, None, None, None, None)


fused_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, reduction: str = "mean",
                               chunk_size: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Cross entropy of (hidden @ weight.T) against labels, fp32 loss, no full logits.

    hidden [..., H] and labels [...] (flattened to N tokens), weight [V, H] of hidden's
    dtype. Gradients are computed in the forward only for inputs that require grad.
    `softcap` (> 0): each logit z enters the loss as softcap * tanh(z / softcap), in fp32.
    """
    if softcap is not None and not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                                    and softcap > 0):
        raise ValueError(f"softcap={softcap!r}: give a number > 0, or None for no cap")
    check_float("hidden", hidden)
    check_float("weight", weight)
    check_same_device(hidden=hidden, weight=weight, labels=labels)
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] \
            or labels.shape != hidden.shape[:-1]:
        raise ValueError(f"need hidden [..., H], weight [V, H], labels [...]; got hidden "
                         f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels "
                         f"{tuple(labels.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight has vocab size 0")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}; expected 'mean' or 'sum'")
    hidden2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden2.shape[0], weight.shape[0], hidden.element_size())
    elif chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    grad_on = torch.is_grad_enabled()
    loss, _, _ = fused_linear_cross_entropy_op(
        hidden2, weight.contiguous(), labels.reshape(-1).to(torch.int64).contiguous(),
        int(ignore_index), reduction, int(chunk_size),
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad, float(softcap or 0.0),
    )
    return loss


def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor,
                                         labels: torch.Tensor, ignore_index: int = -100,
                                         reduction: str = "mean", softcap: float | None = None) -> torch.Tensor:
    """HF's path: logits in the input dtype, upcast to fp32 (soft-capped there, where
    `softcap` is given), F.cross_entropy.

    Mean divides by max(#non-ignored, 1): equal to torch's mean except that all-ignored
    gives 0 instead of NaN.
    """
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    labels = labels.reshape(-1)
    total = torch.nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index,
                                              reduction="sum")
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum().clamp(min=1)
