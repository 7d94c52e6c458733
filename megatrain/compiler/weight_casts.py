"""Casts to a streamed weight's dtype: retarget them to the compute dtype where nothing else
reconciles an op's operands.

Why this exists. Dynamo traces the model with its host parameters, the fp32 masters, and
bakes every dtype it reads into the graph as a constant: `x.to(w.dtype)` becomes
`x.to(torch.float32)`, and nothing in the graph says the dtype came from a weight. megatrain
then hands each op the weight as `fetch` returns it, in the compute dtype (bf16 under
precision="bf16"). Its bf16 is autocast over compute-dtype weights: AOTAutograd traces the
graph under `torch.autocast`, so a matmul receives an fp32 activation and a bf16 weight and
autocast casts both to bf16, while an elementwise op promotes (an RMSNorm's
`w * h.to(torch.float32)` is fp32, as under eager autocast). Dense models never see the
baked dtype for those two reasons. An op that neither autocast covers nor promotes does: a
custom op whose kernel assumes one dtype (Hugging Face's grouped-matmul experts fall back to
one whenever dynamo sees weights that are not bf16, and cast the activation to the weight's
dtype first) receives the fp32 activation beside the bf16 weight. Its fake implementation
does not check, so tracing succeeds, and its kernel fails at run time ("expected m1 and m2
to have the same dtype, float != BFloat16").

The fix, here. A cast to a weight's host dtype that meets that weight (as fetched, or a
view or index of it, never re-cast) at one op is a candidate; the op is run once on fake
tensors, the weight in the compute dtype, under the autocast the trace uses, and if a
kernel that is not elementwise still receives two floating dtypes, the cast is rewritten to
the compute dtype for that op. That is the cast the model would have traced had its weights
been in the compute dtype, and it leaves every op autocast or promotion already reconciles
exactly as before: a dense model's graph, and every fp32 graph, come out unchanged.

Not covered, as the graph no longer holds what they read: a branch taken on `w.dtype` (dynamo
took the fp32 one), a factory given `dtype=w.dtype`, a cast that reaches the op through a
view, and an op that meets no weight (an attention kernel fed q, k, v cast to a projection's
dtype).

Why not otherwise. Tracing with the weights' fake values in the compute dtype is not open
to a backend: dynamo has traced, and branched on `w.dtype`, before megatrain sees the
graph. Rewriting every cast to fp32 that meets a weight would also turn upcasts made for
precision at elementwise ops (the RMSNorm's) into bf16, and change dense models' numerics.
Upcasting the weight instead would compute the op in fp32 from bf16 weights, in the memory
of fp32 weights.

The probe runs on the fake tensors' device type (the CPU, where dynamo traced) under that
device's autocast; the two autocasts agree on the matmul family, which is what decides.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from . import ops
from .fx_match import _new

_METHOD_DTYPES = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                  "bfloat16": torch.bfloat16}
_CONVERTING_METHODS = {"to", "type", "type_as", *_METHOD_DTYPES}
_CONVERTING_FUNCTIONS = {torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as}
# Kernels whose job is to take one dtype to another: mixed operands are their contract.
_CONVERSIONS = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default,
                torch.ops.aten.copy.default}


def _converts(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _CONVERTING_METHODS) \
        or (node.op == "call_function" and node.target in _CONVERTING_FUNCTIONS)


def cast_target(node: fx.Node) -> torch.dtype | None:
    """The floating dtype a cast converts to where the graph holds it as a constant
    (`x.to(dtype)`, `x.to(device, dtype)`, `x.to(dtype=...)`, `x.type(dtype)`, `x.float()`),
    else None."""
    if not _converts(node):
        return None
    if node.op == "call_method" and node.target in _METHOD_DTYPES:
        return _METHOD_DTYPES[node.target] if len(node.args) == 1 and not node.kwargs else None
    dtypes = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)]
    return dtypes[0] if len(dtypes) == 1 and dtypes[0].is_floating_point else None


def _value(node: fx.Node):
    """Dynamo's fake value of `node`; a fetch's is its parameter's (in the host dtype)."""
    if node.op == "call_function" and node.target is ops.FETCH:
        node = node.args[0]
    return node.meta.get("example_value", node.meta.get("val"))


def _has_float(value) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in pytree.tree_leaves(value))


def streamed_weights(graph: fx.Graph, params: list[torch.nn.Parameter],
                     compute_dtype: torch.dtype) -> dict[fx.Node, torch.dtype]:
    """Nodes that carry a weight in the compute dtype where dynamo saw its host dtype: each
    fetch of a parameter whose host dtype differs, and what is computed from such values
    alone (views, indexing, chunks, arithmetic with numbers) without a cast -> that host
    dtype."""
    weights: dict[fx.Node, torch.dtype] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is ops.FETCH:
            dtype = params[node.args[3]].dtype
            if dtype != compute_dtype:
                weights[node] = dtype
            continue
        if node.op not in ("call_function", "call_method") or _converts(node):
            continue
        floats = [n for n in node.all_input_nodes if n in weights or _has_float(_value(n))]
        hosts = {weights.get(n) for n in floats}
        if floats and len(hosts) == 1 and None not in hosts and _has_float(_value(node)):
            weights[node] = hosts.pop()
    return weights


class _MixedOperands(TorchDispatchMode):
    """Records the first kernel, other than an elementwise one or a conversion, that receives
    floating tensors of more than one dtype (seen after autocast, which sits above)."""

    def __init__(self):
        super().__init__()
        self.kernel = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        elementwise = torch.Tag.pointwise in getattr(func, "tags", ())
        if self.kernel is None and func not in _CONVERSIONS and not elementwise:
            dtypes = {t.dtype for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()}
            if len(dtypes) > 1:
                self.kernel = func
        return func(*args, **kwargs)


def _call(node: fx.Node, values: dict[fx.Node, object]):
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def _mixes_dtypes(user: fx.Node, weights: dict[fx.Node, torch.dtype],
                  compute_dtype: torch.dtype) -> bool:
    """Whether `user`, run on fake values with the streamed weights in the compute dtype and
    under the trace's autocast, hands some non-elementwise kernel two floating dtypes. False
    where the values are missing or the run fails before any such kernel."""
    values = {n: _value(n) for n in user.all_input_nodes}
    if any(v is None for v in values.values()):
        return False
    fakes = [t for t in pytree.tree_leaves(list(values.values())) if isinstance(t, FakeTensor)]
    modes = {id(t.fake_mode): t.fake_mode for t in fakes}
    if len(modes) != 1:
        return False
    (mode,) = modes.values()
    reduced = compute_dtype in (torch.bfloat16, torch.float16)
    autocast = (torch.autocast(fakes[0].device.type, dtype=compute_dtype) if reduced
                else contextlib.nullcontext())
    probe = _MixedOperands()
    try:
        with mode, torch.no_grad():
            for n in weights.keys() & values.keys():
                values[n] = pytree.tree_map_only(
                    torch.Tensor, lambda t: t.to(compute_dtype) if t.is_floating_point() else t, values[n])
            with autocast, probe:
                _call(user, values)
    except Exception:  # noqa: BLE001, S110 - a meta refusing the mix has left its record; else no answer
        pass
    return probe.kernel is not None


def _retargeted(cast: fx.Node, host: torch.dtype, compute_dtype: torch.dtype):
    """(op target, args, kwargs) of `cast` with its host dtype replaced by the compute dtype."""
    if cast.op == "call_method" and cast.target in _METHOD_DTYPES:
        return "to", (cast.args[0],), {"dtype": compute_dtype}

    def swap(a):
        return compute_dtype if isinstance(a, torch.dtype) and a == host else a

    return cast.target, fx.node.map_aggregate(cast.args, swap), fx.node.map_aggregate(cast.kwargs, swap)


def retarget_weight_casts(gm: fx.GraphModule, params: list[torch.nn.Parameter], compute_dtype: torch.dtype,
                          of_node: dict[fx.Node, int] | None = None) -> list[fx.Node]:
    """Rewrite, in the captured graph `gm`, each cast to a streamed weight's host dtype that
    meets the weight at an op nothing else reconciles (see the module docstring); the new
    cast feeds that op alone and takes its region. Returns the ops whose cast changed."""
    graph = gm.graph
    weights = streamed_weights(graph, params, compute_dtype)
    if not weights:
        return []
    changed = []
    for user in list(graph.nodes):
        if user.op not in ("call_function", "call_method") or user in weights or _converts(user) \
                or user.target is ops.FETCH:
            continue
        hosts = {weights[n] for n in user.all_input_nodes if n in weights}
        casts = [n for n in user.all_input_nodes if n not in weights and cast_target(n) in hosts]
        if not casts or not _mixes_dtypes(user, weights, compute_dtype):
            continue
        for cast in casts:
            target, args, kwargs = _retargeted(cast, cast_target(cast), compute_dtype)
            with graph.inserting_before(user):   # with its fake value: AOTAutograd's cache wants one
                new = _new(graph, cast.op, target, args, cast, kwargs)
            for key in ("custom", "nn_module_stack"):
                if key in user.meta:
                    new.meta[key] = dict(user.meta[key])
            if of_node is not None and user in of_node:
                of_node[new] = of_node[user]
            user.replace_input_with(cast, new)
            if not cast.users:
                if of_node is not None:
                    of_node.pop(cast, None)
                graph.erase_node(cast)
        changed.append(user)
    if changed:
        graph.lint()
        gm.recompile()
    return changed
