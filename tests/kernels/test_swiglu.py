"""megatrain::swiglu against silu(gate) * up in fp32: forward, dgate and dup."""

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
from megatrain.kernels.swiglu import swiglu, swiglu_backward_op, swiglu_op, swiglu_reference

# One element, fewer than one block, exactly one block, ragged multi-block, 3-D.
CPU_SHAPES = [(1,), (7, 3), (1024,), (3, 1001), (2, 5, 301)]
GPU_SHAPES = [(16384, 14336), (3, 1001), (4097, 11008)]


def _check(shape, dtype, device):
    # Wide range: silu saturates on both sides, where a sloppy formula overflows.
    gate = leaf(torch.randn(shape, dtype=dtype, device=device) * 6)
    up = leaf(torch.randn(shape, dtype=dtype, device=device))
    y, y_ref = swiglu(gate, up), swiglu_reference(gate, up)
    assert_close(y, y_ref, dtype, "y")
    dy = torch.randn_like(y)
    for a, b, name in zip(grads(y, (gate, up), dy), grads(y_ref, (gate, up), dy), ("dgate", "dup")):
        assert_close(a, b, dtype, name)


@each_dtype
@each("shape", CPU_SHAPES)
def test_matches_reference(shape, dtype):
    _check(shape, dtype, "cpu")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter
def test_extreme_gates_stay_finite():
    gate = leaf(torch.tensor([-1000.0, -90.0, 0.0, 90.0, 1000.0]))
    up = leaf(torch.ones(5))
    y = swiglu(gate, up)
    assert_close(y, swiglu_reference(gate, up), torch.float32, "y")
    dgate, dup = grads(y, (gate, up), torch.ones_like(y))
    assert torch.isfinite(dgate).all() and torch.isfinite(dup).all()


def test_non_contiguous_and_empty():
    g = leaf(torch.randn(8, 6))
    u = leaf(torch.randn(6, 8))
    y = swiglu(g.t(), u)
    assert_close(y, swiglu_reference(g.t(), u), torch.float32, "y")
    assert swiglu(torch.randn(0, 3), torch.randn(0, 3)).shape == (0, 3)


def test_opcheck():
    g, u = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    torch.library.opcheck(swiglu_op, (g, u))
    torch.library.opcheck(swiglu_backward_op, (torch.randn(3, 5), g.detach(), u.detach()))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile(dynamic):
    def fn(x, w_gate, w_up):
        return swiglu(x @ w_gate, x @ w_up).square().mean()

    compiled, seen = compile_capturing_ops(fn, dynamic=dynamic)
    x, wg, wu = leaf(torch.randn(5, 4)), leaf(torch.randn(4, 9)), leaf(torch.randn(4, 9))
    out, out_ref = compiled(x, wg, wu), fn(x, wg, wu)
    assert_close(out, out_ref, torch.float32, "out")
    for a, b in zip(grads(out, (x, wg, wu), None), grads(out_ref, (x, wg, wu), None)):
        assert_close(a, b, torch.float32, "grad")
    assert {"megatrain.swiglu.default", "megatrain.swiglu_backward.default"} <= seen


@pytest.mark.parametrize("gate, up, match", [
    (torch.randn(3, 4), torch.randn(4, 3), "one shape"),
    (torch.randn(3, 4), torch.randn(3, 1), "one shape"),
    (torch.randn(3, 4), torch.randn(3, 4, dtype=torch.bfloat16), "dtype"),
    (torch.randint(0, 5, (3, 4)), torch.randn(3, 4), "gate has dtype"),
])
def test_bad_input(gate, up, match):
    with pytest.raises(ValueError, match=match):
        swiglu(gate, up)


@each_dtype
def test_random_shapes(dtype):
    for _ in range(3):
        check_labelled(lambda s, d: _check(s, d, "cpu"), random_dims((1, 9), (1, 3000)), dtype)


@gpu_each_dtype
def test_gpu(dtype):
    for shape in GPU_SHAPES:
        _check(shape, dtype, "cuda")
