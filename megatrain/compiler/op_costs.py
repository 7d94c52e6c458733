"""What each unit of a graph asks of the device: matmul FLOPs and memory-bound traffic.

The cost model charges a unit's compute as `flops / rates.flops + traffic / rates.memory`:

- **FLOPs** of matmuls and attention, from torch's flop formulas (attention on the CPU
  and the fused linear-cross-entropy have none: counted here). Their operands' memory
  traffic hides under the arithmetic, so it is not counted again.
- **Traffic** of everything else that computes (norms, rotary, activations, residual
  adds, casts, softmax of the loss, their backwards): bytes read from and written to
  device memory. Inductor fuses each connected run of such ops into a few kernels that
  read their inputs once and write only what is read elsewhere, so the count follows
  that: per unit, memory-bound nodes connected through data edges (views are
  transparent) form one group, and a group moves the bytes of the tensors it reads from
  outside plus the bytes of its results read outside. Transfer ops (fetches, hand-offs,
  offloads) run on the copy engines and are the link's cost, not the device's.

Both are sympy expressions over the graph's symbolic dims, like every size the planner
reads.
"""

from __future__ import annotations

import functools
import operator

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils.flop_counter import flop_registry

from ..runtime.kernel_probe import KernelShape
from . import token_chunks

FUSED_LOSS = "megatrain::fused_linear_cross_entropy"  # by name: no Triton import here


def is_view(n: fx.Node) -> bool:
    t = n.target
    if t is operator.getitem:
        return True
    return isinstance(t, torch._ops.OpOverload) and _returns_a_view(t)


@functools.cache
def _returns_a_view(op: torch._ops.OpOverload) -> bool:
    """Whether `op` returns an alias of an input it does not write (its schema says so):
    read once per operator, since the planner asks for every node of every graph."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def flops(n: fx.Node):
    """FLOPs of one matmul-like node from torch's formulas (0 for everything else)."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return 0
    if t.name() == FUSED_LOSS:
        return _fused_loss_flops(n)
    chunked = token_chunks.profile_of(n)
    if chunked is not None:  # the forward, or the backward: one more forward, then twice its FLOPs
        profile, tokens, _ = chunked
        return (3 if t.name() == token_chunks.BACKWARD_OP else 1) * tokens * profile.flops_per_token
    formula = flop_registry.get(t.overloadpacket)
    vals = fx.node.map_aggregate((n.args, n.kwargs),
                                 lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a)
    if t.overloadpacket is torch.ops.aten._grouped_mm:
        return _grouped_mm_flops(vals[0][0], n.meta.get("val"))
    if formula is None:
        return _attention_flops(t, vals[0])
    try:
        return formula(*vals[0], out_val=n.meta.get("val"), **vals[1])
    except (TypeError, ValueError, AssertionError, IndexError):  # a formula that does not
        return 0  # know this overload's arguments: the op's time is not modelled


def _grouped_mm_flops(a: torch.Tensor, out: torch.Tensor):
    """aten._grouped_mm (a mixture of experts' products; torch's counter has no formula):
    every output element is one group's dot product over the contracted dim, so 2 x the
    output's elements x that dim; a 2D x 2D product splits the contracted dim between the
    groups (out [G, M, N]), so each output row of a group sums its share only."""
    if not isinstance(a, torch.Tensor) or not isinstance(out, torch.Tensor):
        return 0
    if a.dim() == 2 and out.dim() == 3:
        return 2 * out.shape[1] * out.shape[2] * a.shape[1]
    numel = 1
    for d in out.shape:
        numel *= d
    return 2 * numel * a.shape[-1]


def _attention_flops(t, args):
    """CPU attention kernels have no formula: 4 B H L S E forward, twice that backward."""
    name = t.overloadpacket.__name__
    if "scaled_dot_product" not in name and "attention" not in name:
        return 0
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if "backward" in name:
        tensors = tensors[1:]
    if len(tensors) < 3 or tensors[0].dim() != 4:
        return 0
    q, k = tensors[0], tensors[1]
    b, h, length, e = q.shape
    return (8 if "backward" in name else 4) * b * h * length * k.shape[-2] * e


_PRODUCTS = {"mm": ("mm", 0), "addmm": ("mm", 1), "bmm": ("bmm", 0)}


def kernel_shape(n: fx.Node) -> KernelShape | None:
    """What to time for a product or attention node at its shapes (runtime/kernel_probe.py),
    None for every other node and for shapes not known as numbers (symbolic dims)."""
    t = n.target
    if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return None
    name = t.overloadpacket.__name__
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in n.args]
    try:
        if name in _PRODUCTS:
            kind, first = _PRODUCTS[name]
            a, b = vals[first], vals[first + 1]
            return KernelShape(kind, (_ints(a.shape), _ints(b.shape)), _dtype(a),
                               (_transposed(a), _transposed(b)))
        if "scaled_dot_product" in name:
            backward = name.endswith("_backward")
            q, k = (vals[1], vals[2]) if backward else (vals[0], vals[1])
            args = dict(zip((arg.name for arg in t._schema.arguments), vals))
            causal = bool({**args, **n.kwargs}.get("is_causal", False))
            return KernelShape("sdpa", (_ints(q.shape), _ints(k.shape)), _dtype(q), (causal,), backward)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None  # arguments this reading does not know: charged at the probe's rate
    return None


def _ints(shape) -> tuple[int, ...]:
    if not all(isinstance(d, int) for d in shape):
        raise TypeError("a symbolic dim: not timed (reading its hint would add a guard)")
    return tuple(shape)


def _dtype(x: torch.Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


def _transposed(x: torch.Tensor) -> bool:
    """Whether the last two dims are swapped in memory (a t() view of a weight)."""
    return x.dim() >= 2 and x.stride(-2) == 1 and x.stride(-1) != 1


def _fused_loss_flops(n: fx.Node):
    """The fused linear-cross-entropy's three products per chunk: the logits, and (in the
    same call) the hidden states' and the head's gradients where asked for."""
    hidden, weight = n.args[0].meta["val"], n.args[1].meta["val"]
    need_gh, need_gw = bool(n.args[6]), bool(n.args[7])
    tokens, width = hidden.shape
    return 2 * tokens * width * weight.shape[0] * (1 + need_gh + need_gw)


def _fused_loss_traffic(n: fx.Node, nbytes):
    """Its logits chunk is written by the product, then read and overwritten with its
    gradient by the cross-entropy kernel: three passes over [tokens, vocab]."""
    hidden, weight = n.args[0].meta["val"], n.args[1].meta["val"]
    return 3 * nbytes(hidden.shape[0], weight.shape[0], itemsize=hidden.element_size())


def traffic(nodes: list[fx.Node], owner: dict[fx.Node, int], device: torch.device,
            expr) -> dict[int, object]:
    """Per unit, the bytes its memory-bound kernels move (module docstring). `owner`: the
    unit of each compute node; `expr`: a symbolic size as a sympy expression."""

    def nbytes(*shape, itemsize):
        out = sympy.Integer(itemsize)
        for s in shape:
            out *= expr(s)
        return out

    def tensor_bytes(n: fx.Node):
        v = n.meta.get("val")
        vals = v if isinstance(v, (list, tuple)) else [v]
        return sum((nbytes(*x.shape, itemsize=x.element_size()) for x in vals
                    if isinstance(x, torch.Tensor) and x.device.type == device.type),
                   sympy.Integer(0))

    def source(a: fx.Node) -> fx.Node:
        """The node whose kernel produced `a` (through views)."""
        while a.op == "call_function" and is_view(a) and a.args and isinstance(a.args[0], fx.Node):
            a = a.args[0]
        return a

    bound = [n for n in nodes if n in owner and memory_bound(n)]
    group = {n: n for n in bound}

    def find(n):
        while group[n] is not n:
            group[n] = group[group[n]]
            n = group[n]
        return n

    for n in bound:
        for a in n.all_input_nodes:
            s = source(a)
            if s in group and owner[s] == owner[n]:
                group[find(n)] = find(s)

    out: dict[int, object] = {}

    def add(u, v):
        out[u] = out.get(u, sympy.Integer(0)) + v

    read: set[tuple[fx.Node, fx.Node]] = set()
    for n in bound:
        g = find(n)
        for a in n.all_input_nodes:
            s = source(a)
            if (s in group and find(s) is g) or (g, a) in read:
                continue
            read.add((g, a))
            # a slice reads its own bytes, a broadcast (expand) its source's: the smaller
            add(owner[n], sympy.Min(tensor_bytes(a), tensor_bytes(s)))
        if _read_outside(n, g, group, find):
            add(owner[n], tensor_bytes(n))
    for n in nodes:
        if n in owner and n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and n.target.name() == FUSED_LOSS:
            add(owner[n], _fused_loss_traffic(n, nbytes))
        chunked = token_chunks.profile_of(n) if n in owner else None
        if chunked is not None:
            add(owner[n], _chunked_traffic(n, chunked))
    return out


def _chunked_traffic(n: fx.Node, chunked):
    """A token_chunks subgraph runs op by op, unfused: every intermediate is written and read
    once per forward; the backward runs the forward again, then twice its traffic."""
    profile, tokens, _ = chunked
    passes = 3 if n.target.name() == token_chunks.BACKWARD_OP else 1
    return passes * 2 * tokens * profile.bytes_per_token


def memory_bound(n: fx.Node) -> bool:
    """Whether `n` is work for a kernel Inductor generates: it computes (no view), with no
    matmul or attention (extern calls), transfer or other custom op."""
    if n.op != "call_function" or is_view(n):
        return False
    t = n.target
    if isinstance(t, torch._ops.OpOverload) and t.namespace == "megatrain":
        return False  # transfers (the link's), the fused loss (counted on its own)
    if getattr(t, "__name__", "") == "with_effects":
        return False  # an effectful custom op (a gradient hand-off)
    return not flops(n)


def _read_outside(n: fx.Node, g: fx.Node, group: dict, find) -> bool:
    """Whether a node outside `n`'s group (or the graph's output) reads `n`, through views."""
    todo = list(n.users)
    while todo:
        u = todo.pop()
        if u.op == "call_function" and is_view(u):
            todo.extend(u.users)
        elif u not in group or find(u) is not g:
            return True
    return False


# Inductor's rules for a pointwise result (torch._inductor.config, ir.StorageBox): with one
# reader it is computed inside the reader's loop unless its expression reads more than
# this many buffers ...
_INLINE_READS_ONE_READER = 8  # realize_acc_reads_threshold
# ... and with several readers (each recomputes it) unless it reads more than this many,
_INLINE_READS_SHARED = 4  # realize_reads_threshold
# or its expression has more ops than this, or, on the CPU only, it calls a transcendental
# (`should_realize_on_reuse`: a C++ loop recomputing one costs more than the bytes saved).
_INLINE_OPS_SHARED = 30  # realize_opcount_threshold
_HEAVY_ON_CPU = ("exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh")


def inlined(nodes: list[fx.Node], owner: dict[fx.Node, int], written: set[fx.Node] = frozenset(),
            cpu: bool = False) -> tuple[set[fx.Node], dict[fx.Node, int]]:
    """The pointwise nodes Inductor computes inside their readers' kernels and never writes
    to memory, and for each the position in `nodes` where it reads its inputs (its last
    reader's). Such a node is an aten op tagged pointwise whose every reader (through
    views) is memory-bound work of the same unit, and whose expression (itself and the
    inlined producers it pulls in) reads few enough buffers and is cheap enough to repeat in
    each reader (the thresholds above). What a matmul, attention, a transfer, a custom op, a
    graph output or another unit reads is written, so is every reduction's result, and so
    is what the caller knows is (`written`). `cpu`: Inductor's C++ kernels, which write
    a shared transcendental's result rather than recompute it."""
    out: set[fx.Node] = set()
    reads: dict[fx.Node, frozenset] = {}
    ops: dict[fx.Node, int] = {}
    heavy: dict[fx.Node, bool] = {}
    for n in nodes:
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) \
                or torch.Tag.pointwise not in t.tags or n not in owner:
            continue
        srcs, count, hot = set(), 1, cpu and t.overloadpacket.__name__ in _HEAVY_ON_CPU
        for a in n.all_input_nodes:
            s = _source(a)
            if _constant(s):
                continue  # a value Inductor writes into the expression, not a buffer it reads
            if s in out:
                srcs |= reads[s]
                count += ops[s]
                hot |= heavy[s]
            else:
                srcs.add(s)
        reading = readers(n)
        if not reading or not all(memory_bound(r) and owner.get(r) == owner[n] for r in reading):
            continue
        if len(reading) == 1:
            ok = len(srcs) <= _INLINE_READS_ONE_READER
        else:
            ok = len(srcs) <= _INLINE_READS_SHARED and count <= _INLINE_OPS_SHARED and not hot
        if ok and n not in written:
            out.add(n)
            reads[n], ops[n], heavy[n] = frozenset(srcs), count, hot
    pos = {n: i for i, n in enumerate(nodes)}
    reads_at: dict[fx.Node, int] = {}
    for n in reversed(nodes):
        if n in out:
            reads_at[n] = max(reads_at.get(r, len(nodes) if r.op == "output" else pos[r]) for r in readers(n))
    return out, reads_at


# Views that keep every element where it was (a reshape of contiguous memory): a kernel
# reading its input through them indexes it as it writes its output.
_ORDER_KEEPING_VIEWS = frozenset(
    getattr(packet, overload)
    for packet in (getattr(torch.ops.aten, name) for name in ("view", "_unsafe_view", "reshape", "squeeze",
                                                               "unsqueeze", "alias"))
    for overload in packet.overloads())


def inplace_reuses(nodes: list[fx.Node], owner: dict[fx.Node, int], inlined_nodes: set[fx.Node],
                   last_read: dict[fx.Node, int]) -> dict[fx.Node, fx.Node]:
    """The results Inductor writes into the buffer of an input its kernel is the last to
    read, each with that input (torch._inductor.scheduler `decide_inplace_update`, on by
    default, `config.inplace_buffers`; buffer reuse across kernels, which megatrain turns
    off, is another thing). So a loss's backward writes its [tokens, vocab] gradient over
    the logits it recomputed, and holds one such buffer, not two. Inductor's conditions,
    read off the FX graph and taken strictly (a reuse counted that Inductor does not make
    would under-count the step):
    - the result is a pointwise kernel's, not inlined into a reader;
    - the input is a matmul's or attention's (an extern kernel's output, surely written;
      no graph input, which Inductor never overwrites unless donated), of the same dtype
      and element count;
    - the kernel reads it only as it writes its result (directly, through inlined
      pointwise nodes and views that keep the element order: no transpose, no broadcast);
    - no node after the kernel reads it (`last_read`: the walk's last-reader positions,
      inlined readers at their kernels'), and every other kernel reading it (an inlined
      reader stands for the kernels computing it) is one the result depends on or an
      extern kernel before it: a sibling fused into the same kernel (SwiGLU's backward
      reads the gate projection for two results) keeps the input from being overwritten.
    One input serves one result."""
    pos = {n: i for i, n in enumerate(nodes)}
    taken: set[fx.Node] = set()
    out: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        t = n.target
        if n.op != "call_function" or n in inlined_nodes or n not in owner \
                or not isinstance(t, torch._ops.OpOverload) or torch.Tag.pointwise not in t.tags:
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for s, same_order in _kernel_reads(n, inlined_nodes).items():
            sval = s.meta.get("val")
            if not (same_order and s not in taken and last_read.get(s) == pos[n] and isinstance(sval, torch.Tensor)
                    and s.op == "call_function" and not is_view(s) and flops(s)
                    and sval.dtype == val.dtype and statically_known_true(sval.numel() == val.numel())):
                continue
            kernels = _reading_kernels(s, inlined_nodes)
            before = _ancestors(n, min(pos[k] for k in kernels), pos)
            if all(k is n or k in before or (not memory_bound(k) and pos[k] < pos[n]) for k in kernels):
                out[n] = s
                taken.add(s)
                break
    return out


def _reading_kernels(s: fx.Node, inlined_nodes: set[fx.Node]) -> set[fx.Node]:
    """The nodes whose kernels read `s`: its readers (through views), a reader Inductor
    inlines standing for the kernels that compute it (the graph's output node included)."""
    out: set[fx.Node] = set()
    todo = list(readers(s))
    while todo:
        r = todo.pop()
        if r in inlined_nodes:
            todo.extend(readers(r))
        else:
            out.add(r)
    return out


def _ancestors(n: fx.Node, since: int, pos: dict[fx.Node, int]) -> set[fx.Node]:
    """The nodes at or after position `since` that `n` depends on."""
    seen: set[fx.Node] = set()
    todo = list(n.all_input_nodes)
    while todo:
        a = todo.pop()
        if a not in seen and pos.get(a, -1) >= since:
            seen.add(a)
            todo.extend(a.all_input_nodes)
    return seen


def _kernel_reads(n: fx.Node, inlined_nodes: set[fx.Node]) -> dict[fx.Node, bool]:
    """The buffers `n`'s kernel reads (through views and the inlined nodes it computes),
    each with whether every read indexes it in the order `n` is written."""
    out: dict[fx.Node, bool] = {}
    todo = [(a, True) for a in n.all_input_nodes]
    while todo:
        a, ok = todo.pop()
        while a.op == "call_function" and is_view(a) and a.args and isinstance(a.args[0], fx.Node):
            ok = ok and a.target in _ORDER_KEEPING_VIEWS
            a = a.args[0]
        if a in inlined_nodes:
            todo.extend((x, ok and _same_shape(x, a)) for x in a.all_input_nodes)
        else:
            out[a] = out.get(a, True) and ok
    return out


def _same_shape(x: fx.Node, y: fx.Node) -> bool:
    """`x` feeds `y` element by element (no broadcast), as far as their shapes say."""
    a, b = x.meta.get("val"), y.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() \
        and all(statically_known_true(i == j) for i, j in zip(a.shape, b.shape))


# Ops that make a tensor from scalars alone: Inductor lowers them to a constant expression
# inside each reader, so they are no buffer read.
_CONSTANTS = (torch.ops.aten.scalar_tensor.default, torch.ops.aten.full.default,
              torch.ops.aten.zeros.default, torch.ops.aten.ones.default)


def _constant(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in _CONSTANTS and not n.all_input_nodes


def _source(a: fx.Node) -> fx.Node:
    """The node whose kernel produced `a` (through views)."""
    while a.op == "call_function" and is_view(a) and a.args and isinstance(a.args[0], fx.Node):
        a = a.args[0]
    return a


def readers(n: fx.Node) -> set[fx.Node]:
    """The nodes that read `n`'s values, through views (the graph's output included)."""
    out, todo = set(), list(n.users)
    while todo:
        u = todo.pop()
        if u.op == "call_function" and is_view(u):
            todo.extend(u.users)
        else:
            out.add(u)
    return out
