"""Reading and editing dynamo's torch-level graph, for the passes that swap patterns in it
(fusions.py: kernels, the fused loss): one name per op whatever dynamo's spelling, the
arguments and fake values of a node, and new nodes that carry the meta of what they
replace.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

_FUNCTIONS = {
    operator.mul: "mul", torch.mul: "mul", operator.add: "add", torch.add: "add",
    operator.neg: "neg", torch.neg: "neg", operator.pow: "pow", torch.pow: "pow",
    torch.rsqrt: "rsqrt", torch.mean: "mean", torch.cat: "cat", torch.concat: "cat",
    torch.chunk: "chunk", operator.getitem: "getitem", F.silu: "silu", F.linear: "linear",
    F.cross_entropy: "cross_entropy", torch.flatten: "flatten", torch.reshape: "reshape",
    torch._C._nn.silu: "silu", operator.truediv: "div", torch.tanh: "tanh",
}
_METHODS = {"__mul__": "mul", "__rmul__": "mul", "__add__": "add", "__radd__": "add",
            "__neg__": "neg", "__pow__": "pow", "__truediv__": "div"}
_VIEWS = {"view", "reshape", "flatten", "contiguous"}


def _kind(n) -> str | None:
    """One name per op whatever the spelling: call_function torch.*/operator.* or a method."""
    if not isinstance(n, fx.Node):
        return None
    if n.op == "call_function":
        return _FUNCTIONS.get(n.target)
    if n.op == "call_method":
        return _METHODS.get(n.target, n.target)
    return None


def _val(n):
    v = n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _arg(n: fx.Node, i: int, name: str, default=None):
    """Argument `i` (counting self for methods) or keyword `name`."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _binary(n, kind: str):
    """(a, b) of a plain binary op `kind` (no alpha/out kwargs), else None."""
    if _kind(n) == kind and len(n.args) == 2 and not n.kwargs:
        return n.args
    return None


def _sole_user(n: fx.Node, user: fx.Node) -> bool:
    return set(n.users) == {user}


def _eq(a, b) -> bool:
    """True only when a == b holds for every value of the shapes' symbols (no new guards)."""
    return statically_known_true(a == b)


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(_eq(x, y) for x, y in zip(a.shape, b.shape))


def _is_last_dim(dim, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and not isinstance(dim, bool) and dim in (-1, ndim - 1)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _upcast_of(n):
    """x for `x.float()` / `x.to(torch.float32)` / `x.to(dtype=torch.float32)`, else None."""
    k = _kind(n)
    if k == "float" and len(n.args) == 1 and not n.kwargs:
        return n.args[0]
    if k == "to" and _cast_dtype(n) == torch.float32:
        return n.args[0]
    return None


def _cast_dtype(n: fx.Node):
    """The dtype of a pure dtype cast `t.to(dtype)` / `t.to(dtype=...)`, else None."""
    if len(n.args) == 2 and not n.kwargs and isinstance(n.args[1], torch.dtype):
        return n.args[1]
    if len(n.args) == 1 and set(n.kwargs) == {"dtype"} and isinstance(n.kwargs["dtype"], torch.dtype):
        return n.kwargs["dtype"]
    return None


# --- editing it ---------------------------------------------------------------------------

_VALUE_KEYS = ("example_value", "val", "tensor_dict", "unbacked_bindings")


def _raw(a):
    return a.meta.get("example_value", a.meta.get("val"))


def fake_value(op: str, target, args, kwargs):
    """A new node's example_value, as dynamo would have given it: the node run on its
    inputs' fake values (None where an input has none)."""
    inputs = []
    fx.node.map_arg((args, kwargs), inputs.append)
    if any(_raw(a) is None for a in inputs):
        return None
    fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), _raw)
    # The values' own mode: in the backend, TracingContext may hold another one.
    modes = {id(v.fake_mode): v.fake_mode for v in pytree.tree_leaves([fake_args, fake_kwargs])
             if isinstance(v, FakeTensor)}
    if len(modes) != 1:
        return None
    (mode,) = modes.values()
    with mode:
        if op == "call_method":
            return getattr(fake_args[0], target)(*fake_args[1:], **fake_kwargs)
        return target(*fake_args, **fake_kwargs)


def _new(graph: fx.Graph, op: str, target, args, meta_from: fx.Node, kwargs=None) -> fx.Node:
    """A node carrying `meta_from`'s meta (module stack, stack trace) and its own value."""
    kwargs = kwargs or {}
    node = graph.create_node(op, target, tuple(args), kwargs)
    node.meta.update({k: v for k, v in meta_from.meta.items() if k not in _VALUE_KEYS})
    value = fake_value(op, target, args, kwargs)
    if value is not None:
        node.meta["example_value"] = value
    return node


def _erase(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erase a replaced pattern, users first (all of it is dead once its outputs are replaced)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(set(nodes), key=order.__getitem__, reverse=True):
        graph.erase_node(n)
