"""megatrain::fused_linear_cross_entropy against HF's lm_head + fp32 cross entropy.

The CPU run uses a vocab block of 256, so vocabularies above 256 exercise the online
log-sum-exp across blocks; small chunk sizes make the token chunks ragged.
"""

import pytest
import torch
import torch.nn.functional as F

from kernel_checks import (
    assert_close,
    check_labelled,
    compile_capturing_ops,
    each,
    each_dtype,
    gpu_each_dtype,
    grads,
    leaf,
    random_dims,
)
from megatrain.kernels.fused_linear_cross_entropy import (
    default_chunk_size,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_op,
    fused_linear_cross_entropy_reference,
)
from tests.gpu.results import allocations, blocks_at_peak, record_result

# (tokens, hidden, vocab, chunk_size, ignored tokens, reduction)
CPU_CASES = [
    (1, 1, 1, 1, 0, "mean"),        # degenerate: one token, one class
    (13, 16, 300, 4, 3, "mean"),    # ragged chunks, two vocab blocks, some ignored
    (7, 5, 257, 100, 0, "sum"),     # one chunk larger than N, vocab one past a block
    (9, 8, 513, 1, 2, "sum"),       # one-token chunks, three vocab blocks
    (6, 12, 64, None, 1, "mean"),   # default chunk size
]
GPU_CASES = [
    (4099, 512, 32000, 1024, 50, "mean"),
    (1000, 256, 128256, 300, 0, "sum"),
    (257, 4096, 32000, None, 7, "mean"),
]


def _inputs(n, h, v, ignored, dtype, device, logit_scale=1.0):
    hidden = leaf(torch.randn(n, h, dtype=dtype, device=device) * logit_scale)
    weight = leaf(torch.randn(v, h, dtype=dtype, device=device) / h**0.5)
    labels = torch.randint(0, v, (n,), device=device)
    labels[torch.randperm(n, device=device)[:ignored]] = -100
    return hidden, weight, labels


def _check(case, dtype, device, logit_scale=1.0, softcap=None):
    n, h, v, chunk, ignored, reduction = case
    hidden, weight, labels = _inputs(n, h, v, ignored, dtype, device, logit_scale)
    loss = fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction,
                                      chunk_size=chunk, softcap=softcap)
    ref = fused_linear_cross_entropy_reference(hidden, weight, labels, reduction=reduction,
                                               softcap=softcap)
    assert loss.dtype == torch.float32 and loss.shape == ()
    # The loss is an fp32 reduction of fp32 terms either way; only the logits are rounded.
    assert_close(loss, ref, torch.float32 if dtype == torch.float32 else dtype, "loss")
    up = torch.randn((), device=device)
    got, want = grads(loss, (hidden, weight), up), grads(ref, (hidden, weight), up)
    assert_close(got[0], want[0], dtype, "grad_hidden")
    assert_close(got[1], want[1], dtype, "grad_weight")


@each_dtype
@each("case", CPU_CASES)
def test_matches_reference(case, dtype):
    _check(case, dtype, "cpu")


@each_dtype
def test_large_logits_are_stable(dtype):
    _check((5, 16, 300, 2, 1, "mean"), dtype, "cpu", logit_scale=30.0)


@each_dtype
@each("case", CPU_CASES)
def test_soft_capped_logits_match_reference(case, dtype):
    """Gemma 2's final logits, softcap * tanh(z / softcap): logits large enough that the
    cap bends them (scale 8 against caps of 3 and 30), and small ones where tanh is
    nearly linear (the kernel's series branch)."""
    for scale, cap in ((8.0, 3.0), (8.0, 30.0), (0.05, 30.0)):
        _check(case, dtype, "cpu", logit_scale=scale, softcap=cap)


def test_a_soft_cap_changes_the_loss():
    """The cap is applied, not ignored: at logits far beyond it the capped loss differs."""
    hidden, weight, labels = _inputs(7, 6, 50, 0, torch.float32, "cpu", logit_scale=20.0)
    capped = fused_linear_cross_entropy(hidden, weight, labels, softcap=2.0)
    plain = fused_linear_cross_entropy(hidden, weight, labels)
    assert_close(capped, fused_linear_cross_entropy_reference(hidden, weight, labels, softcap=2.0),
                 torch.float32, "loss")
    assert abs(float(capped) - float(plain)) > 0.1


def test_reference_is_torch_mean():
    hidden, weight, labels = _inputs(11, 6, 40, 4, torch.float32, "cpu")
    torch_mean = F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=-100)
    ours = fused_linear_cross_entropy(hidden, weight, labels)
    assert_close(ours, torch_mean, torch.float32, "loss")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_gives_zero_not_nan(reduction):
    hidden, weight, labels = _inputs(5, 8, 33, 5, torch.float32, "cpu")
    loss = fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_size=2)
    assert loss.item() == 0.0
    gh, gw = grads(loss, (hidden, weight), torch.tensor(1.0))
    assert not gh.any() and not gw.any()


def test_custom_ignore_index_and_3d_hidden():
    hidden = leaf(torch.randn(2, 5, 7))
    weight = leaf(torch.randn(50, 7))
    labels = torch.randint(0, 50, (2, 5))
    labels[0, :2] = 3  # class 3 is "ignored" here, while -100 would be an error
    loss = fused_linear_cross_entropy(hidden, weight, labels, ignore_index=3, chunk_size=3)
    ref = fused_linear_cross_entropy_reference(hidden, weight, labels, ignore_index=3)
    assert_close(loss, ref, torch.float32, "loss")
    for a, b in zip(grads(loss, (hidden, weight), None), grads(ref, (hidden, weight), None)):
        assert_close(a, b, torch.float32, "grad")


def test_partial_and_no_grad():
    hidden, weight, labels = _inputs(6, 4, 30, 1, torch.float32, "cpu")
    frozen = weight.detach()
    loss = fused_linear_cross_entropy(hidden, frozen, labels, chunk_size=4)
    ref = fused_linear_cross_entropy_reference(hidden, frozen, labels)
    assert_close(grads(loss, hidden, None)[0], grads(ref, hidden, None)[0], torch.float32, "gh")
    loss = fused_linear_cross_entropy(hidden.detach(), weight, labels, chunk_size=4)
    ref = fused_linear_cross_entropy_reference(hidden.detach(), weight, labels)
    assert_close(grads(loss, weight, None)[0], grads(ref, weight, None)[0], torch.float32, "gw")
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    assert_close(loss, ref.detach(), torch.float32, "loss")
    assert loss.grad_fn is None


def test_second_backward_is_an_error_and_loss_reuse_is_fine():
    hidden, weight, labels = _inputs(7, 5, 40, 2, torch.float32, "cpu")
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=3)
    ref = fused_linear_cross_entropy_reference(hidden, weight, labels)
    # One backward through a graph that uses the loss twice: grad_output sums to 2.5.
    got = grads(loss * 2 + loss / 2, (hidden, weight), None, retain_graph=True)
    want = grads(ref * 2 + ref / 2, (hidden, weight), None)
    for a, b, name in zip(got, want, ("grad_hidden", "grad_weight")):
        assert_close(a, b, torch.float32, name)
    with pytest.raises(RuntimeError, match="runs once per forward"):
        grads(loss, (hidden, weight), None)


def test_backward_hands_over_its_gradients_without_copies():
    """.grad is the buffer the forward filled (scaled in place), not a copy of it."""
    hidden, weight, labels = _inputs(6, 4, 30, 1, torch.float32, "cpu")
    loss, grad_h, grad_w = fused_linear_cross_entropy_op(hidden, weight, labels, -100, "mean",
                                                         4, True, True)
    ptrs = grad_h.data_ptr(), grad_w.data_ptr()
    del grad_h, grad_w  # a reference kept here would (rightly) make autograd copy
    (loss * 3).backward()
    assert (hidden.grad.data_ptr(), weight.grad.data_ptr()) == ptrs
    ref = fused_linear_cross_entropy_reference(hidden, weight, labels) * 3
    for got, want in zip((hidden.grad, weight.grad), grads(ref, (hidden, weight), None)):
        assert_close(got, want, torch.float32, "grad")


def test_backward_allocates_no_gradient_sized_buffers():
    """The backward only scales what the forward made: no zero-filled incoming gradients for
    the non-differentiable outputs (autograd materialises them unless told not to; on the
    GPU that was one extra grad_weight and grad_hidden at the peak)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    self.sizes.append((str(func), t.numel()))  # new memory, not a view
            return out

    hidden, weight, labels = _inputs(37, 16, 300, 1, torch.float32, "cpu")
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    with Allocations() as seen:
        loss.backward()
    big = [(f, n) for f, n in seen.sizes if n >= hidden.numel()]
    assert not big, f"the backward allocated gradient-sized tensors: {big}"
    ref = fused_linear_cross_entropy_reference(hidden, weight, labels)
    for got, want in zip((hidden.grad, weight.grad), grads(ref, (hidden, weight), None)):
        assert_close(got, want, torch.float32, "grad")


def test_no_tokens():
    hidden, weight = leaf(torch.randn(0, 6)), leaf(torch.randn(9, 6))
    loss = fused_linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert loss.item() == 0.0
    gh, gw = grads(loss, (hidden, weight), None)
    assert gh.shape == (0, 6) and torch.equal(gw, torch.zeros(9, 6))


def test_default_chunk_size():
    assert default_chunk_size(16384, 128256, 2) == 2048
    assert default_chunk_size(16384, 32000, 2) == 8192
    assert default_chunk_size(5, 32000, 4) == 8
    assert default_chunk_size(1, 10**9, 4) == 1


def test_opcheck():
    hidden, weight, labels = _inputs(9, 5, 11, 2, torch.float32, "cpu")
    for need in [(True, True), (True, False), (False, False)]:
        torch.library.opcheck(fused_linear_cross_entropy_op,
                              (hidden, weight, labels, -100, "mean", 4, *need))
    torch.library.opcheck(fused_linear_cross_entropy_op,
                          (hidden, weight, labels, -100, "mean", 4, True, True, 30.0))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile(dynamic):
    def fn(x, proj, weight, labels):
        return fused_linear_cross_entropy(torch.tanh(x @ proj), weight, labels, chunk_size=4) * 3

    compiled, seen = compile_capturing_ops(fn, dynamic=dynamic)
    x, proj = leaf(torch.randn(2, 5, 6)), leaf(torch.randn(6, 6))
    weight, labels = leaf(torch.randn(70, 6)), torch.randint(0, 70, (2, 5))
    labels[1, 4] = -100
    out, out_ref = compiled(x, proj, weight, labels), fn(x, proj, weight, labels)
    assert_close(out, out_ref, torch.float32, "loss")
    params = (x, proj, weight)
    for a, b in zip(grads(out, params, None), grads(out_ref, params, None)):
        assert_close(a, b, torch.float32, "grad")
    assert "megatrain.fused_linear_cross_entropy.default" in seen


def test_out_of_range_label_is_an_error():
    hidden, weight, labels = _inputs(4, 3, 10, 0, torch.float32, "cpu")
    labels[2] = 10
    with pytest.raises(ValueError, match="label 10 is outside"):
        fused_linear_cross_entropy(hidden, weight, labels)


@pytest.mark.parametrize("kwargs, match", [
    (dict(weight=torch.randn(10, 4)), "need hidden"),
    (dict(labels=torch.zeros(5, dtype=torch.long)), "need hidden"),
    (dict(labels=torch.zeros(4)), "integer"),
    (dict(weight=torch.randn(10, 3, dtype=torch.bfloat16)), "weight dtype"),
    (dict(weight=torch.randn(0, 3)), "vocab size 0"),
    (dict(reduction="none"), "reduction"),
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(softcap=0.0), "softcap=0.0"),
    (dict(softcap=-30.0), "softcap=-30.0"),
])
def test_bad_input(kwargs, match):
    args = dict(hidden=torch.randn(4, 3), weight=torch.randn(10, 3),
                labels=torch.zeros(4, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fused_linear_cross_entropy(**args)


@each_dtype
def test_random_shapes(dtype):
    for _ in range(3):
        n, h, v, chunk = random_dims((1, 30), (1, 24), (2, 900), (1, 12))
        case = (n, h, v, chunk, int(torch.randint(0, n + 1, ())), ("mean", "sum")[n % 2])
        check_labelled(lambda c, d: _check(c, d, "cpu"), case, dtype)


@pytest.mark.gpu
def test_gpu_peak_memory():
    """Beyond inputs, only grad_weight, grad_hidden and one logits chunk are ever allocated."""
    n, h, v, chunk = 4096, 1024, 32000, 512
    hidden, weight, labels = _inputs(n, h, v, 10, torch.bfloat16, "cuda")
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)  # warm-up
    grads(loss, (hidden, weight), None)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with allocations() as trace:
        loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
        gh, gw = grads(loss, (hidden, weight), None)
        torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    budget = (v * h + n * h + chunk * v) * 2
    at_peak = blocks_at_peak(trace)
    record_result("flce_peak", {"extra": extra, "budget": budget, "live_at_peak": at_peak})
    assert extra <= budget + 2**20, f"extra {extra / 2**20:.1f} MiB > {budget / 2**20:.1f} MiB: {at_peak}"


@gpu_each_dtype
def test_gpu(dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    for case in GPU_CASES + CPU_CASES:
        _check(case, dtype, "cuda")
    _check((33, 64, 5000, 8, 3, "mean"), dtype, "cuda", logit_scale=30.0)
    for case in GPU_CASES[:1] + CPU_CASES[1:2]:  # Gemma 2's soft-capped logits
        _check(case, dtype, "cuda", logit_scale=8.0, softcap=30.0)
