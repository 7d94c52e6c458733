"""Shared tolerances and comparison helpers for the kernel tests.

bf16 tolerances allow about two bf16 ulps: the reference rounds once (round-to-nearest),
and the Triton interpreter rounds fp32 -> bf16 by truncation, so CPU results may differ
by one ulp more than GPU results would. The absolute part scales with the largest
reference value, because reductions (dweight, grad_weight) produce entries that are sums
of cancelling terms whose relative error is meaningless.
"""

from __future__ import annotations

import pytest
import torch

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}

DTYPES = list(TOLERANCES)

# The parametrisation every kernel test file shares: each dtype of the tolerance table,
# each case of a shape list (ids are the tuples themselves), and the GPU variant.
each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=str)


def each(name: str, values):
    """Parametrise over `values` (shapes or case tuples), named by their str()."""
    return pytest.mark.parametrize(name, values, ids=str)


def gpu_each_dtype(fn):
    """A `gpu`-marked test run once per dtype (skipped without CUDA by the conftest)."""
    return pytest.mark.gpu(each_dtype(fn))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    tol = TOLERANCES[dtype]
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol["rtol"],
                               atol=tol["atol"] * scale, msg=lambda m: f"{what}: {m}")


def grads(outputs, inputs, upstream, retain_graph=None):
    """torch.autograd.grad of `outputs` w.r.t. `inputs` under given upstream grads."""
    return torch.autograd.grad(outputs, inputs, upstream, retain_graph=retain_graph,
                               allow_unused=False)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def compile_capturing_ops(fn, dynamic: bool = False):
    """torch.compile(fn) through AOTAutograd (no Inductor), recording the call targets of
    the forward and backward graphs, so a test can see that our ops reach the graph
    (rather than a graph break or a decomposition hiding them)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: set[str] = set()

    def record(gm, _example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic), seen


def random_dims(*ranges: tuple[int, int]) -> tuple[int, ...]:
    """Fresh sizes each run (inclusive ranges): catches bugs that fixed shapes hide."""
    return tuple(int(torch.randint(lo, hi + 1, ())) for lo, hi in ranges)


def check_labelled(check, case, *args):
    """Run check(case, *args), naming the randomly drawn case if it fails."""
    try:
        check(case, *args)
    except AssertionError as exc:
        raise AssertionError(f"case {case}: {exc}") from exc
