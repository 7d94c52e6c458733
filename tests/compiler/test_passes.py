"""Pass tests on small hand-built FX graphs: region tagging and transfer insertion."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._subclasses import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

import megatrain  # noqa: F401  (registers the ops)
from megatrain.compiler import ops
from megatrain.compiler.partition import tag_for_region_checkpointing
from megatrain.compiler.passes import insert_transfers
from megatrain.compiler.schedule import schedule_step
from megatrain.runtime import streamer as streamer_mod

aten = torch.ops.aten


def _streamer():
    return streamer_mod.register(streamer_mod.Streamer(torch.device("cpu"), torch.float32, 1 << 30, []))


def _joint_graph(sid: int, regions: int = 3, hidden: int = 8):
    """primals: one weight per region + x; region r: y = relu(y @ W_r^T); tangents: d(sum y)."""
    fake = FakeTensorMode()
    g = fx.Graph()
    weights = [g.placeholder(f"primals_{i + 1}") for i in range(regions)]
    x = g.placeholder(f"primals_{regions + 1}")
    tangent = g.placeholder("tangents_1")
    with fake:
        for w in weights:
            w.meta["val"] = torch.empty(hidden, hidden)
        x.meta["val"] = torch.empty(4, hidden)
        tangent.meta["val"] = torch.empty(4, hidden)
    y = x
    nodes = {}
    for r, w in enumerate(weights):
        f = g.call_function(ops.FETCH, (w, sid, r, r, False))
        t = g.call_function(aten.t.default, (f,))
        mm = g.call_function(aten.mm.default, (y, t))
        act = g.call_function(aten.relu.default, (mm,))
        for n in (f, t, mm, act):
            n.meta["custom"] = {"megatrain_region": r}
        with fake:
            f.meta["val"] = torch.empty(hidden, hidden)
            t.meta["val"] = torch.empty(hidden, hidden)
            mm.meta["val"] = torch.empty(4, hidden)
            act.meta["val"] = torch.empty(4, hidden)
        nodes[r] = dict(fetch=f, t=t, mm=mm, act=act)
        y = act
    # A backward node: anything that reads the tangent.
    bw = g.call_function(aten.mul.Tensor, (tangent, y))
    g.output((y, bw))
    return g, nodes


def test_tagging_saves_region_outputs_and_recomputes_the_rest():
    g, nodes = _joint_graph(_streamer())
    tag_for_region_checkpointing(g)
    for r, n in nodes.items():
        assert n["fetch"].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
        assert n["t"].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE  # weight-derived
        assert n["mm"].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE  # region-internal
        expected = CheckpointPolicy.MUST_SAVE if r < 2 else CheckpointPolicy.MUST_RECOMPUTE
        assert n["act"].meta["recompute"] == expected  # crosses into the next region
    bw = [n for n in g.nodes if n.target is aten.mul.Tensor][0]
    assert "recompute" not in bw.meta


def _forward_graph(sid: int, regions: int, hidden: int = 8):
    g, nodes = _joint_graph(sid, regions, hidden)
    # Drop the backward part: a forward graph returns the activations.
    out = g.find_nodes(op="output")[0]
    bw = [n for n in g.nodes if n.target is aten.mul.Tensor][0]
    out.args = ((nodes[regions - 1]["act"],),)
    g.erase_node(bw)
    g.erase_node(g.find_nodes(op="placeholder", target="tangents_1")[0])
    return fx.GraphModule(torch.nn.Module(), g), nodes


def _insert_planned(gm, kind: str, sid: int, slots: int):
    """Plan `gm` as a forward-only step (roomy budget, up to `slots` buffers), insert it."""
    plan = schedule_step(gm, None, [], torch.device("cpu"), torch.float32, 1 << 30, slots - 1)
    return insert_transfers(gm, kind, sid, plan.forward, plan.forward_fetches, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_insertion_orders_prefetch_wait_use_evict(slots):
    sid = _streamer()
    regions = 5
    gm, _ = _forward_graph(sid, regions)
    sched = _insert_planned(gm, "forward", sid, slots)
    nodes = list(gm.graph.nodes)
    assert not any(n.target is ops.FETCH for n in nodes), "every fetch is replaced"
    pos = {n: i for i, n in enumerate(nodes)}
    resident, peak = set(), 0
    waited = {}
    for n in nodes:
        if n.target is ops.PREFETCH:
            resident.add(n.args[3])
            peak = max(peak, len(resident))
        elif n.target is ops.WAIT:
            assert n.args[2] in resident, "wait before its prefetch"
            waited[n.args[2]] = n
        elif n.target is ops.EVICT:
            flat = n.args[1]
            readers = [u for u in flat.users if u is not n]
            views = [v for r in readers for v in r.users]
            assert all(pos[v] < pos[n] for v in readers + [w for v in views for w in v.users]), \
                "evict after the last read of the region's weights"
            resident.discard(n.args[3])
    assert peak <= slots
    assert sorted(waited) == list(range(regions))
    assert sched.prefetch_count == regions
    # The scheduled graph computes the same thing as an unscheduled run.
    gm.graph.lint()
    weights = [torch.randn(8, 8) for _ in range(regions)]
    x = torch.randn(4, 8)
    y = x
    for w in weights:
        y = torch.relu(y @ w.t())
    (out,) = gm(*weights, x)
    torch.testing.assert_close(out, y)


def test_backward_graph_ends_with_drain():
    sid = _streamer()
    gm, _ = _forward_graph(sid, 2)
    g = gm.graph
    out = g.find_nodes(op="output")[0]
    act = out.args[0][0]
    with g.inserting_before(out):
        host = g.call_function(ops.GRAD_TO_HOST, (act, sid, 0))
    host.meta["val"] = act.meta["val"]
    out.args = ((act, host),)
    streamer_mod.get(sid).params = [torch.nn.Parameter(torch.zeros(4, 8))]
    sched = _insert_planned(gm, "backward", sid, 1)
    nodes = list(gm.graph.nodes)
    assert nodes[-2].target is ops.DRAIN and host in nodes[-2].args[1]
    assert sched.events[-1] == "drain"
