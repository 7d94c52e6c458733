"""Kernel lowering: swap eager LLM patterns in dynamo's graph for megatrain's Triton kernels.

Runs on the torch-level graph dynamo hands the backend, before capture re-homes it, so the
kernels become ordinary call_function nodes that capture, regions and AOTAutograd treat
like any torch op (their custom ops carry fakes and autograd formulas).

    x1 = x.float(); y = x1 * rsqrt(x1.pow(2).mean(-1, keepdim=True) + eps)
    out = w * y.to(x.dtype)                          ->  rms_norm(x, w, eps)
    q' = q*cos + cat(-q2, q1)*sin; k' = same for k   ->  q', k' = apply_rotary(q, k, cos, sin)
    out = silu(g) * u                                ->  swiglu(g, u)
    cross_entropy(linear(h, W).view(-1, V).float(), t, ignore_index=i, reduction=r)
                                                     ->  linear_cross_entropy(h, W, t, i, r)
        (the linear stays where its logits are also returned: Hugging Face's ForCausalLMLoss
        upcasts, shifts the labels and takes "sum" over num_items_in_batch, all matched;
        logits soft-capped as tanh(z / c) * c before it, Gemma 2's, fuse where only the
        loss reads them: linear_cross_entropy(h, W, t, i, r, softcap=c))

Matching is by hand, not torch.fx.subgraph_rewriter: dynamo spells one op several ways
(operator.mul / torch.mul / Tensor.mul, x.float() / x.to(torch.float32), chunk / slicing),
bakes eps, dtypes and sizes into the graph as constants, and a swap is exact only under
conditions a pattern graph cannot state: every intermediate feeds only the pattern, eps is
a plain number, shapes and dtypes are those the kernel computes. Whatever fails a condition
stays as written. New nodes take the meta (nn_module_stack, stack_trace, ...) of the node
whose value they replace, so regions put them in the module they came from, and a fresh
`example_value` computed under dynamo's fake mode.

Policy: a kernel slower than Inductor's own code for its pattern is not used by
default. `DEFAULT` is the set used when `enabled` is not given; trim it from the GPU
benchmark (bench/bench_kernels.py). The backend's own default is none (see DEFAULT's
comment), except the fused loss when the memory budget needs it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx

from megatrain.kernels.fused_linear_cross_entropy import (
    default_chunk_size,
    fused_linear_cross_entropy,
)
from megatrain.kernels.rmsnorm import MAX_HIDDEN, rms_norm
from megatrain.kernels.rope import apply_rotary
from megatrain.kernels.swiglu import swiglu

from .fx_match import (
    _VIEWS,
    _arg,
    _binary,
    _cast_dtype,
    _eq,
    _erase,
    _is_last_dim,
    _is_number,
    _kind,
    _new,
    _same_shape,
    _sole_user,
    _upcast_of,
    _val,
)

PATTERNS = ("rmsnorm", "rope", "swiglu", "linear_cross_entropy")
# The pass's own default (`enabled=None`), not the backend's. Standalone
# (bench/bench_kernels.py, forward+backward against Inductor), the kernels run about even
# with Inductor's code, rmsnorm a little faster; the fused linear-cross-entropy is about as
# fast (a little slower at a 128k vocabulary, a little faster at 32k) and peaks at ~4x less
# memory than eager at 128k.
# Decision: the backend applies none by default (options["kernels"] not given) until one is
# shown faster inside training, not only standalone: a standalone win like rmsnorm's can
# vanish when the custom op blocks Inductor's fusion with its neighbouring ops. The fused loss
# is applied automatically only when the memory budget needs it (backend.py: a graph whose plan
# does not fit gpu_memory is planned again with it).
DEFAULT: frozenset[str] = frozenset(PATTERNS)


# --- RMSNorm ------------------------------------------------------------------------------

def _match_rmsnorm(out: fx.Node):
    """out = w * normed(x), either order -> (x, w, eps, pattern nodes) or None."""
    pair = _binary(out, "mul")
    if pair is None:
        return None
    for w, y in (pair, pair[::-1]):
        body = _rms_body(y)
        if body is None or not isinstance(w, fx.Node):
            continue
        x, eps, nodes = body
        vx, vw, vo = _val(x), _val(w), _val(out)
        # weight [H] of x's dtype: the product neither broadcasts nor promotes.
        if vw is None or vo is None or vw.dim() != 1 or vw.dtype != vx.dtype \
                or not _eq(vw.shape[0], vx.shape[-1]) or not _same_shape(vo, vx) \
                or vo.dtype != vx.dtype:
            continue
        return x, w, eps, nodes
    return None


def _rms_body(y):
    """y = (x1 * rsqrt(mean(x1^2, -1, keepdim) + eps)).to(x.dtype) with x1 = x in fp32."""
    k = _kind(y)
    if k not in ("to", "type_as") or not y.args:
        return None
    scaled = y.args[0]
    pair = _binary(scaled, "mul")
    if pair is None or not _sole_user(scaled, y):
        return None
    for x1, rs in (pair, pair[::-1]):
        x = _upcast_of(x1)
        vx = _val(x)
        if vx is None or _kind(rs) != "rsqrt" or len(rs.args) != 1 or rs.kwargs:
            continue
        # The cast back restores x's dtype (HF: .to(input_dtype); Meta: .type_as(x)).
        back = _cast_dtype(y) if k == "to" else (vx.dtype if y.args[1:] == (x,) and not y.kwargs
                                                  else None)
        if back != vx.dtype or not vx.dtype.is_floating_point \
                or not isinstance(vx.shape[-1], int) or not 0 < vx.shape[-1] <= MAX_HIDDEN:
            continue
        inner = _rsqrt_arg(rs, x1, vx.dim())
        if inner is None:
            continue
        eps, square, nodes = inner
        if set(x1.users) != {square, scaled} or not _sole_user(rs, scaled):
            continue
        return x, float(eps), [x1, *nodes, rs, scaled, y]
    return None


def _rsqrt_arg(rs: fx.Node, x1: fx.Node, ndim: int):
    """rsqrt's argument mean(x1^2, -1, keepdim=True) + eps -> (eps, square, nodes) or None."""
    add = rs.args[0]
    pair = _binary(add, "add")
    if pair is None or not _sole_user(add, rs):
        return None
    for mean, eps in (pair, pair[::-1]):
        if not _is_number(eps) or eps < 0 or _kind(mean) != "mean" or not _sole_user(mean, add):
            continue
        if len(mean.args) > 3 or set(mean.kwargs) - {"dim", "keepdim"} \
                or not _is_last_dim(_arg(mean, 1, "dim"), ndim) \
                or _arg(mean, 2, "keepdim", False) is not True:
            continue
        square = mean.args[0]
        if not isinstance(square, fx.Node) or not _sole_user(square, mean):
            continue
        p = _binary(square, "pow")
        if (p is not None and p[0] is x1 and _is_number(p[1]) and p[1] == 2) \
                or _binary(square, "mul") == (x1, x1):
            return eps, square, [square, mean, add]
    return None


def _replace_rmsnorm(graph: fx.Graph) -> int:
    count = 0
    for out in list(graph.nodes):
        m = _match_rmsnorm(out)
        if m is None:
            continue
        x, w, eps, nodes = m
        with graph.inserting_before(out):
            new = _new(graph, "call_function", rms_norm, (x, w, eps), out)
        out.replace_all_uses_with(new)
        _erase(graph, [out, *nodes])
        count += 1
    return count


# --- rotary -------------------------------------------------------------------------------

def _halves(x1, x2):
    """(x, nodes) when x1, x2 are the first and second half of x's last dim, else None."""
    if _kind(x1) != "getitem" or _kind(x2) != "getitem":
        return None
    src1, i1 = x1.args
    src2, i2 = x2.args
    if _kind(src1) == "chunk" and src1 is src2 and (i1, i2) == (0, 1):
        x, vx = src1.args[0], _val(src1.args[0])
        if vx is not None and vx.dim() >= 1 and _arg(src1, 1, "chunks") == 2 and len(src1.args) <= 3 \
                and _is_last_dim(_arg(src1, 2, "dim", 0), vx.dim()) \
                and isinstance(vx.shape[-1], int) and vx.shape[-1] % 2 == 0 \
                and set(src1.users) == {x1, x2}:
            return x, [src1, x1, x2]
        return None
    vx = _val(src1)
    if src1 is not src2 or vx is None or vx.dim() < 1 or not isinstance(vx.shape[-1], int):
        return None
    half = vx.shape[-1] // 2
    if vx.shape[-1] % 2 == 0 and _last_dim_slice(i1, vx.dim()) in ((None, half), (0, half)) \
            and _last_dim_slice(i2, vx.dim()) in ((half, None), (half, vx.shape[-1])):
        return src1, [x1, x2]
    return None


def _last_dim_slice(index, ndim: int):
    """(start, stop) of `x[..., a:b]` or `x[:, :, a:b]` (full slices before it), else None."""
    if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice):
        return None
    lead, last = index[:-1], index[-1]
    full = slice(None, None, None)
    if lead not in ((Ellipsis,), (full,) * (ndim - 1)) or last.step not in (None, 1):
        return None
    return last.start, last.stop


def _rotate_half_of(cat):
    """cat((-x2, x1), dim=-1) of x's halves -> (x, nodes) or None."""
    if _kind(cat) != "cat" or len(cat.args) > 2 or set(cat.kwargs) - {"dim"}:
        return None
    parts = cat.args[0]
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    neg, x1 = parts
    if _kind(neg) != "neg" or len(neg.args) != 1 or neg.kwargs:
        return None
    found = _halves(x1, neg.args[0])
    if found is None:
        return None
    x, nodes = found
    if not _is_last_dim(_arg(cat, 1, "dim", 0), _val(x).dim()) or not _sole_user(neg, cat) \
            or not _sole_user(x1, cat) or not _sole_user(neg.args[0], neg):
        return None
    return x, [*nodes, neg, cat]


def _match_rotation(add: fx.Node):
    """add = x*cos + rotate_half(x)*sin (any operand order) -> (x, cos, sin, nodes) or None."""
    pair = _binary(add, "add")
    if pair is None:
        return None
    for plain, rotated in (pair, pair[::-1]):
        pm, rm = _binary(plain, "mul"), _binary(rotated, "mul")
        if pm is None or rm is None or not _sole_user(plain, add) or not _sole_user(rotated, add):
            continue
        for cat, sin in (rm, rm[::-1]):
            found = _rotate_half_of(cat) if isinstance(cat, fx.Node) else None
            if found is None or not _sole_user(cat, rotated):
                continue
            x, nodes = found
            for xx, cos in (pm, pm[::-1]):
                if xx is x and _rotary_tables_fit(x, cos, sin, add):
                    return x, cos, sin, [plain, rotated, *nodes]
    return None


def _rotary_tables_fit(x, cos, sin, add) -> bool:
    """x [B, H, S, D] and cos/sin broadcasting as the kernel reads them, no dtype change."""
    vx, vc, vs, vo = _val(x), _val(cos), _val(sin), _val(add)
    if vx is None or vc is None or vs is None or vo is None or vx.dim() != 4 \
            or not vx.dtype.is_floating_point or vc.requires_grad or vs.requires_grad \
            or not _same_shape(vc, vs) or not vc.dtype == vs.dtype == vx.dtype == vo.dtype \
            or not _same_shape(vo, vx):
        return False
    if vc.dim() == 4:  # [B or 1, 1, S, D], HF's cos.unsqueeze(1)
        lead = _eq(vc.shape[1], 1) and (_eq(vc.shape[0], 1) or _eq(vc.shape[0], vx.shape[0]))
    else:  # [S, D] or [1, S, D]
        lead = vc.dim() == 2 or (vc.dim() == 3 and _eq(vc.shape[0], 1))
    return lead and _eq(vc.shape[-2], vx.shape[2]) and _eq(vc.shape[-1], vx.shape[3])


def _replace_rope(graph: fx.Graph) -> int:
    """Pair rotations of one module sharing cos/sin (q and k) into one apply_rotary."""
    groups: dict[tuple, list] = {}
    for node in graph.nodes:
        m = _match_rotation(node)
        if m is not None:
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            module = str(stack[-1][0] if isinstance(stack[-1], tuple) else stack[-1]) if stack else None
            groups.setdefault((m[1], m[2], module), []).append((node, m))
    count = 0
    for rotations in groups.values():
        for a, b in zip(rotations[0::2], rotations[1::2]):
            count += _fuse_rotation_pair(graph, a, b)
    return count


def _fuse_rotation_pair(graph: fx.Graph, a, b) -> int:
    (qa, (q, cos, sin, q_nodes)), (ka, (k, _, _, k_nodes)) = a, b
    vq, vk = _val(q), _val(k)
    if vq.dtype != vk.dtype or not all(_eq(vq.shape[i], vk.shape[i]) for i in (0, 2, 3)):
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_input = max((q, k, cos, sin), key=order.__getitem__)
    anchor = min(qa, ka, key=order.__getitem__)
    if order[last_input] > order[anchor]:
        # q's rotation precedes k's projection: insert after k, if q's result waits that long.
        if any(order[u] <= order[last_input] for u in (*qa.users, *ka.users)):
            return 0
        anchor = last_input.next
    with graph.inserting_before(anchor):
        tables = [_as_3d(graph, t, qa) for t in (cos, sin)]
        rope = _new(graph, "call_function", apply_rotary, (q, k, *tables), qa)
        q_out = _new(graph, "call_function", operator.getitem, (rope, 0), qa)
        k_out = _new(graph, "call_function", operator.getitem, (rope, 1), ka)
    qa.replace_all_uses_with(q_out)
    ka.replace_all_uses_with(k_out)
    _erase(graph, [qa, *q_nodes, ka, *k_nodes])
    _erase(graph, [t for t in (cos, sin) if _kind(t) == "unsqueeze" and not t.users])
    return 1


def _as_3d(graph: fx.Graph, table: fx.Node, meta_from: fx.Node) -> fx.Node:
    """A [B, 1, S, D] table as the kernel's [B, S, D]: undo HF's unsqueeze(1), or squeeze."""
    if _val(table).dim() != 4:
        return table
    if _kind(table) == "unsqueeze" and len(table.args) + len(table.kwargs) == 2 \
            and _arg(table, 1, "dim") in (1, -3):
        return table.args[0]
    return _new(graph, "call_method", "squeeze", (table, 1), meta_from)


# --- SwiGLU -------------------------------------------------------------------------------

def _match_swiglu(out: fx.Node):
    """out = silu(g) * u, either order -> (g, u, silu node) or None."""
    pair = _binary(out, "mul")
    if pair is None:
        return None
    for act, up in (pair, pair[::-1]):
        if _kind(act) != "silu" or not _sole_user(act, out) or not isinstance(up, fx.Node) \
                or len(act.args) > 2 or set(act.kwargs) - {"inplace"} \
                or _arg(act, 1, "inplace", False) is not False:
            continue
        gate = act.args[0]
        vg, vu, vo = _val(gate), _val(up), _val(out)
        if vg is not None and vu is not None and vo is not None and vg.dtype.is_floating_point \
                and vg.dtype == vu.dtype == vo.dtype and _same_shape(vg, vu) \
                and _same_shape(vo, vg):
            return gate, up, act
    return None


def _replace_swiglu(graph: fx.Graph) -> int:
    count = 0
    for out in list(graph.nodes):
        m = _match_swiglu(out)
        if m is None:
            continue
        gate, up, act = m
        with graph.inserting_before(out):
            new = _new(graph, "call_function", swiglu, (gate, up), out)
        out.replace_all_uses_with(new)
        _erase(graph, [out, act])
        count += 1
    return count


# --- linear + cross-entropy ---------------------------------------------------------------

_CE_PARAMS = (("input", None), ("target", None), ("weight", None), ("size_average", None),
              ("ignore_index", -100), ("reduce", None), ("reduction", "mean"),
              ("label_smoothing", 0.0))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean",
                         softcap: float | None = None) -> torch.Tensor:
    """F.cross_entropy(F.linear(hidden, weight).view(-1, V).float(), labels) without logits;
    with `softcap`, of the logits capped to softcap * tanh(z / softcap) first (Gemma 2).

    Under autocast the lm_head matmul would run in the autocast dtype, so the kernel's does
    too. The cap is computed in fp32 (a model in bf16 computes it in bf16: the two differ by
    the capped logits' bf16 rounding). The chunk size depends on the vocabulary only: a
    dynamic token count is not specialised by the wrapper's token-count-based default.
    """
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    chunk = default_chunk_size(1 << 62, weight.shape[0], hidden.element_size())
    return fused_linear_cross_entropy(hidden, weight, labels, ignore_index, reduction, chunk, softcap)


def _match_linear_ce(ce: fx.Node):
    """cross_entropy over linear(h, W) through views/fp32 upcasts -> (args, nodes) or None."""
    if _kind(ce) != "cross_entropy" or len(ce.args) > len(_CE_PARAMS) \
            or set(ce.kwargs) - {name for name, _ in _CE_PARAMS}:
        return None
    a = {name: _arg(ce, i, name, d) for i, (name, d) in enumerate(_CE_PARAMS)}
    if a["weight"] is not None or a["size_average"] is not None or a["reduce"] is not None \
            or a["label_smoothing"] != 0 or a["reduction"] not in ("mean", "sum") \
            or not isinstance(a["ignore_index"], int) or isinstance(a["ignore_index"], bool):
        return None
    chain, user, n = [], ce, a["input"]
    while _kind(n) in (*_VIEWS, "float", "to") and _sole_user(n, user):
        k = _kind(n)
        if (k == "to" and _cast_dtype(n) != torch.float32) or (k == "float" and len(n.args) != 1) \
                or any(isinstance(v, torch.dtype) for v in (*n.args, *n.kwargs.values())
                       if k in _VIEWS):
            return None
        chain.append(n)
        user, n = n, n.args[0]
    softcap = None
    capped = _soft_cap(n, user)
    if capped is not None:
        softcap, cap_nodes, user, n = capped
        chain.extend(cap_nodes)
    if _kind(n) != "linear" or len(n.args) < 2 or _arg(n, 2, "bias") is not None:
        return None
    hidden, weight, target = n.args[0], n.args[1], a["target"]
    vh, vw, vi, vt, vce = (_val(v) for v in (hidden, weight, a["input"], target, ce))
    if any(v is None for v in (vh, vw, vi, vt, vce)) or vw.dim() != 2 or vh.dim() < 1 \
            or vh.dtype != vw.dtype or vi.dim() != 2 or not _eq(vi.shape[1], vw.shape[0]) \
            or vt.dim() != 1 or vt.dtype.is_floating_point or vce.dtype != torch.float32:
        return None
    # Logits the model also returns (Hugging Face's causal LMs do) are still computed for
    # that output, once, and not kept for the backward; the loss recomputes them in chunks.
    return (hidden, weight, target, a["ignore_index"], a["reduction"], softcap), \
        [n, *chain] if _sole_user(n, user) else chain


def _soft_cap(n: fx.Node, user: fx.Node):
    """`tanh(x / c) * c` (either operand order of the product, the same number c > 0, each
    node read by the next alone) -> (c, its nodes, the division, x), else None."""
    pair = _binary(n, "mul") if _sole_user(n, user) else None
    if pair is None:
        return None
    t, c = pair if _is_number(pair[1]) else pair[::-1]
    if not (_is_number(c) and c > 0 and _kind(t) == "tanh" and len(t.args) == 1 and not t.kwargs
            and _sole_user(t, n)):
        return None
    div = t.args[0]
    quotient = _binary(div, "div")
    if quotient is None or not _sole_user(div, t) or not _is_number(quotient[1]) or quotient[1] != c:
        return None
    return float(c), [n, t, div], div, quotient[0]


def _replace_linear_ce(graph: fx.Graph) -> int:
    count = 0
    for ce in list(graph.nodes):
        m = _match_linear_ce(ce)
        if m is None:
            continue
        args, nodes = m
        with graph.inserting_before(ce):
            new = _new(graph, "call_function", linear_cross_entropy, args, ce)
        ce.replace_all_uses_with(new)
        _erase(graph, [ce, *nodes])
        count += 1
    return count


def has_linear_cross_entropy(gm: fx.GraphModule) -> bool:
    """Whether `gm` has a linear + cross-entropy the fused loss would replace (read only)."""
    return any(_match_linear_ce(n) is not None for n in gm.graph.nodes)


def linear_ce_heads(gm: fx.GraphModule) -> list[tuple[fx.Node, object, object, object, torch.dtype]]:
    """Each linear + cross-entropy of `gm` the fused loss would replace, as (its product
    node, tokens, width, vocab, the cross-entropy's input dtype) (sizes symbolic where the
    graph's are; read only)."""
    heads = []
    for ce in gm.graph.nodes:
        m = _match_linear_ce(ce)
        if m is None:
            continue
        (hidden, weight, target, *_), _ = m
        product = next(u for u in hidden.users if _kind(u) == "linear" and u.args[1] is weight)
        heads.append((product, _val(target).shape[0], _val(hidden).shape[-1], _val(weight).shape[0],
                      _val(_arg(ce, 0, "input", None)).dtype))
    return heads


def head_logits_bytes(tokens: int, vocab: int, logits_dtype: torch.dtype, dtype: torch.dtype,
                      inductor: bool) -> int:
    """The least a plan without the fused loss holds at once for one loss head. Run as
    written (`inductor` False): the cross-entropy's [tokens, vocab] input and its gradient,
    each at least as wide as `dtype` (the fp32 upcast where the graph has one): the
    backward forms the gradient from the input's log-softmax, kept by the forward, as
    large. Lowered by Inductor: one [tokens, vocab] buffer no wider than the product's
    output in `dtype`, since Inductor folds the upcast into the kernels that read the
    logits and writes their gradient over them (op_costs.inplace_reuses)."""
    if inductor:
        return tokens * vocab * min(logits_dtype.itemsize, dtype.itemsize)
    return 2 * tokens * vocab * max(logits_dtype.itemsize, dtype.itemsize)


def unfused_logits_bytes(gm: fx.GraphModule, dtype: torch.dtype, inductor: bool = False) -> int:
    """head_logits_bytes of `gm`'s largest loss head; 0 where no loss matches or its sizes
    are symbolic (a bound must not guard on them)."""
    return max((head_logits_bytes(tokens, vocab, logits_dtype, dtype, inductor)
                for _, tokens, _, vocab, logits_dtype in linear_ce_heads(gm)
                if isinstance(tokens, int) and isinstance(vocab, int)), default=0)


def kernels_run_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device`: CUDA, or the CPU when megatrain.kernels
    was imported under TRITON_INTERPRET=1 (how CI runs them)."""
    from megatrain.kernels._common import is_interpreted
    from megatrain.kernels.fused_linear_cross_entropy import _ce_loss_grad_kernel

    return device.type == "cuda" or (device.type == "cpu" and is_interpreted(_ce_loss_grad_kernel))


# --- the pass -----------------------------------------------------------------------------

_REPLACERS = {"rmsnorm": _replace_rmsnorm, "rope": _replace_rope, "swiglu": _replace_swiglu,
              "linear_cross_entropy": _replace_linear_ce}


def replace_kernel_patterns(gm: fx.GraphModule, enabled: Iterable[str] | None = None
                            ) -> dict[str, int]:
    """Replace the enabled patterns in dynamo's graph `gm` in place; count the swaps.

    `enabled` names patterns from PATTERNS; None means DEFAULT (read at call time, so the
    benchmark-driven default can change without touching callers). RMSNorm runs first so a
    fused norm can feed the fused loss.
    """
    names = DEFAULT if enabled is None else ((enabled,) if isinstance(enabled, str) else tuple(enabled))
    unknown = sorted(set(names) - set(PATTERNS))
    if unknown:
        raise ValueError(f"unknown kernel pattern(s) {unknown}; choose from {list(PATTERNS)}")
    counts = {name: _REPLACERS[name](gm.graph) for name in PATTERNS if name in names}
    gm.graph.lint()
    gm.recompile()
    return counts
