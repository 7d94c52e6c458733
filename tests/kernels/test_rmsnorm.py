"""megatrain::rms_norm against the HF-style reference: forward, dx and dweight."""

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
from megatrain.kernels.rmsnorm import (
    _rms_norm_bwd,
    rms_norm,
    rms_norm_backward_op,
    rms_norm_op,
    rms_norm_reference,
)

# Single row, hidden 1, non-powers of two, 3-D input, more rows than backward programs.
CPU_SHAPES = [(1, 1), (9, 1), (1, 37), (3, 5, 37), (13, 100), (2, 513)]
GPU_SHAPES = [(1, 1), (3, 5, 37), (4097, 4096), (2, 1000, 5120), (311, 8192)]


def _check(shape, dtype, device, w_dtype=None, eps=1e-6):
    x = leaf(torch.randn(shape, dtype=dtype, device=device) * 2 + 0.3)
    w = leaf(torch.randn(shape[-1], dtype=w_dtype or dtype, device=device))
    y, y_ref = rms_norm(x, w, eps), rms_norm_reference(x, w, eps)
    assert y.dtype == x.dtype
    assert_close(y, y_ref.to(y.dtype), dtype, "y")
    dy = torch.randn_like(y)
    dx, dw = grads(y, (x, w), dy)
    dx_ref, dw_ref = grads(y_ref, (x, w), dy.to(y_ref.dtype))
    assert_close(dx, dx_ref, dtype, "dx")
    assert_close(dw, dw_ref, dtype, "dweight")


@each_dtype
@each("shape", CPU_SHAPES)
def test_matches_reference(shape, dtype):
    _check(shape, dtype, "cpu")


def test_fp32_weight_with_bf16_input():
    _check((5, 24), torch.bfloat16, "cpu", w_dtype=torch.float32)


def test_non_contiguous_input():
    x = leaf(torch.randn(6, 10))
    w = leaf(torch.randn(6))
    xt = x.t()  # [10, 6], strided
    y, y_ref = rms_norm(xt, w, 1e-5), rms_norm_reference(xt, w, 1e-5)
    assert_close(y, y_ref, torch.float32, "y")
    dy = torch.randn_like(y)
    for a, b, name in zip(grads(y, (x, w), dy), grads(y_ref, (x, w), dy), ("dx", "dw")):
        assert_close(a, b, torch.float32, name)


def test_empty_rows():
    x, w = torch.randn(0, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == (0, 8)
    dx, dw = grads(y, (x, w), torch.ones_like(y))
    assert dx.shape == (0, 8) and torch.equal(dw, torch.zeros(8))


def test_opcheck():
    x, w = torch.randn(3, 7, requires_grad=True), torch.randn(7, requires_grad=True)
    torch.library.opcheck(rms_norm_op, (x, w, 1e-6))
    _, rstd = rms_norm_op(x.detach(), w.detach(), 1e-6)
    torch.library.opcheck(rms_norm_backward_op, (torch.randn(3, 7), x.detach(), w.detach(), rstd))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile(dynamic):
    def fn(x, w):
        return rms_norm(x * 2, w, 1e-5).square().sum()

    compiled, seen = compile_capturing_ops(fn, dynamic=dynamic)
    x, w = leaf(torch.randn(4, 11)), leaf(torch.randn(11))
    out, out_ref = compiled(x, w), fn(x, w)
    assert_close(out, out_ref, torch.float32, "loss")
    for a, b in zip(grads(out, (x, w), None), grads(out_ref, (x, w), None)):
        assert_close(a, b, torch.float32, "grad")
    assert {"megatrain.rms_norm.default", "megatrain.rms_norm_backward.default"} <= seen


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(2, 4), w=torch.randn(5)), "weight"),
    (dict(x=torch.randn(2, 4), w=torch.randn(4, 1)), "weight"),
    (dict(x=torch.randint(0, 3, (2, 4)), w=torch.randn(4)), "dtype"),
    (dict(x=torch.randn(2, 0), w=torch.randn(0)), "hidden size 0"),
    (dict(x=torch.randn(2, 4), w=torch.randn(4), eps=-1.0), "eps"),
])
def test_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        rms_norm(bad["x"], bad["w"], bad.get("eps", 1e-6))


@each_dtype
def test_random_shapes(dtype):
    for _ in range(3):
        rows, hidden = random_dims((1, 40), (1, 700))
        check_labelled(lambda s, d: _check(s, d, "cpu"), (rows, hidden), dtype)


def test_cpu_tensors_without_interpreter_are_a_clear_error():
    from megatrain.kernels._common import launch_context

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        launch_context(object(), torch.device("cpu"))


@gpu_each_dtype
def test_gpu(dtype):
    for shape in GPU_SHAPES:
        _check(shape, dtype, "cuda")
    _check((64, 4096), torch.bfloat16, "cuda", w_dtype=torch.float32)


@each_dtype
@pytest.mark.parametrize("block_m, programs", [(1, 1), (1, 5), (4, 3), (8, 64), (16, 2)])
def test_backward_tilings_agree(block_m, programs, dtype):
    """dx and dweight do not depend on how rows are split into tiles and programs."""
    x = torch.randn(23, 45, dtype=dtype) * 2 + 0.3
    w = torch.randn(45, dtype=dtype)
    dy = torch.randn_like(x)
    _, rstd = rms_norm_op(x, w, 1e-6)
    dx, dw = _rms_norm_bwd(dy, x, w, rstd, block_m=block_m, programs=programs)
    xl, wl = leaf(x), leaf(w)
    dx_ref, dw_ref = grads(rms_norm_reference(xl, wl, 1e-6), (xl, wl), dy)
    assert_close(dx, dx_ref, dtype, "dx")
    assert_close(dw, dw_ref, dtype, "dweight")
