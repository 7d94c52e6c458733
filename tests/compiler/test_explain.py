"""`megatrain.explain`: the compiled model's schedule is the planner's, validated, with a
predicted step time and a Chrome-trace timeline (CPU device, eager lowering: fast)."""

from __future__ import annotations

import json

import pytest
import torch

import megatrain
from megatrain.compiler import ops
from megatrain.plan import costs
from megatrain.plan.search import Plan as PlannerPlan
from megatrain.plan.validate import validate
from megatrain.models import Llama, LlamaConfig
from .helpers import compile_streamed

OPTS = {"device": "cpu", "precision": "fp32", "lowering": "eager"}


@pytest.fixture(autouse=True)
def no_cached_rates(tmp_path, monkeypatch):
    """Compile with the default CPU rates, whatever this machine has cached."""
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))


def llama(layers: int) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=96, hidden=32, layers=layers, heads=2, kv_heads=1, ffn=64,
                             rope_theta=10000.0))


def trained_step(layers: int, **options):
    step = compile_streamed(llama(layers), {**OPTS, **options})
    ids = torch.randint(0, 96, (2, 8))
    step(ids, labels=ids).backward()
    return step


def _transfer_ops(graph: torch.fx.Graph) -> list[str]:
    """The graph's prefetch/wait/evict nodes as "kind(region)", in node order."""
    region_arg = {ops.PREFETCH: ("prefetch", 3), ops.WAIT: ("wait", 2), ops.EVICT: ("evict", 3)}
    return [f"{region_arg[n.target][0]}({n.args[region_arg[n.target][1]]})"
            for n in graph.nodes if n.target in region_arg]


def test_the_compiled_schedule_is_the_planners_validated_plan():
    step = trained_step(3)
    g = megatrain.explain(step).graphs[0]
    sched = g.schedule
    assert isinstance(sched.plan, PlannerPlan) and sched.rates == costs.CPU
    validate(sched.plan.schedule, g.budget)
    assert g.predicted_peak_bytes == sched.plan.peak_bytes <= g.budget
    assert g.slots == sched.plan.config.slots
    # The FX graphs hold the planner's prefetch/wait/evict, in the planner's order.
    for planned, events in ((sched.forward, g.forward_events), (sched.backward, g.backward_events)):
        # ... plus the cross-graph prefetch_next right after the last wait (runtime-decided).
        assert [e for e in events if e not in ("drain", "prefetch_next")] == [
            f"{t.kind}({t.region})" for t in planned]
        waits = [i for i, e in enumerate(events) if e.startswith("wait")]
        assert events.index("prefetch_next") > waits[-1]
    assert g.backward_events[-1] == "drain"
    # The planner modelled the embedding's backward without its weight: no fetch there.
    prologue = sched.plan.schedule.problem.regions[0]
    assert prologue.weights and prologue.bw_weights == ()
    assert "prefetch(0)" in g.forward_events and "prefetch(0)" not in g.backward_events


def test_materialised_order_matches_the_lowered_graph():
    captured = {}
    from megatrain.compiler import backend

    real = backend.lower

    def spy(gm, inputs, lowering, is_backward):
        captured["bw" if is_backward else "fw"] = _transfer_ops(gm.graph)
        return real(gm, inputs, lowering, is_backward)

    backend.lower = spy
    try:
        step = trained_step(2)
    finally:
        backend.lower = real
    g = megatrain.explain(step).graphs[0]
    assert captured["fw"] == [e for e in g.forward_events if e != "prefetch_next"]
    assert captured["bw"] == [e for e in g.backward_events if e not in ("drain", "prefetch_next")]


def test_predicted_step_time_is_positive_and_grows_with_layers():
    small, large = (megatrain.explain(trained_step(n)).predicted_step_s for n in (2, 4))
    assert 0 < small < large


def test_timeline_writes_a_chrome_trace_per_stream(tmp_path):
    step = trained_step(2)
    plan = megatrain.explain(step)
    trace = json.loads(open(plan.timeline(tmp_path / "step.json")).read())
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert list(processes.values()) == [f"megatrain predicted (graph 0: {costs.CPU.device})"]
    tracks = {e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {"compute", "h2d", "d2h", "host"} <= tracks
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in slices} >= {"compute", "h2d", "d2h", "host_step", "prefetch", "free"}
    assert all(e["dur"] >= 0 for e in slices)
    # After a CUDA step the streamer holds CUDA event pairs per region; stand-ins here.
    stats = plan.graphs[0].streamer.last_stats
    stats.transfers = [(1, FakeEvent(2.0), FakeEvent(3.5)), (2, FakeEvent(3.5), FakeEvent(4.0))]
    stats.waits = [(1, FakeEvent(2.5), FakeEvent(3.5))]
    trace = json.loads(open(plan.timeline(tmp_path / "both.json")).read())
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert "megatrain measured (graph 0)" in processes
    measured = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 2}
    assert sorted(measured) == ["h2d r1", "h2d r2", "wait for weights r1"]
    assert (measured["h2d r1"]["ts"], measured["h2d r1"]["dur"]) == (0.0, 1500.0)
    assert measured["wait for weights r1"]["ts"] == 500.0


class FakeEvent:
    """A recorded torch.cuda.Event at `ms` (elapsed_time and synchronize, as CUDA's)."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.ms - self.ms

    def synchronize(self) -> None:
        pass


def test_inference_plans_a_forward_only_step():
    with torch.no_grad():
        step = compile_streamed(llama(2), OPTS)
        step(torch.randint(0, 96, (2, 8)))
    g = megatrain.explain(step).graphs[0]
    assert g.schedule.plan.schedule.problem.training is False
    assert g.backward_events == [] and g.forward_events[0].startswith("prefetch(")
    assert g.predicted_step_s > 0
