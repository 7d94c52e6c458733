"""The planner's event lists drive the FX pass: `insert_transfers` materialises exactly the
planned order, and the graph still computes what the unscheduled graph computes. For the
default case (prefetch=1, a roomy budget) the plan is the simple prefetch-k-ahead schedule
the backend used before the planner."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._subclasses import FakeTensorMode

import megatrain  # noqa: F401  (registers the ops)
from megatrain.compiler import ops, passes
from megatrain.plan.costs import GPU_DEFAULT
from megatrain.plan.events import RegionUse, Transfer, graph_events
from megatrain.plan.problem import Problem
from megatrain.plan.program import PlanConfig
from megatrain.plan.search import plan_step
from megatrain.plan.simulate import simulate
from megatrain.compiler.problem import build_problem
from megatrain.compiler.schedule import schedule_step
from megatrain.plan.validate import min_budget
from megatrain.runtime import streamer as streamer_mod

aten = torch.ops.aten
HIDDEN = 8


def _streamer() -> int:
    return streamer_mod.register(streamer_mod.Streamer(torch.device("cpu"), torch.float32, 1 << 30, []))


def _graph(sid: int, order: list[int]) -> fx.GraphModule:
    """y = relu(y @ W_r^T) for r in `order`: one fetched weight per region."""
    fake = FakeTensorMode()
    g = fx.Graph()
    weights = {r: g.placeholder(f"w{r}") for r in sorted(order)}
    x = g.placeholder("x")
    with fake:
        for w in weights.values():
            w.meta["val"] = torch.empty(HIDDEN, HIDDEN)
        x.meta["val"] = torch.empty(4, HIDDEN)
    y = x
    for r in order:
        f = g.call_function(ops.FETCH, (weights[r], sid, r, r, False))
        mm = g.call_function(aten.mm.default, (y, g.call_function(aten.t.default, (f,))))
        y = g.call_function(aten.relu.default, (mm,))
        with fake:
            f.meta["val"] = torch.empty(HIDDEN, HIDDEN)
            for n in (mm, y):
                n.meta["val"] = torch.empty(4, HIDDEN)
            mm.args[1].meta["val"] = torch.empty(HIDDEN, HIDDEN)
    g.output((y,))
    return fx.GraphModule(torch.nn.Module(), g)


def _uses(gm: fx.GraphModule) -> list[RegionUse]:
    """First fetch and last weight reader of each region (the old schedule's spans)."""
    nodes = list(gm.graph.nodes)
    out = []
    for i, n in enumerate(nodes):
        if n.target is ops.FETCH:
            r = n.args[2]
            readers = [nodes.index(u) for u in n.users] + [nodes.index(v) for u in n.users for v in u.users]
            out.append(RegionUse(r, i, max(readers)))
    return out


@pytest.mark.parametrize("budget_regions", [1, 2, 3, 9])
def test_insert_transfers_materialises_the_planned_order(budget_regions):
    n = 6
    sid = _streamer()
    fw = _graph(sid, list(range(n)))
    bw = _graph(sid, list(reversed(range(n))))
    fw_uses, bw_uses = _uses(fw), _uses(bw)
    problem = Problem.chain([HIDDEN * HIDDEN * 4] * n, out_bytes=4 * HIDDEN * 4, flops=10**6)
    budget = min_budget(problem) + (budget_regions - 1) * HIDDEN * HIDDEN * 4
    plan = plan_step(problem, budget, GPU_DEFAULT)
    events = plan.events(fw_uses, bw_uses)
    planned = {"forward": events.forward, "backward": events.backward}
    for kind, gm in (("forward", fw), ("backward", bw)):
        sched = passes.insert_transfers(gm, kind, sid, planned[kind], None, torch.device("cpu"), torch.float32)
        assert sched.prefetch_count == n
        # The graph holds the planned ops in the planned order.
        got = [(nd.target, nd.args[3] if nd.target is ops.PREFETCH else nd.args[2] if nd.target is ops.WAIT
                else nd.args[3]) for nd in gm.graph.nodes if nd.target in (ops.PREFETCH, ops.WAIT, ops.EVICT)]
        names = {ops.PREFETCH: "prefetch", ops.WAIT: "wait", ops.EVICT: "evict"}
        assert [(names[t], r) for t, r in got] == [(e.kind, e.region) for e in planned[kind]]
        resident, most = set(), 0
        for t, r in got:
            if t is ops.PREFETCH:
                resident.add(r)
                most = max(most, len(resident))
            elif t is ops.EVICT:
                resident.discard(r)
        assert most <= plan.config.slots
        weights = [torch.randn(HIDDEN, HIDDEN) for _ in range(n)]
        x = torch.randn(4, HIDDEN)
        order = range(n) if kind == "forward" else reversed(range(n))
        y = x
        for r in order:
            y = torch.relu(y @ weights[r].t())
        (out,) = gm(*weights, x)
        torch.testing.assert_close(out, y)


def test_activation_events_anchor_to_their_regions():
    n = 5
    sid = _streamer()
    fw_uses, bw_uses = _uses(_graph(sid, list(range(n)))), _uses(_graph(sid, list(reversed(range(n)))))
    problem = Problem.chain([HIDDEN * HIDDEN * 4] * n, out_bytes=1000, flops=10**6, micro_batches=2)
    cfg = PlanConfig(slots=2, weight_lead=None, reload_lead=1, release_lag=0, offloaded=frozenset({0, 2}))
    ev = graph_events(simulate(problem, cfg, GPU_DEFAULT), fw_uses, bw_uses)
    fw = {(e.kind, e.region): e for e in ev.forward_all}
    last = {u.region: u.last for u in fw_uses}
    assert fw[("offload", 0)].anchor == last[0] and fw[("offload", 0)].after
    assert fw[("offload_wait", 0)].anchor == last[1]  # after its reader, region 1
    bw = {(e.kind, e.region): e for e in ev.backward_all}
    first = {u.region: u.first for u in bw_uses}
    blast = {u.region: u.last for u in bw_uses}
    assert bw[("reload_wait", 2)].anchor == first[3] and not bw[("reload_wait", 2)].after
    # Reload lead 1: issued one backward compute before its reader (region 1 for output 0,
    # region 3 for output 2, i.e. at graph start).
    assert (bw[("reload", 0)].anchor, bw[("reload", 0)].after) == (blast[3], True)
    assert bw[("reload", 2)].anchor == -1
    assert [e.kind for e in ev.backward_all].count("grad_wait") == n
    assert all(e.kind in ("prefetch", "wait", "evict") for e in ev.forward + ev.backward)
    with pytest.raises(ValueError, match="order"):
        graph_events(simulate(problem, cfg, GPU_DEFAULT), bw_uses, fw_uses)


def _prefetch_k_ahead(uses: list[RegionUse], slots: int) -> list[Transfer]:
    """The schedule the backend used before the planner (schedule.prefetch_schedule): the
    first `slots` regions at graph start, each next one right after an evict frees a slot."""
    order = sorted(uses, key=lambda u: u.first)
    events, issued, resident = [], 0, 0
    while issued < len(order) and resident < slots:
        events.append(Transfer("prefetch", order[issued].region, -1, True))
        issued, resident = issued + 1, resident + 1
    for u in order:
        events.append(Transfer("wait", u.region, u.first, False))
        events.append(Transfer("evict", u.region, u.last, True))
        resident -= 1
        while issued < len(order) and resident < slots:
            events.append(Transfer("prefetch", order[issued].region, u.last, True))
            issued, resident = issued + 1, resident + 1
    return events


def test_default_plan_is_the_old_prefetch_k_ahead_schedule():
    """prefetch=1 with room to spare: the planner picks 2 slots, each prefetch issued as soon
    as a slot frees, which is exactly the old schedule over the same region spans, anchor for
    anchor. (A span now ends at its region's last node, not at its last weight reader.)"""
    n = 6
    sid = _streamer()
    fw, bw = _graph(sid, list(range(n))), _graph(sid, list(reversed(range(n))))
    spans = build_problem(fw, bw, [], torch.device("cpu"), torch.float32)
    sched = schedule_step(fw, bw, [], torch.device("cpu"), torch.float32, 1 << 30, prefetch=1)
    assert (sched.plan.config.slots, sched.plan.config.weight_lead) == (2, None)
    assert sched.forward == _prefetch_k_ahead(spans.forward_uses, 2)
    assert sched.backward == _prefetch_k_ahead(spans.backward_uses, 2)
    old_spans = _uses(fw)  # first fetch .. last weight reader: same order of ops
    assert [(e.kind, e.region) for e in sched.forward] == \
        [(e.kind, e.region) for e in _prefetch_k_ahead(old_spans, 2)]


def test_fused_lowering_counts_one_more_transient_per_region():
    """Under Inductor's Triton kernels (fused=True) each region's working sets grow by its
    largest transient tensor (a fused kernel may hold one node's output beyond its FX
    lifetime), so the planned peak grows and the prefetch schedule stays the same."""
    sid = _streamer()
    fw, bw = _graph(sid, [0, 1, 2]), _graph(sid, [2, 1, 0])
    plain = build_problem(fw, bw, [], torch.device("cpu"), torch.float32).problem
    fused = build_problem(fw, bw, [], torch.device("cpu"), torch.float32, fused=True).problem
    largest = 4 * HIDDEN * 4  # each region's mm and relu outputs: [4, HIDDEN] fp32
    for a, b in zip(plain.regions, fused.regions):
        assert (b.work_fw - a.work_fw, b.work_bw - a.work_bw) == (largest, largest), (a, b)
    lean = schedule_step(fw, bw, [], torch.device("cpu"), torch.float32, 1 << 30, prefetch=1)
    held = schedule_step(fw, bw, [], torch.device("cpu"), torch.float32, 1 << 30, prefetch=1, fused=True)
    assert held.plan.peak_bytes == lean.plan.peak_bytes + largest
    assert held.forward == lean.forward and held.backward == lean.backward
