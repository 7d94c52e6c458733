"""Materialise a transfer schedule as explicit FX nodes in a partitioned graph.

Before (forward or backward ATen graph, as the partitioner leaves it):
    w = megatrain.fetch(primals_3, 7, 2, 3)          # one per (parameter, region)
    mm = aten.mm(x, aten.t(w))
After:
    token = aten.empty([0], dtype=uint8, device=dev)
    megatrain.prefetch(token, [primals_3, primals_4], 7, 2)     # k regions ahead
    ...
    flat = megatrain.wait(token, 7, 2, 4224)
    w = aten.view(aten.slice(flat, 0, 0, 4096), [64, 64])
    mm = aten.mm(x, aten.t(w))
    megatrain.evict(token, flat, 7, 2)                           # after the last use
    megatrain.prefetch(token, [...], 7, 4)
    ...
    megatrain.drain(token, [grad_to_host outputs], 7)           # backward only, at the end
The token orders the transfer ops through every compiler stage; data edges order compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import operator

import torch
import torch.fx as fx

from ..runtime.layout import FlatLayout
from . import ops
from .schedule import RegionUse, Transfer, prefetch_schedule
from .sizes import tensor_nbytes


@dataclass
class ScheduledGraph:
    kind: str  # "forward" | "backward"
    region_order: list[int]
    transfers: list[Transfer]
    region_bytes: dict[int, int]
    prefetch_count: int = 0
    predicted_peak_bytes: int = 0
    events: list[str] = field(default_factory=list)


def _is_view(node: fx.Node) -> bool:
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return node.op == "call_function" and t.__name__ == "getitem" if callable(t) else False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in t._schema.returns)


def _alias_users(node: fx.Node) -> list[fx.Node]:
    """Every node that reads `node`'s memory: its users, and users of its views."""
    out, stack = [], [node]
    seen = set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            out.append(u)
            if _is_view(u):
                stack.append(u)
    return out


def _fake_mode(graph: fx.Graph):
    for n in graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch._subclasses.FakeTensor):
            return v.fake_mode
    return None


def insert_transfers(gm: fx.GraphModule, kind: str, streamer: int, slots: int,
                     device: torch.device, dtype: torch.dtype) -> ScheduledGraph:
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    fetches: dict[int, list[fx.Node]] = {}
    for n in nodes:
        if n.op == "call_function" and n.target is ops.FETCH:
            fetches.setdefault(n.args[2], []).append(n)

    layouts: dict[int, FlatLayout] = {}
    uses: list[RegionUse] = []
    for region, fs in fetches.items():
        layouts[region] = FlatLayout.of([f.meta["val"].shape for f in fs])
        readers = [u for f in fs for u in _alias_users(f)]
        last = max((pos[u] for u in readers), default=max(pos[f] for f in fs))
        uses.append(RegionUse(region, min(pos[f] for f in fs), last,
                              layouts[region].numel * dtype.itemsize))
    transfers = prefetch_schedule(uses, slots)
    sched = ScheduledGraph(kind, [u.region for u in sorted(uses, key=lambda u: u.first)], transfers,
                           {u.region: u.nbytes for u in uses})
    if not fetches and kind == "forward":
        return sched

    fake = _fake_mode(graph)
    placeholders = graph.find_nodes(op="placeholder")
    anchor0 = placeholders[-1] if placeholders else None
    with graph.inserting_after(anchor0) if anchor0 is not None else graph.inserting_before(nodes[0]):
        token = graph.call_function(torch.ops.aten.empty.memory_format, ([0],),
                                    {"dtype": torch.uint8, "device": device})
    with fake:
        token.meta["val"] = torch.empty(0, dtype=torch.uint8, device=device)

    flats: dict[int, fx.Node] = {}
    after_cursor: dict[int, fx.Node] = {-1: token}

    def place(t: Transfer, make) -> None:
        if t.after:
            anchor = after_cursor.get(t.anchor) or (token if t.anchor < 0 else nodes[t.anchor])
            with graph.inserting_after(anchor):
                n = make()
            after_cursor[t.anchor] = n
        else:
            with graph.inserting_before(nodes[t.anchor]):
                make()

    for t in transfers:
        fs = fetches[t.region]
        if t.kind == "prefetch":
            host = [f.args[0] for f in fs]
            place(t, lambda: graph.call_function(ops.PREFETCH, (token, host, streamer, t.region)))
            sched.prefetch_count += 1
        elif t.kind == "wait":
            lay = layouts[t.region]

            def make_wait():
                w = graph.call_function(ops.WAIT, (token, streamer, t.region, lay.numel))
                with fake:
                    w.meta["val"] = torch.empty(lay.numel, dtype=dtype, device=device)
                flats[t.region] = w
                return w

            place(t, make_wait)
            _replace_fetches(graph, fs, flats[t.region], lay, fake)
        else:
            place(t, lambda: graph.call_function(ops.EVICT, (token, flats[t.region], streamer, t.region)))
        sched.events.append(f"{t.kind}({t.region})")

    if kind == "backward":
        grads = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.GRAD_TO_HOST]
        grads += _handoff_tokens(graph)
        output = graph.find_nodes(op="output")[0]
        with graph.inserting_before(output):
            graph.call_function(ops.DRAIN, (token, grads, streamer))
        sched.events.append("drain")

    graph.lint()
    gm.recompile()
    sched.predicted_peak_bytes = simulate_peak(gm, device, sched)
    return sched


def _is_handoff(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is ops.GRAD_TO_OPTIMIZER:
        return True
    return getattr(n.target, "__name__", "") == "with_effects" and len(n.args) > 1 \
        and n.args[1] is ops.GRAD_TO_OPTIMIZER


def gradient_handoffs(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """(region, param_id) of every gradient the backward hands to megatrain.AdamW."""
    out = []
    for n in gm.graph.nodes:
        if _is_handoff(n):
            args = n.args if n.target is ops.GRAD_TO_OPTIMIZER else n.args[2:]
            out.append((args[2], args[3]))
    return out


def _handoff_tokens(graph: fx.Graph) -> list[fx.Node]:
    """The effect tokens out of each hand-off, so `drain` is ordered after all of them."""
    tokens = []
    for n in graph.nodes:
        if _is_handoff(n) and n.target is not ops.GRAD_TO_OPTIMIZER:
            tokens += [u for u in n.users if u.target is operator.getitem and u.args[1] == 0]
    return tokens


def _replace_fetches(graph: fx.Graph, fs: list[fx.Node], flat: fx.Node, lay: FlatLayout, fake) -> None:
    for f, off, shape in zip(fs, lay.offsets, lay.shapes):
        with graph.inserting_before(f):
            sl = graph.call_function(torch.ops.aten.slice.Tensor, (flat, 0, off, off + shape.numel()))
            view = graph.call_function(torch.ops.aten.view.default, (sl, list(shape)))
        with fake:
            sl.meta["val"] = flat.meta["val"][off:off + shape.numel()]
            view.meta["val"] = sl.meta["val"].view(shape)
        for key in ("nn_module_stack", "custom", "stack_trace"):
            if key in f.meta:
                view.meta[key] = f.meta[key]
        f.replace_all_uses_with(view)
        graph.erase_node(f)


def simulate_peak(gm: fx.GraphModule, device: torch.device, sched: ScheduledGraph) -> int:
    """Peak device bytes of the graph run in node order, frees at last use (no fusion credit).

    Region weights count from their prefetch; graph inputs on the device (saved
    activations) count from the start; outputs stay alive to the end.
    """
    nodes = list(gm.graph.nodes)
    last_use: dict[fx.Node, int] = {}
    base: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(nodes):
        if _is_view(n) and n.args and isinstance(n.args[0], fx.Node):
            base[n] = base.get(n.args[0], n.args[0])
        for a in n.all_input_nodes:
            b = base.get(a, a)
            last_use[b] = i
    output = nodes[-1]
    for a in output.all_input_nodes:
        last_use[base.get(a, a)] = len(nodes)

    def device_bytes(n: fx.Node) -> int:
        if n.op == "placeholder" and any(u.target in (ops.PREFETCH, ops.FETCH) for u in n.users):
            return 0  # a host parameter
        if n.target is ops.GRAD_TO_HOST:
            return 0  # lands in host memory
        v = n.meta.get("val")
        vals = v if isinstance(v, (list, tuple)) else [v]
        return sum(tensor_nbytes(x) for x in vals
                   if isinstance(x, torch.Tensor) and x.device.type == device.type)

    live = 0
    peak = 0
    frees: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            b = device_bytes(n)
        elif n.target is ops.PREFETCH:
            b = sched.region_bytes[n.args[3]]
            flat = next(u for u in nodes[i:] if u.target is ops.WAIT and u.args[2] == n.args[3])
            frees[last_use.get(flat, i)] = frees.get(last_use.get(flat, i), 0) + b
            live += b
            peak = max(peak, live)
            continue
        elif n.target is ops.WAIT or n in base or n.op == "output":
            b = 0
        else:
            b = device_bytes(n)
        live += b
        peak = max(peak, live)
        if b:
            end = last_use.get(n, i)
            frees[end] = frees.get(end, 0) + b
        live -= frees.pop(i, 0)
    return peak
