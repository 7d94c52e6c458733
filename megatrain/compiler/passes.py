"""Materialise the planner's transfer schedule as explicit FX nodes in a partitioned graph.

Before (forward or backward ATen graph, as the partitioner leaves it):
    w = megatrain.fetch(primals_3, 7, 2, 3)          # one per (parameter, region)
    mm = aten.mm(x, aten.t(w))
After (each planned Transfer, in the planner's order, at its anchor):
    token = aten.empty([0], dtype=uint8, device=dev)
    megatrain.begin_step(token, 7)                             # forward only: a step starts
    megatrain.prefetch(token, [primals_3, primals_4], 7, 2)     # k regions ahead
    ...
    flat = megatrain.wait(token, 7, 2, 4224)
    w = aten.view(aten.slice(flat, 0, 0, 4096), [64, 64])
    mm = aten.mm(x, aten.t(w))
    megatrain.evict(token, flat, 7, 2)                           # after the last use
                                                  # (megatrain.keep: the plan keeps it for
                                                  # the backward, where megatrain.claim
                                                  # takes it just before the wait)
    megatrain.prefetch(token, [...], 7, 4)
    ...
    megatrain.prefetch_next(token, 7, "forward")               # after the last region's wait
    megatrain.drain(token, [grad_to_host outputs], 7)           # backward only, at the end
Each planner region streams one flat buffer: the fetches the planner grouped under it
(`groups`: fetch node name -> planner region; by default each fetch's own region). The
token orders the transfer ops through every compiler stage; data edges order compute.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..memory.layout import FlatLayout
from . import ops
from ..plan.events import Transfer


@dataclass
class ScheduledGraph:
    kind: str  # "forward" | "backward"
    prefetch_count: int = 0
    events: list[str] = field(default_factory=list)  # "prefetch(3)", ..., "drain"


def insert_transfers(gm: fx.GraphModule, kind: str, streamer: int, transfers: list[Transfer],
                     groups: dict[str, int] | None, device: torch.device,
                     dtype: torch.dtype, offloaded: dict[int, list[tuple[str, int]]] | None = None
                     ) -> ScheduledGraph:
    """Insert `transfers` (anchored to positions in `gm`'s current node list) into `gm`.
    `offloaded`: per planner region whose boundary outputs the plan parks in host memory,
    (saved tensor's node name, key) pairs: the forward node that makes it, the backward
    placeholder that receives it."""
    graph = gm.graph
    nodes = list(graph.nodes)
    fetches: dict[int, list[fx.Node]] = {}
    for n in nodes:
        if n.op == "call_function" and n.target is ops.FETCH:
            fetches.setdefault(groups[n.name] if groups is not None else n.args[2], []).append(n)
    by_name = {n.name: n for n in nodes}
    sched = ScheduledGraph(kind)
    layouts = {r: FlatLayout.of([f.meta["val"].shape for f in fs]) for r, fs in fetches.items()}

    fake = _fake_mode(graph)
    placeholders = graph.find_nodes(op="placeholder")
    anchor0 = placeholders[-1] if placeholders else None
    with graph.inserting_after(anchor0) if anchor0 is not None else graph.inserting_before(nodes[0]):
        token = graph.call_function(torch.ops.aten.empty.memory_format, ([0],),
                                    {"dtype": torch.uint8, "device": device})
    with fake:
        token.meta["val"] = torch.empty(0, dtype=torch.uint8, device=device)
    if kind == "forward":  # every forward starts a step, with or without transfers
        with graph.inserting_after(token):
            begin = graph.call_function(ops.BEGIN_STEP, (token, streamer))
        after_cursor_start = begin
    else:
        after_cursor_start = token

    flats: dict[int, fx.Node] = {}
    prefetched: set[int] = set()
    after_cursor: dict[int, fx.Node] = {-1: after_cursor_start}

    def place(t: Transfer, make) -> None:
        if t.after:
            anchor = after_cursor.get(t.anchor) or (after_cursor_start if t.anchor < 0 else nodes[t.anchor])
            with graph.inserting_after(anchor):
                n = make()
            after_cursor[t.anchor] = n
        else:
            with graph.inserting_before(nodes[t.anchor]):
                make()

    def wait(region: int):
        lay = layouts[region]
        w = graph.call_function(ops.WAIT, (token, streamer, region, lay.numel))
        with fake:
            w.meta["val"] = torch.empty(lay.numel, dtype=dtype, device=device)
        flats[region] = w
        return w

    for t in transfers:
        region = t.region
        if t.kind in ops.ACTIVATION_OPS:
            op = ops.ACTIVATION_OPS[t.kind]
            for name, key in (offloaded or {})[region]:  # one op per saved tensor, in order
                place(t, lambda: graph.call_function(op, (token, by_name[name], streamer, key)))
            sched.events.append(f"{t.kind}({region})")
            continue
        fs = fetches[region]
        if t.kind == "prefetch":
            host = [f.args[0] for f in fs]
            place(t, lambda: graph.call_function(ops.PREFETCH, (token, host, streamer, region)))
            prefetched.add(region)
            sched.prefetch_count += 1
        elif t.kind == "wait":
            if region not in prefetched:  # a backward region whose forward kept its weights
                host = [f.args[0] for f in fs]
                place(t, lambda: graph.call_function(ops.CLAIM, (token, host, streamer, region)))
                sched.events.append(f"claim({region})")
            place(t, lambda: wait(region))
            _replace_fetches(graph, fs, flats[region], layouts[region], fake)
        elif t.kind == "evict":
            place(t, lambda: graph.call_function(ops.EVICT, (token, flats[region], streamer, region)))
        elif t.kind == "keep":
            place(t, lambda: graph.call_function(ops.KEEP, (token, flats[region], streamer, region)))
        else:
            raise ValueError(f"insert_transfers materialises prefetch/wait/evict/keep, not {t.kind!r}")
        sched.events.append(f"{t.kind}({region})")
    left = [r for r, fs in fetches.items() if r not in flats]
    if left:
        raise AssertionError(f"the schedule never waits for regions {left} of the {kind} graph")
    for fs in fetches.values():  # only now: anchors are positions in the original node list
        for f in fs:
            graph.erase_node(f)
    if flats:  # once the last region is resident, the next graph's first may start moving
        last = max(flats.values(), key=list(graph.nodes).index)
        with graph.inserting_after(last):
            graph.call_function(ops.PREFETCH_NEXT, (token, streamer, kind))
        sched.events.append("prefetch_next")

    if kind == "backward":
        grads = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.GRAD_TO_HOST]
        grads += _handoff_tokens(graph)
        output = graph.find_nodes(op="output")[0]
        with graph.inserting_before(output):
            graph.call_function(ops.DRAIN, (token, grads, streamer))
        sched.events.append("drain")

    graph.lint()
    gm.recompile()
    return sched


def _fake_mode(graph: fx.Graph):
    for n in graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch._subclasses.FakeTensor):
            return v.fake_mode
    return None


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
    """Each fetch becomes a view of the flat buffer, made right after its wait (a fetch may
    sit before the wait: the planner places a region's weights where they are read)."""
    cursor = flat
    for f, off, shape in zip(fs, lay.offsets, lay.shapes):
        with graph.inserting_after(cursor):
            sl = graph.call_function(torch.ops.aten.slice.Tensor, (flat, 0, off, off + shape.numel()))
        with graph.inserting_after(sl):
            view = graph.call_function(torch.ops.aten.view.default, (sl, list(shape)))
        cursor = view
        with fake:
            sl.meta["val"] = flat.meta["val"][off:off + shape.numel()]
            view.meta["val"] = sl.meta["val"].view(shape)
        for key in ("nn_module_stack", "custom", "stack_trace"):
            if key in f.meta:
                view.meta[key] = f.meta[key]
        f.replace_all_uses_with(view)
