"""The planner's `Problem`, read off the partitioned forward and backward FX graphs.

    regions      every graph region with nodes (its tag, or the span an untagged node sits
                 in); regions whose node spans interleave in either graph (a module called
                 at two places) form one planner region, a *unit*, streamed together
    weights      one per parameter, its padded flat bytes in the compute dtype (tied weights
                 are shared by the units that fetch them; the backward fetches may be fewer);
                 on the link, the master's dtype (the device casts) and fp32 gradients
    out_bytes    the activations a unit saves for the backward (returned values live to the
                 forward's end, in the working sets; their gradients from the backward's start)
    work_fw/bw   peak transient bytes while a unit runs: a liveness walk of the graph
                 without weights and saved outputs (planner buffers); a weight gradient
                 counts until the hand-off after its own (the runtime frees finished
                 copies there), so the planner holds no whole-region gradient buffer; on
                 CUDA at fp32 size (it leaves from an fp32 snapshot). With `inductor`, without
                 the pointwise results Inductor computes inside their readers' loops and
                 never writes (op_costs.inlined), their inputs read where those readers
                 run, and a result Inductor writes over a dying matmul output in place
                 (op_costs.inplace_reuses) takes that buffer. With `fused` (Inductor's
                 Triton kernels) plus the unit's largest fresh fused-kernel result: a fused
                 kernel computes several nodes at once, so one of them may be allocated
                 before the moment the walk in FX order gives it (a step's peak exceeded
                 the plain walk's by less than that; on the CPU, Inductor's C++ kernels
                 stay within the walk: test_memory_contract, test_inductor_walk)
    flops        matmul/attention FLOPs (torch's flop formulas), each node's at the probe's
                 matmul rate where its own shape was timed (flop_scale); backward minus forward
    traffic      device memory bytes of the memory-bound kernels (op_costs.py); backward
                 minus forward
    inputs       the activation DAG: unit A reads an output of unit B in the forward

Sizes are sympy expressions in the graph's symbolic dims (dynamic shapes), `dims` their
values now, so the planner proves the peak for the shapes being compiled and can say how
it grows. Every estimate errs on the side of more bytes, never fewer.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..memory.layout import ALIGN_ELEMENTS
from ..plan.events import RegionUse
from ..plan.problem import Problem, RegionSpec, Weight
from ..runtime.grad_copies import GRAD_TRANSFER_DTYPE
from . import ops
from .merges import Merge
from .op_costs import flops as _flops
from .op_costs import inlined as _inlined
from .op_costs import inplace_reuses as _inplace_reuses
from .op_costs import is_view as _is_view
from .op_costs import memory_bound as _memory_bound
from .op_costs import traffic as _traffic
from .graph_sizes import GraphSizes
from .partition import region_of



@dataclass
class StepProblem:
    problem: Problem
    dims: dict  # {sympy symbol: its value for the shapes being compiled}
    units: dict[int, tuple[int, ...]]  # planner region -> graph regions, in forward order
    forward_uses: list[RegionUse]
    backward_uses: list[RegionUse]
    # Per graph, the planner region whose flat buffer each fetch (by node name) is part of.
    forward_fetches: dict[str, int]
    backward_fetches: dict[str, int]
    # Per planner region, the names of the saved tensors its boundary output is made of
    # (forward nodes; the backward's placeholders have the same names).
    saved: dict[int, list[str]]
    merges: tuple[Merge, ...] = ()  # why graph regions were joined into units
    weighted: frozenset[int] = frozenset()  # graph regions that fetch weights


def build_problem(fw: fx.GraphModule, bw: fx.GraphModule | None, params: list[torch.nn.Parameter],
                  device: torch.device, dtype: torch.dtype, fused: bool = False,
                  flop_scale: dict | None = None, inductor: bool = False) -> StepProblem:
    """`bw=None` describes a forward-only (inference) graph; `fused`: the graphs run as
    Inductor's Triton kernels (a fused kernel's transient margin); `inductor`: the walk
    leaves out what Inductor computes inside a reader's kernel and never writes;
    `flop_scale`: per node, what turns its FLOPs into FLOPs at the probe's matmul rate
    (compiler/rates.py)."""
    graphs = [_Graph(fw.graph)] + ([_Graph(bw.graph)] if bw is not None else [])
    unit_of, merges = _units(graphs)
    for g in graphs:
        g.own(unit_of)
    sizes = GraphSizes(device)
    f = graphs[0]
    fw_order = sorted(f.hull, key=lambda u: f.hull[u][0])
    fw_order += sorted(set(unit_of.values()) - set(fw_order))
    inputs = f.edges()
    readers: dict[int, set[int]] = {}
    for v, us in inputs.items():
        for u in us:
            readers.setdefault(u, set()).add(v)
    saved_names = {n.name for n in graphs[1].nodes if n.op == "placeholder"} if bw is not None else set()
    saved = [n for n in f.outputs() if n.name in saved_names]
    saved_by_unit = {u: [n for n in saved if f.owner.get(n) == u] for u in fw_order}
    out_bytes = {u: sizes.total(ns) for u, ns in saved_by_unit.items()}
    base = sizes.total([n for n in f.nodes if n.op == "placeholder" and not _is_param(n)]
                       + [n for n in saved if n not in f.owner])
    work_fw = f.working_sets(sizes, exclude=set(saved), until={}, fused=fused, inductor=inductor)
    flops_fw, traffic_fw = f.flops(sizes, flop_scale), f.traffic(sizes)
    weights, fetched = _weights(graphs, params, dtype)
    work_bw, flops_bw, traffic_bw, bw_order, bw_fetched, grad_in = {}, {}, {}, None, {}, {}
    if bw is not None:
        b = graphs[1]
        bw_order = sorted(b.hull, key=lambda u: b.hull[u][0])
        # Units without backward nodes compute nothing there: last, producers after consumers.
        bw_order += [u for u in reversed(fw_order) if u not in b.hull]
        pos = {u: i for i, u in enumerate(bw_order)}
        tangents = [n for n in b.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
        lives = b.gradient_lives()
        if sizes.device.type == "cuda":
            sizes.fp32_snapshots = set(lives)
        work_bw = b.working_sets(sizes, exclude=b.host_copies(), until=lives, inputs=tangents, fused=fused,
                                 inductor=inductor)
        for u, extra in b.self_saved(f, sizes).items():
            work_bw[u] = work_bw.get(u, 0) + extra
        for u in fw_order:
            # An edge the backward does not follow (it reads no gradient through it, e.g.
            # rotary tables) is dropped; the reader's recompute still holds the output.
            for i in [i for i in inputs.get(u, ()) if pos[i] < pos[u]]:
                inputs[u].discard(i)
                work_bw[u] = work_bw.get(u, 0) + out_bytes[i]
        flops_bw = {u: sympy.Max(v - flops_fw.get(u, 0), 0) for u, v in b.flops(sizes, flop_scale).items()}
        traffic_bw = {u: sympy.Max(v - traffic_fw.get(u, 0), 0) for u, v in b.traffic(sizes).items()}
        bw_fetched = fetched[1]
        grad_in = b.incoming(sizes, readers)
    regions = []
    for u in fw_order:
        ws = fetched[0].get(u, ())
        bws = bw_fetched.get(u, ()) if bw is not None else None
        regions.append(RegionSpec(
            u, ws, tuple(sorted(inputs.get(u, ()), key=fw_order.index)), _int(out_bytes[u]),
            _int(work_fw.get(u, 0)), _int(work_bw.get(u, 0)), _int(flops_fw.get(u, 0)),
            _int(flops_bw.get(u, 0)) if bw is not None else None, bws if bws != ws else None,
            _int(traffic_fw.get(u, 0)), _int(traffic_bw.get(u, 0)) if bw is not None else None,
            # at most what it saves: where more comes back (an fp32 gradient of a bf16
            # boundary), the saved bytes stand, as before the graph was read for it
            _int(sympy.Min(grad_in.get(u, 0), out_bytes[u])) if bw is not None else None))
    problem = Problem(tuple(regions), tuple(weights), tuple(bw_order) if bw_order else None,
                      _int(base), training=bw is not None)
    members = {}
    for r, u in sorted(unit_of.items()):
        members.setdefault(u, []).append(r)
    uses = [g.uses() for g in graphs] + [[]]
    groups = [{f.name: u for u, fs in g.fetch_groups().items() for f in fs} for g in graphs] + [{}]
    return StepProblem(problem, sizes.dims(problem), {u: tuple(m) for u, m in members.items()},
                       uses[0], uses[1], groups[0], groups[1],
                       {u: [n.name for n in ns] for u, ns in saved_by_unit.items()}, tuple(merges),
                       frozenset(r for g in graphs for r in g.fetches))


def _int(v):
    v = sympy.sympify(v)
    return int(v) if v.is_number else v


def _is_param(n: fx.Node) -> bool:
    return any(u.op == "call_function" and u.target is ops.FETCH for u in n.users)


def _base(n: fx.Node) -> fx.Node:
    """The node that owns `n`'s memory (through views)."""
    while n.op == "call_function" and _is_view(n) and n.args and isinstance(n.args[0], fx.Node) \
            and n.target is not operator.getitem:
        n = n.args[0]
    return n


def _is_handoff(n: fx.Node) -> bool:
    if n.target in (ops.GRAD_TO_HOST, ops.GRAD_TO_OPTIMIZER):
        return True
    return getattr(n.target, "__name__", "") == "with_effects" and len(n.args) > 1 \
        and n.args[1] is ops.GRAD_TO_OPTIMIZER


class _Graph:
    """One FX graph: which unit owns each node, unit spans, sizes walked in node order."""

    def __init__(self, graph: fx.Graph):
        self.nodes = list(graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.region = self._owners()  # graph region of every compute node but fetches
        if self._split_shared_fetches(graph):
            self.nodes = list(graph.nodes)
            self.pos = {n: i for i, n in enumerate(self.nodes)}
        # A fetch belongs where its weight is read: the region of its first reader; its
        # weights are in use from there to its last reader, whoever owns that.
        self.fetches: dict[int, list[fx.Node]] = {}
        self.window: dict[int, tuple[int, int]] = {}
        for i, n in enumerate(self.nodes):
            if n.op == "call_function" and n.target is ops.FETCH:
                readers = sorted(self.pos[u] for u in _alias_users(n) if u in self.region)
                r = self.region[self.nodes[readers[0]]] if readers else n.args[2]
                lo, hi = (readers[0], readers[-1]) if readers else (i, i)
                self.fetches.setdefault(r, []).append(n)
                w = self.window.get(r, (lo, hi))
                self.window[r] = (min(w[0], lo), max(w[1], hi))

    def _split_shared_fetches(self, graph: fx.Graph) -> bool:
        """Give each region that reads a fetched weight its own fetch of it. The partitioner
        may recompute a tensor shared by every layer (a LayerNorm of relative-position
        embeddings, made in the prologue) at the start of the backward while the
        prologue's own backward reads the same weight at the end: one fetch would hold
        the weight, and with it every region in between, across the whole backward. The
        copies are views of each region's own buffer, so the weight streams once per
        reading region (a few bytes more over the link, never a longer window)."""
        changed = False
        for n in list(graph.find_nodes(op="call_function", target=ops.FETCH)):
            groups: dict[int, list[fx.Node]] = {}
            for u in n.users:
                r = self.region.get(u)
                if r is not None:
                    groups.setdefault(r, []).append(u)
            if len(groups) < 2:
                continue
            ordered = sorted(groups.values(), key=lambda us: min(self.pos[u] for u in us))
            for users in ordered[1:]:
                with graph.inserting_before(min(users, key=self.pos.__getitem__)):
                    copy = graph.call_function(ops.FETCH, n.args, dict(n.kwargs))
                copy.meta = dict(n.meta)
                for u in users:
                    u.replace_input_with(n, copy)
                changed = True
        return changed

    def _owners(self) -> dict[fx.Node, int]:
        """Each compute node's region: its tag, untagged nodes joining the run they sit in.
        A run of another region's nodes inside a region's run (the partitioner recomputes
        an input-free mask, tagged with the prologue, in the middle of a layer's backward)
        belongs to the region around it. A region's runs apart from its main (longest) run
        belong to the run they sit in: the partitioner may recompute a tensor early (T5's
        position bias, tagged with the first block, at the start of the backward), which
        makes no second span."""
        runs: list[tuple[int | None, list[fx.Node]]] = []
        for n in self.nodes:
            if n.op != "call_function":
                continue
            r = region_of(n)
            if not runs or r is not None and runs[-1][0] != r:
                runs.append((r, []))
            if n.target is not ops.FETCH:  # a fetch tags what follows; it goes where it is read
                runs[-1][1].append(n)
        runs = _absorb_sandwiched([run for run in runs if run[1]])
        if runs and runs[0][0] is None:  # leading untagged nodes: the first tagged run's
            if len(runs) == 1:
                return {}
            runs[1][1][:0] = runs.pop(0)[1]
        main: dict[int, list] = {}
        for r, nodes in runs:
            if len(nodes) > len(main.get(r, ())):
                main[r] = nodes
        owner, out = None, {}
        for i, (r, nodes) in enumerate(runs):
            if main[r] is not nodes:
                r = owner if owner is not None else runs[i + 1][0] if i + 1 < len(runs) else r
            owner = r
            out.update(dict.fromkeys(nodes, r))
        return out

    def spans(self, unit_of: dict[int, int]) -> dict[int, tuple[int, int]]:
        """Per unit, the first and last node position it owns or reads its weights at."""
        hull: dict[int, tuple[int, int]] = {}
        points = [(r, i, i) for n, r in self.region.items() for i in (self.pos[n],)]
        for r, lo, hi in points + [(r, *w) for r, w in self.window.items()]:
            u = unit_of[r]
            a, b = hull.get(u, (lo, hi))
            hull[u] = (min(a, lo), max(b, hi))
        return hull

    def own(self, unit_of: dict[int, int]) -> None:
        self.owner = {n: unit_of[r] for n, r in self.region.items()}
        self.hull = self.spans(unit_of)
        self.unit_of = unit_of

    def fetch_groups(self) -> dict[int, list[fx.Node]]:
        out: dict[int, list[fx.Node]] = {}
        for r in sorted(self.fetches):
            out.setdefault(self.unit_of[r], []).extend(self.fetches[r])
        return out

    def uses(self) -> list[RegionUse]:
        return [RegionUse(u, lo, hi) for u, (lo, hi) in sorted(self.hull.items(), key=lambda kv: kv[1])]

    def edges(self) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for n, u in self.owner.items():
            for a in n.all_input_nodes:
                v = self.owner.get(a)
                if v is not None and v != u:
                    out.setdefault(u, set()).add(v)
        return out

    def incoming(self, sizes: "GraphSizes", readers: dict[int, set[int]]) -> dict[int, object]:
        """Per unit, the bytes of the tensors its nodes read that the units in
        ``readers[unit]`` made, each once. In a backward graph, with the units whose forward
        reads a unit's boundary output as its readers: the gradients of that output their
        backward sends it (RegionSpec.grad_in_bytes)."""
        out: dict[int, object] = {}
        seen: set[tuple[int, fx.Node]] = set()
        for n, u in self.owner.items():
            for a in n.all_input_nodes:
                b = _base(a)
                v = self.owner.get(b)
                if v is None or v not in readers.get(u, ()) or b.op == "placeholder" or (u, b) in seen:
                    continue
                seen.add((u, b))
                out[u] = out.get(u, 0) + sizes.bytes(b)
        return out

    def outputs(self) -> list[fx.Node]:
        """Memory owners of the graph's outputs (saved activations and returned values)."""
        out, seen = [], set()
        for a in self.nodes[-1].all_input_nodes:
            b = _base(a)
            if b.op != "placeholder" and b not in seen:
                seen.add(b)
                out.append(b)
        return out

    def host_copies(self) -> set[fx.Node]:
        """grad_to_host results and what is computed from them alone (the sum of a shared
        weight's gradients from the several regions that fetch it): host memory, even when
        the compute device is the CPU."""
        out: set[fx.Node] = set()
        for n in self.nodes:
            if n.op != "call_function":
                continue
            if n.target is ops.GRAD_TO_HOST or (n.all_input_nodes and all(a in out for a in n.all_input_nodes)):
                out.add(n)
        return out

    def gradient_lives(self) -> dict[fx.Node, int]:
        """Weight gradient -> the position of the hand-off after its own (or its own)."""
        handoffs = [i for i, n in enumerate(self.nodes) if n.op == "call_function" and _is_handoff(n)]
        out = {}
        for n in self.nodes:
            readers = [u for u in _alias_users(n) if not _is_view(u)] if n.op == "call_function" else []
            if readers and all(_is_handoff(u) for u in readers):
                own = max(self.pos[u] for u in readers)
                out[n] = next((i for i in handoffs if i > own), own)
        return out

    def working_sets(self, sizes: "GraphSizes", exclude: set[fx.Node], until: dict[fx.Node, int],
                     inputs: list[fx.Node] = (), fused: bool = False,
                     inductor: bool = False) -> dict[int, object]:
        """Per unit, the most transient bytes live at once at one of its nodes (symbolic:
        the set of tensors live at that moment, judged by the current sizes). `until`
        overrides where a tensor dies; `inputs` (placeholders) count until their last use;
        `fused` adds the unit's largest fresh fused-kernel result; `inductor` leaves out
        what Inductor never writes and counts what it writes in place once (module
        docstring)."""
        end = len(self.nodes)
        inlined, reads_at = (_inlined(self.nodes, self.owner, set(until), cpu=sizes.device.type == "cpu")
                             if inductor else (set(), {}))
        exclude = exclude | inlined
        last: dict[fx.Node, int] = {}
        for i, n in enumerate(self.nodes):
            for a in n.all_input_nodes:
                at = end if n.op == "output" else reads_at.get(n, i)
                last[_base(a)] = max(last.get(_base(a), at), at)
        last.update(until)
        overwrites = _inplace_reuses(self.nodes, self.owner, inlined, last) if inductor else {}
        live: dict[fx.Node, int] = {}
        frees: dict[int, list[fx.Node]] = {}
        total = 0
        best: dict[int, tuple[int, tuple, fx.Node | None]] = {}
        largest: dict[int, tuple[int, fx.Node]] = {}  # unit -> its largest transient
        inputs = set(inputs)
        for i, n in enumerate(self.nodes):
            u = self.owner.get(n)
            if (n in inputs or n.op == "call_function" and n.target is not ops.FETCH and not _is_view(n)) \
                    and n not in exclude:
                b = sizes.hint(n)
                if b:
                    taken = overwrites.get(n)
                    reused = taken in live  # written over an input that dies here: no new buffer
                    if reused:
                        total -= live.pop(taken)
                        frees[i].remove(taken)
                    live[n] = b
                    total += b
                    frees.setdefault(last.get(n, i), []).append(n)
                    if u is not None and not reused and _memory_bound(n) and b > largest.get(u, (0,))[0]:
                        largest[u] = (b, n)
            scratch = sizes.scratch_hint(n)  # what `n` allocates and frees inside itself
            if u is not None and total + scratch > best.get(u, (-1,))[0]:
                best[u] = (total + scratch, tuple(live), n if scratch else None)
            for x in frees.pop(i, ()):
                total -= live.pop(x)
        return {u: sizes.total(nodes) + (sizes.scratch(at) if at is not None else 0)
                + (sizes.bytes(largest[u][1]) if fused and u in largest else 0)
                for u, (_, nodes, at) in best.items()}

    def self_saved(self, forward: "_Graph", sizes: "GraphSizes") -> dict[int, object]:
        """Saved activations a unit's own backward reads while the planner may already have
        released them (they outlive only their consumers there): counted in its work."""
        made = {n.name: forward.owner.get(n) for n in forward.nodes}
        read_by_others = {v for vs in forward.edges().values() for v in vs}
        out: dict[int, object] = {}
        for p in self.nodes:
            if p.op != "placeholder":
                continue
            u = made.get(p.name)
            if u in read_by_others and any(self.owner.get(x) == u for x in _alias_users(p)):
                out[u] = out.get(u, 0) + sizes.total([p])
        return out

    def traffic(self, sizes: "GraphSizes") -> dict[int, object]:
        return _traffic(self.nodes, self.owner, sizes.device, sizes.expr)

    def flops(self, sizes: "GraphSizes", scale: dict | None = None) -> dict[int, object]:
        """Per unit, FLOPs at the probe's matmul rate: each node's FLOPs times its `scale`
        (that rate over the one its own shape reaches, where measured)."""
        out: dict[int, object] = {}
        for n, u in self.owner.items():
            f = _flops(n)
            if f:
                out[u] = out.get(u, 0) + sizes.expr(f) * (scale or {}).get(n, 1)
        return out


def _absorb_sandwiched(runs: list[tuple[int | None, list[fx.Node]]]) -> list[tuple[int | None, list[fx.Node]]]:
    """Runs of (region, nodes) in graph order, with every run that sits between two runs of
    one other region joined to them: a recompute placed inside a region's backward is
    computed there, whatever module made it, and must not split that region in two (the
    two halves would stretch its weights' window over its neighbours and merge them)."""
    out: list[tuple[int | None, list[fx.Node]]] = []
    for r, nodes in runs:
        if len(out) >= 2 and out[-2][0] == r and out[-1][0] != r and r is not None:
            middle = out.pop()[1]
            out[-1] = (r, out[-1][1] + middle + nodes)
        elif out and out[-1][0] == r:
            out[-1] = (r, out[-1][1] + nodes)
        else:
            out.append((r, list(nodes)))
    return out


def _alias_users(node: fx.Node) -> list[fx.Node]:
    """Every node that reads `node`'s memory: its users, and users of its views."""
    out, stack, seen = [], [node], set()
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


def _units(graphs: list[_Graph]) -> tuple[dict[int, int], list[Merge]]:
    """Graph region -> unit (the smallest region id among its members): regions whose spans
    overlap in any graph are merged until every graph's unit spans are disjoint; and why
    each merge happened."""
    regions = sorted({r for g in graphs for r in g.region.values()} | {r for g in graphs for r in g.fetches})
    unit = {r: r for r in regions}
    merges: list[Merge] = []

    def find(r):
        while unit[r] != r:
            unit[r] = unit[unit[r]]
            r = unit[r]
        return r

    changed = True
    while changed:
        changed = False
        for kind, g in zip(("forward", "backward"), graphs):
            flat = {r: find(r) for r in regions}
            spans = sorted(g.spans(flat).items(), key=lambda kv: kv[1])
            for (a, (_, a_hi)), (b, (b_lo, _)) in zip(spans, spans[1:]):
                if b_lo <= a_hi:
                    merges.append(_merge(kind, g, flat, a, a_hi, b, b_lo))
                    lo, hi = sorted((find(a), find(b)))
                    unit[hi] = lo
                    changed = True
                    break
            if changed:
                break
    return {r: find(r) for r in regions}, merges


def _merge(kind: str, g: _Graph, flat: dict[int, int], a: int, a_hi: int, b: int, b_lo: int) -> Merge:
    """The Merge of unit `a` (its span ends at `a_hi`) into `b` (starts at `b_lo`)."""
    members = [r for r, u in flat.items() if u == a]
    node = g.nodes[a_hi]
    owner = g.region.get(node)
    through_weight = owner is None or flat.get(owner) != a
    first = owner if not through_weight else next(
        (r for r in members if g.window.get(r, (0, -1))[1] == a_hi), members[0])
    second = next((r for r, u in flat.items() if u == b and g.region.get(g.nodes[b_lo]) == r), b)
    param = next((f.args[3] for f in g.fetches.get(first, ()) if through_weight
                  and any(g.pos[x] == a_hi for x in _alias_users(f))), None)
    return Merge(kind, first, second, node.name, g.nodes[b_lo].name, through_weight, param)


def _weights(graphs: list[_Graph], params, dtype):
    """Planner weights, one per parameter, and the weights each unit fetches per graph. A
    parameter fetched again inside one unit (by a second member region) is a second device
    copy: a weight of its own, with no host work."""
    weights: dict[int, Weight] = {}
    copies: dict[tuple, int] = {}  # (unit, param, k-th fetch in the unit) -> weight id
    groups = [g.fetch_groups() for g in graphs]
    first_copy = 1 + max((f.args[3] for gr in groups for fs in gr.values() for f in fs), default=-1)
    fetched: list[dict[int, tuple[int, ...]]] = []
    for gr in groups:
        per_unit: dict[int, list[int]] = {}
        seen: dict[tuple, int] = {}
        for u, fs in gr.items():
            for f in fs:
                pid = f.args[3]
                k = seen[(u, pid)] = seen.get((u, pid), -1) + 1
                wid = pid if k == 0 else copies.setdefault((u, pid, k), first_copy + len(copies))
                if wid not in weights:
                    numel = f.meta["val"].numel()
                    trains = pid >= len(params) or params[pid].requires_grad
                    elements = -(-max(numel, 1) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
                    master = params[pid].dtype if pid < len(params) else dtype
                    weights[wid] = Weight(wid, elements * dtype.itemsize, numel if trains and k == 0 else 0,
                                          numel * dtype.itemsize if trains else 0, grad_held=False,
                                          link_nbytes=elements * master.itemsize,
                                          grad_link_nbytes=numel * GRAD_TRANSFER_DTYPE.itemsize if trains else 0)
                per_unit.setdefault(u, []).append(wid)
        fetched.append({u: tuple(ws) for u, ws in per_unit.items()})
    return sorted(weights.values(), key=lambda w: w.id), fetched
