"""Token-wise modules run a chunk of tokens at a time: the pass that finds and swaps them.

A long sequence's step peaks in one layer's backward, and there the MLP's up-projections
(several times the hidden width) dominate. A module is *token-wise* when every row of its
output depends only on the same row of its one input: linear layers of parameters,
elementwise ops with scalars or per-feature parameters, reductions over the last dim.
Such a module's work splits over the tokens without changing what it computes, so it can
be swapped for `megatrain::token_chunks` (runtime/token_chunks.py), which keeps one
chunk's intermediates at a time and recomputes them in the backward.

Runs on dynamo's graph before capture, like the kernel swaps (fusions.py): the new node is
an ordinary call_function (and a getitem per output) that regions, AOTAutograd and the
planner see like any op. Groups are chosen per module of the model (nn_module_stack),
outermost first, by what their ops do, never by name: an attention module fails the test
(its rows mix); an MLP passes (a linear wider than its input), taking in the norm that
feeds it alone; a norm computing in fp32 (intermediates twice its input's bytes) passes,
taking in the modules that read it alone (the attention's q, k, v projections, the
lm_head). The backend applies chunks only when a step does not fit otherwise
(backend.py), since the backward then runs each group's forward once more.

`PROFILES` keeps what the planner needs of each swapped subgraph: its matmul FLOPs per
token and its intermediates' bytes per token (op_costs.py, problem.py).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from ..runtime import token_chunks as op
from .sizes import hint, tensor_nbytes

OP = "megatrain::token_chunks"
BACKWARD_OP = "megatrain::token_chunks_backward"
# A chunk holds this many tokens at least (smaller ones leave the matmuls starved).
MIN_CHUNK = 256


@dataclass(frozen=True)
class Profile:
    flops_per_token: int  # the subgraph's matmul FLOPs per token, forward
    bytes_per_token: int  # its intermediates' bytes per token (not its output), all of them


PROFILES: dict[str, Profile] = {}

_LINEAR = {F.linear, torch._C._nn.linear}
_ELEMENTWISE_FUNCTIONS = {
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
    torch.mul, torch.add, torch.sub, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt,
    torch.exp, torch.tanh, torch.sigmoid, torch.abs, torch.square,
    F.silu, F.gelu, F.relu, F.sigmoid, F.tanh, torch._C._nn.silu, torch._C._nn.gelu, torch.relu,
}
_ELEMENTWISE_METHODS = {
    "float", "half", "bfloat16", "type_as", "contiguous",
    "mul", "add", "sub", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "tanh", "sigmoid", "abs",
    "square", "__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__rsub__",
    "__truediv__", "__neg__", "__pow__",
}
_REDUCTIONS = {"mean", "sum", "amax"}


def _val(n) -> torch.Tensor | None:
    v = n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _stack(n: fx.Node) -> list[str]:
    """The module paths `n` was traced inside, outermost first."""
    return [path for path, _ in (n.meta.get("nn_module_stack") or {}).values()]


def _tokens(v: torch.Tensor):
    return math.prod(v.shape[:-1])


def _same(a, b) -> bool:
    return statically_known_true(a == b)


def _is_cast(n: fx.Node) -> bool:
    """`t.to(dtype)` / `t.to(dtype=...)`: a cast, not a move."""
    if n.op != "call_method" or n.target != "to":
        return False
    args, kwargs = n.args[1:], dict(n.kwargs)
    return (len(args) == 1 and not kwargs and isinstance(args[0], torch.dtype)) or \
        (not args and set(kwargs) == {"dtype"} and isinstance(kwargs["dtype"], torch.dtype))


def _reduces_last(n: fx.Node, rank: int) -> bool:
    """`t.mean(-1, keepdim=True)` and kin (sum, amax): a reduction over the features only."""
    if n.op != "call_method" or n.target not in _REDUCTIONS:
        return False
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    return isinstance(dim, int) and dim in (-1, rank - 1) and keep is True and \
        set(n.kwargs) <= {"dim", "keepdim"}


class _Group:
    """Nodes of one module (or of a module and those it feeds or is fed by alone), in graph
    order, and whether they form a token-wise subgraph of one input."""

    def __init__(self, nodes: list[fx.Node], params: set[fx.Node]):
        self.nodes, self.params = nodes, params
        inside = set(nodes)
        ext = {a for n in nodes for a in n.all_input_nodes if a not in inside}
        self.inputs = [a for a in ext if a not in params]
        self.used_params = sorted((a for a in ext if a in params), key=lambda p: p.name)
        self.outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        # nodes that read only parameters (and such nodes): vectors over the features,
        # like Gemma's 1 + w (graph order: a node's inputs come before it)
        self.per_feature: set[fx.Node] = set()
        for n in nodes:
            if n.all_input_nodes and all(a in params or a in self.per_feature for a in n.all_input_nodes):
                self.per_feature.add(n)

    def of_one_input(self) -> bool:
        """One activation input, and outputs that keep its token dims."""
        if len(self.inputs) != 1 or not self.outputs:
            return False
        x = _val(self.inputs[0])
        if x is None or x.dim() < 2 or free_unbacked_symbols(x.shape):
            return False
        for out in self.outputs:
            y = _val(out)
            if y is None or y.dim() != x.dim() or not all(_same(a, b) for a, b in zip(x.shape[:-1], y.shape[:-1])):
                return False
        return True

    def token_wise(self) -> bool:
        x = _val(self.inputs[0])
        rows, rank = x.shape[:-1], x.dim()
        for n in self.nodes:
            v = _val(n)
            if v is None:
                return False
            if n in self.per_feature:
                if v.dim() > 1 or not self._row_local(n, rank):
                    return False
                continue
            if v.dim() != rank or not all(_same(a, b) for a, b in zip(v.shape[:-1], rows)):
                return False
            if not self._row_local(n, rank):
                return False
        return True

    def _row_local(self, n: fx.Node, rank: int) -> bool:
        if n.op == "call_function" and n.target in _LINEAR:
            weight = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
            bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
            return weight in self.params and (bias is None or bias in self.params)
        if n.op == "call_function" and n.target in _ELEMENTWISE_FUNCTIONS:
            pass
        elif n.op == "call_method" and (n.target in _ELEMENTWISE_METHODS or _is_cast(n)):
            pass
        elif _reduces_last(n, rank):
            return True
        else:
            return False
        # an operand is a row of the input's rows, a per-feature vector or a number
        for a in n.all_input_nodes:
            if (a in self.params or a in self.per_feature) and _val(a) is not None and _val(a).dim() > 1:
                return False
        return all(isinstance(a, (fx.Node, int, float, bool, torch.dtype, str, type(None)))
                   for a in list(n.args) + list(n.kwargs.values()))

    def expands(self) -> bool:
        """Whether a linear inside it (not an output: those are kept whole anyway) is wider
        than its input: the intermediates chunking saves."""
        width = _val(self.inputs[0]).shape[-1]
        return any(n.op == "call_function" and n.target in _LINEAR and n not in self.outputs
                   and not statically_known_true(_val(n).shape[-1] <= width) for n in self.nodes)

    def widens(self) -> bool:
        """Whether its intermediates hold at least twice its input's bytes per token (a norm
        that computes in fp32 from bf16 hidden states)."""
        x = _val(self.inputs[0])
        per_token = sum(_val(n).shape[-1] * _val(n).element_size() for n in self.nodes if n not in self.outputs)
        return not statically_known_true(per_token < 2 * x.shape[-1] * x.element_size())


def _profile(m: _Group) -> Profile:
    tokens = max(hint(_tokens(_val(m.inputs[0]))), 1)
    flops = 0
    nbytes = 0
    for n in m.nodes:
        v = _val(n)
        if n not in m.outputs:
            nbytes += tensor_nbytes(v)
        if n.op == "call_function" and n.target in _LINEAR:
            w = _val(n.args[1] if len(n.args) > 1 else n.kwargs["weight"])
            flops += 2 * w.shape[0] * w.shape[1]
    return Profile(flops, -(-nbytes // tokens))


def chunk_tokens(tokens: int, x_bytes_per_token: int, profile: Profile) -> int:
    """Tokens per chunk: one chunk's intermediates about the size of the module's whole
    input, in multiples of MIN_CHUNK; `tokens` itself where that is no smaller."""
    chunk = tokens * x_bytes_per_token // max(profile.bytes_per_token, 1)
    chunk = max(MIN_CHUNK, chunk // MIN_CHUNK * MIN_CHUNK)
    return min(chunk, tokens)


def _extract(m: _Group) -> fx.GraphModule:
    """The module's nodes as a GraphModule of (input, *parameters) -> [outputs]."""
    g = fx.Graph()
    env = {m.inputs[0]: g.placeholder("x")}
    for i, p in enumerate(m.used_params):
        env[p] = g.placeholder(f"p{i}")
    for n in m.nodes:
        env[n] = g.node_copy(n, env.__getitem__)
        env[n].meta = {}
    g.output([env[out] for out in m.outputs])
    return fx.GraphModule(torch.nn.Module(), g)


def _modules(gm: fx.GraphModule) -> list[str]:
    """Every module path of the graph's compute nodes, outermost first."""
    seen: dict[str, int] = {}
    for n in gm.graph.nodes:
        for depth, path in enumerate(_stack(n)):
            seen.setdefault(path, depth)
    return sorted(seen, key=lambda p: (seen[p], p))


def _nodes_of(gm: fx.GraphModule, path: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and path in _stack(n)]


def _with_its_feeder(gm: fx.GraphModule, m: _Group, params: set[fx.Node], order: dict) -> _Group:
    """`m` and the module that computes its input for it alone, where the two together are
    still token-wise of one input (the norm before an MLP: its fp32 intermediates are as
    wide as the hidden states, and chunked with the MLP they never exist whole); else `m`."""
    x = m.inputs[0]
    stack = _stack(x) if x.op in ("call_function", "call_method") else []
    if not stack or not set(x.users) <= set(m.nodes):
        return m
    feeder = _nodes_of(gm, stack[-1])
    if set(feeder) & set(m.nodes):  # x's module holds m (x is computed inside the layer holding it)
        return m
    merged = _Group(sorted(feeder + m.nodes, key=order.__getitem__), params)
    return merged if merged.of_one_input() and len(merged.outputs) == 1 and merged.token_wise() else m


def _with_its_readers(gm: fx.GraphModule, m: _Group, params: set[fx.Node], order: dict) -> _Group:
    """`m` (of one output) and every module that reads its output, where each reads
    nothing else and all together are token-wise of one input (the norm before attention
    and the q, k, v projections that read it: the normed states then never exist whole,
    and q, k, v come out of one op); else `m`."""
    (y,) = m.outputs
    merged = list(m.nodes)
    for user in y.users:
        stack = _stack(user)
        if not stack or user in m.nodes:
            return m
        reader = _nodes_of(gm, stack[-1])
        if set(reader) & set(m.nodes):  # y's reader holds m: nothing to take in
            return m
        merged += [n for n in reader if n not in merged]
    wider = _Group(sorted(merged, key=order.__getitem__), params)
    return wider if wider.of_one_input() and wider.token_wise() else m


def _swap(gm: fx.GraphModule, m: _Group, order: dict, chunk: int, profile: Profile) -> None:
    """Replace `m`'s nodes in `gm` by one token_chunks call and a getitem per output."""
    key = op.register(_extract(m))
    PROFILES[key] = profile
    first = min(m.nodes, key=order.__getitem__)
    with gm.graph.inserting_before(first):
        call = gm.graph.call_function(op.run_in_chunks, (m.inputs[0], list(m.used_params), key, chunk))
        call.meta = dict(m.outputs[0].meta)
        call.meta["example_value"] = [_val(out) for out in m.outputs]
        for i, out in enumerate(m.outputs):
            item = gm.graph.call_function(operator.getitem, (call, i))
            item.meta = dict(out.meta)
            out.replace_all_uses_with(item)
    for n in sorted(m.nodes, key=order.__getitem__, reverse=True):
        gm.graph.erase_node(n)


def chunk_token_wise_modules(gm: fx.GraphModule, params: set[fx.Node]) -> int:
    """Swap every token-wise module of dynamo's graph `gm` whose intermediates outgrow
    its input (an MLP with the norm that feeds it; a norm computing in fp32 with the
    projections that read it) for `megatrain::token_chunks`, in place; the count swapped.
    `params`: the placeholders that are the model's parameters."""
    count = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for path in _modules(gm):  # a swapped module's own modules have no nodes left
        nodes = _nodes_of(gm, path)
        if not nodes:
            continue
        m = _Group(nodes, params)
        if not (m.of_one_input() and m.token_wise()):
            continue
        if m.expands():
            m = _with_its_feeder(gm, m, params, order)
        elif len(m.outputs) == 1 and m.widens():
            m = _with_its_readers(gm, m, params, order)
        else:
            continue
        x = _val(m.inputs[0])
        tokens, profile = hint(_tokens(x)), _profile(m)
        chunk = chunk_tokens(tokens, x.shape[-1] * x.element_size(), profile)
        if chunk >= tokens:
            continue
        _swap(gm, m, order, chunk, profile)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}  # the swap's new nodes included
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def profile_of(n: fx.Node) -> tuple[Profile, object, int] | None:
    """(profile, tokens, chunk) of a token_chunks node (forward or backward) of an
    AOTAutograd graph, None for any other node."""
    t = n.target
    if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t.name() not in (OP, BACKWARD_OP):
        return None
    backward = t.name() == BACKWARD_OP
    x = (n.args[1] if backward else n.args[0]).meta["val"]
    key, chunk = (n.args[3], n.args[4]) if backward else (n.args[2], n.args[3])
    profile = PROFILES.get(key)
    return None if profile is None else (profile, _tokens(x), int(chunk))


__all__ = ["BACKWARD_OP", "OP", "PROFILES", "Profile", "chunk_token_wise_modules", "chunk_tokens",
           "profile_of"]
