"""megatrain::rope against HF's rotate_half formula: q/k outputs and dq, dk (GQA too)."""

import pytest
import torch

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
from megatrain.kernels.rope import apply_rotary, apply_rotary_reference, rope_backward_op, rope_op

# (batch, q_heads, kv_heads, seq, head_dim, cos_batch)
CPU_CASES = [
    (1, 1, 1, 1, 2, 1),     # smallest: one token, head_dim 2
    (2, 4, 2, 5, 6, 1),     # GQA, head_dim not a power of two, shared cos
    (2, 5, 1, 3, 20, 2),    # MQA, per-batch cos
    (1, 3, 3, 7, 128, 1),   # Llama head_dim
    (1, 20, 4, 2, 10, 1),   # more heads than one head block (16)
]
GPU_CASES = [(2, 32, 8, 1000, 128, 1), (1, 24, 24, 777, 96, 1), (3, 5, 1, 513, 20, 3)]


def _rotary_tables(batch, seq, dim, dtype, device):
    """HF-style tables: cat(freqs, freqs) over random positions (not just 0..S-1)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    pos = torch.randint(0, 4096, (batch, seq), device=device).float()
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _check(case, dtype, device, cos=None, sin=None):
    batch, hq, hk, seq, dim, cb = case
    q = leaf(torch.randn(batch, hq, seq, dim, dtype=dtype, device=device))
    k = leaf(torch.randn(batch, hk, seq, dim, dtype=dtype, device=device))
    if cos is None:
        cos, sin = _rotary_tables(cb, seq, dim, dtype, device)
    out, ref = apply_rotary(q, k, cos, sin), apply_rotary_reference(q, k, cos, sin)
    for a, b, name in zip(out, ref, ("q_out", "k_out")):
        assert_close(a, b, dtype, name)
    up = (torch.randn_like(out[0]), torch.randn_like(out[1]))
    for a, b, name in zip(grads(out, (q, k), up), grads(ref, (q, k), up), ("dq", "dk")):
        assert_close(a, b, dtype, name)


@each_dtype
@each("case", CPU_CASES)
def test_matches_reference(case, dtype):
    _check(case, dtype, "cpu")


def test_general_cos_sin_halves_differ():
    """Random cos/sin whose halves differ: checks the backward is the exact transpose."""
    cos, sin = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    _check((2, 3, 1, 4, 8, 2), torch.float32, "cpu", cos, sin)


def test_two_dim_tables_and_fp32_tables_with_bf16():
    cos, sin = _rotary_tables(1, 6, 12, torch.float32, "cpu")
    _check((2, 2, 1, 6, 12, 1), torch.bfloat16, "cpu", cos[0], sin[0])


def test_non_contiguous_and_unused_k():
    # HF makes q by view(B, S, H, D).transpose(1, 2): not contiguous.
    base = leaf(torch.randn(2, 5, 3, 8))
    q = base.transpose(1, 2)
    k = leaf(torch.randn(2, 1, 5, 8))
    cos, sin = _rotary_tables(1, 5, 8, torch.float32, "cpu")
    q_out, _ = apply_rotary(q, k, cos, sin)
    q_ref, _ = apply_rotary_reference(q, k, cos, sin)
    assert_close(q_out, q_ref, torch.float32, "q_out")
    up = torch.randn_like(q_out)
    assert_close(grads(q_out, base, up)[0], grads(q_ref, base, up)[0], torch.float32, "dq")


def test_opcheck():
    q, k = torch.randn(2, 3, 4, 6, requires_grad=True), torch.randn(2, 1, 4, 6, requires_grad=True)
    cos, sin = _rotary_tables(1, 4, 6, torch.float32, "cpu")
    torch.library.opcheck(rope_op, (q, k, cos, sin))
    torch.library.opcheck(rope_backward_op, (torch.randn_like(q), torch.randn_like(k), cos, sin))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile(dynamic):
    def fn(q, k, cos, sin):
        qo, ko = apply_rotary(q, k, cos, sin)
        return (qo.sum(1, keepdim=True) * ko).square().sum()

    compiled, seen = compile_capturing_ops(fn, dynamic=dynamic)
    q, k = leaf(torch.randn(1, 4, 5, 6)), leaf(torch.randn(1, 2, 5, 6))
    cos, sin = _rotary_tables(1, 5, 6, torch.float32, "cpu")
    out, out_ref = compiled(q, k, cos, sin), fn(q, k, cos, sin)
    assert_close(out, out_ref, torch.float32, "out")
    for a, b in zip(grads(out, (q, k), None), grads(out_ref, (q, k), None)):
        assert_close(a, b, torch.float32, "grad")
    assert {"megatrain.rope.default", "megatrain.rope_backward.default"} <= seen


def _bad(q=(1, 2, 3, 4), k=(1, 1, 3, 4), cs=(1, 3, 4), dtype=torch.float32, sin=None):
    return (torch.randn(q).to(dtype), torch.randn(k).to(dtype), torch.randn(cs),
            torch.randn(sin or cs))


@pytest.mark.parametrize("args, match", [
    (_bad(q=(1, 2, 3, 5), k=(1, 1, 3, 5), cs=(1, 3, 5)), "head_dim=5"),
    (_bad(k=(1, 1, 4, 4)), "must match q"),
    (_bad(cs=(1, 3, 6)), "cos"),
    (_bad(sin=(1, 2, 4)), "sin"),
    (_bad(cs=(3, 3, 4)), "cos"),
    (_bad(q=(2, 3, 4)), "batch, heads, seq, head_dim"),
    (_bad(dtype=torch.int32), "dtype"),
])
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary(*args)


def test_cos_requiring_grad_is_refused():
    q, k, cos, sin = _bad()
    with pytest.raises(ValueError, match="cos/sin require grad"):
        apply_rotary(q, k, cos.requires_grad_(), sin)


@each_dtype
def test_random_shapes(dtype):
    for _ in range(3):
        batch, kv, groups, seq, half = random_dims((1, 3), (1, 4), (1, 5), (1, 9), (1, 40))
        cos_batch = batch if torch.rand(()) < 0.5 else 1
        case = (batch, kv * groups, kv, seq, 2 * half, cos_batch)
        check_labelled(lambda c, d: _check(c, d, "cpu"), case, dtype)


@gpu_each_dtype
def test_gpu(dtype):
    for case in GPU_CASES + CPU_CASES:
        _check(case, dtype, "cuda")


@pytest.mark.parametrize("block_s", [1, 2, 4])
def test_position_tilings_agree(block_s):
    """Several position blocks per (batch, head) row, the last one ragged, both directions."""
    from megatrain.kernels.rope import _launch

    q, k = torch.randn(2, 3, 7, 12), torch.randn(2, 1, 7, 12)
    cos, sin = torch.randn(2, 7, 12), torch.randn(2, 7, 12)
    for backward in (False, True):
        got, want = _launch(q, k, cos, sin, backward, block_s), _launch(q, k, cos, sin, backward, 8)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    ref = apply_rotary_reference(q, k, cos, sin)
    for a, b in zip(_launch(q, k, cos, sin, False, block_s), ref):
        assert_close(a, b, torch.float32, "out")
