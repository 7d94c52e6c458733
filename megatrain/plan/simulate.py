"""Time: the task graph of a program, its list schedule and the simulated `Schedule`.

The task graph (`networkx.DiGraph`), per micro-batch and step:
    prefetch(r) -> h2d(r) -> compute(r, fw) -> free(r)            weights, forward
    compute(i, fw) -> offload(i) -> offload_wait(i)                 boundary output to host
    restore(i) -> reload(i) -> compute(first bw consumer of i)     ... and back in backward
    prefetch(r) -> h2d(r) -> compute(r, bw) -> free(r)            weights again (recompute+bw;
                                                                   those its backward reads;
                                                                   a kept region: keep(r) for
                                                                   the forward's free, and
                                                                   compute(r, bw) -> free(r))
    compute(o, bw) -> d2h(o) -> grad_wait(o); d2h(o) -> host_acc / host_step(o)
    host_step(o, step s) -> h2d(r, fw, step s+1) for every r reading o's weights
(a forward-only problem, `training=False`, has the first line alone)
plus resource edges: the compute stream is one chain (the FX program order), the h2d and
d2h streams are chains in issue order (CUDA streams are FIFO), the host worker is a chain
in gradient-arrival order, and slot edges free(j-k) -> prefetch(j) bound the weight
buffers in flight to k slots.

`simulate` builds the graph of a `PlanConfig`'s program, takes each task's seconds from the
cost model (costs.py) and list-schedules it: static list scheduling with critical-path
priority yields the per-stream sequences and the timeline. Since the resource edges pin
each stream's order to what the FX program and FIFO streams allow, its priority only picks
among orders with equal start times; the peak comes from the program (program.py), not
from the timeline.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import networkx as nx

from . import costs
from .costs import Rates
from .problem import Problem, _Shape
from .program import (
    STREAM_OF,
    STREAMS,
    Buffer,
    PlanConfig,
    Program,
    Task,
    _program,
    program_peak,
)


def _durations(sh: _Shape, cfg: PlanConfig, rates: Rates, prog: Program) -> dict:
    """Seconds per (kind, region, phase), from the cost model; zero for compute-stream ops.
    The host updates are charged at the share of the step `prog`'s copies keep the link
    busy (costs.host_bandwidth)."""
    link = {"fw": costs.link_rates(rates, any(sh.wbytes["fw"].values()), bool(cfg.offloaded)),
            "bw": costs.link_rates(rates, any(sh.wbytes["bw"].values()) or bool(cfg.offloaded),
                                   bool(sh.owned))}
    out = {}
    for r in sh.problem.regions:
        out[("compute", r.id, "fw")] = costs.compute_seconds(r.flops_fw, rates, r.traffic_fw)
        flops_bw, traffic_bw = r.backward_work()
        out[("compute", r.id, "bw")] = costs.compute_seconds(flops_bw, rates, traffic_bw)
        for ph in ("fw", "bw"):
            out[("h2d", r.id, ph)] = costs.copy_seconds(sh.link_bytes[ph][r.id], link[ph].h2d)
        out[("offload", r.id, "fw")] = costs.copy_seconds(r.out_bytes, link["fw"].d2h)
        out[("reload", r.id, "bw")] = costs.copy_seconds(r.out_bytes, link["bw"].h2d)
    for o, ws in sh.owned.items():
        out[("d2h", o, "bw")] = costs.copy_seconds(sum(sh.weight[w].d2h_bytes for w in ws), link["bw"].d2h)
    busy = costs.link_busy_share(sum(out.get(t[:3], 0.0) for t in (*prog.h2d, *prog.d2h)),
                                 sum(out.get(t[:3], 0.0) for t in prog.compute))
    for o, ws in sh.owned.items():
        numel = sum(sh.weight[w].numel for w in ws)
        if sh.problem.updates_wait:
            grad_bytes = round(sum(sh.weight[w].d2h_bytes for w in ws) / max(numel, 1))
            out[("host_hold", o, "host")] = costs.host_hold_seconds(numel, grad_bytes, rates, busy)
            out[("host_step", o, "host")] = costs.host_clipped_step_seconds(numel, grad_bytes, rates, busy)
        else:
            out[("host_step", o, "host")] = costs.host_step_seconds(numel, rates, busy)
        out[("host_acc", o, "host")] = costs.host_accumulate_seconds(numel, rates, busy)
    return out


def task_graph(prog: Program, sh: _Shape, cfg: PlanConfig, rates: Rates) -> nx.DiGraph:
    """The networkx task graph: nodes carry stream, seconds (and weights moved, for copies
    and host steps); edges carry kind "data", "stream" (FIFO order) or "slot"."""
    dur = _durations(sh, cfg, rates, prog)
    G = nx.DiGraph()
    for seq in (prog.compute, prog.h2d, prog.d2h, prog.host):
        for t in seq:
            attrs = {"stream": STREAM_OF[t.kind], "seconds": dur.get(t[:3], 0.0)}
            if t.kind in ("d2h", "host_step", "host_acc"):
                attrs["weights"] = sh.owned[t.region]
            G.add_node(t, **attrs)
    for seq in (prog.compute, prog.h2d, prog.d2h, prog.host):
        G.add_edges_from(itertools.pairwise(seq), kind="stream")
    G.add_edges_from(prog.slot, kind="slot")
    G.add_edges_from(((a, b) for a, b in prog.data if not G.has_edge(a, b)), kind="data")
    return G


def critical_path_priority(G: nx.DiGraph) -> dict:
    """Bottom level: a task's seconds plus the longest path of seconds after it."""
    bl: dict = {}
    succ = G._succ
    for n in reversed(list(nx.topological_sort(G))):
        bl[n] = G.nodes[n]["seconds"] + max((bl[s] for s in succ[n]), default=0.0)
    return bl


def list_schedule(G: nx.DiGraph):
    """Static list scheduling: repeatedly take the ready task (all predecessors placed) of
    highest critical-path priority, append it to its stream, start it when its
    predecessors and its stream are done. Returns (streams, start, end)."""
    pred, succ = G._pred, G._succ
    prio = critical_path_priority(G)
    index = {n: i for i, n in enumerate(G)}
    missing = {n: len(pred[n]) for n in G}
    ready = [(-prio[n], index[n], n) for n, c in missing.items() if c == 0]
    heapq.heapify(ready)
    streams: dict[str, list] = {s: [] for s in STREAMS}
    free_at = dict.fromkeys(STREAMS, 0.0)
    start, end = {}, {}
    nodes = G.nodes
    while ready:
        _, _, n = heapq.heappop(ready)
        attrs = nodes[n]
        s = attrs["stream"]
        t0 = free_at[s]
        for p in pred[n]:
            if end[p] > t0:  # noqa: PLR1730 (hot loop: a compare costs less than max())
                t0 = end[p]
        start[n] = t0
        end[n] = free_at[s] = t0 + attrs["seconds"]
        streams[s].append(n)
        for c in succ[n]:
            missing[c] -= 1
            if missing[c] == 0:
                heapq.heappush(ready, (-prio[c], index[c], c))
    if len(start) != len(G):
        raise AssertionError("task graph has a cycle: the program order contradicts a data edge")
    return streams, start, end


@dataclass
class Schedule:
    """One simulated schedule: per-stream task order, slots, timeline, buffers, peak."""

    problem: Problem
    config: PlanConfig
    steps: int
    graph: nx.DiGraph
    streams: dict[str, list[Task]]
    start: dict[Task, float]
    end: dict[Task, float]
    slot_of: dict[Task, int]
    buffers: list[Buffer]
    peak_bytes: int
    peak_at: Task | None

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)

    @property
    def step_time(self) -> float:
        """Predicted seconds per step: the simulated steps' makespan over their number."""
        return self.makespan / self.steps

    @property
    def compute_seconds(self) -> float:
        return sum(self.end[t] - self.start[t] for t in self.streams["compute"]) / self.steps

    @property
    def gpu_idle(self) -> float:
        return self.step_time - self.compute_seconds

    @property
    def host_update_rate(self) -> float | None:
        """Parameters/s the cost model charged the host's AdamW updates at (their blend of
        the busy- and quiet-link rates, costs.host_bandwidth): what the runtime compares
        the rate training reaches with. None where no update runs on the host or the
        updates wait for the step's end (clipping: their time is not one update's)."""
        if self.problem.updates_wait:
            return None
        numel = {w.id: w.numel for w in self.problem.weights}
        params = seconds = 0.0
        for t in self.streams["host"]:
            if t.kind == "host_step":
                params += sum(numel[w] for w in self.graph.nodes[t]["weights"])
                seconds += self.end[t] - self.start[t]
        return params / seconds if params > 0 and seconds > 0 else None


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Planning allocates many small acyclic tuples; with torch loaded, the cyclic
    collector's passes over the heap would cost as much as the planning itself."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate(problem: Problem, config: PlanConfig, rates: Rates, steps: int = 2) -> Schedule:
    """Build the graph of `steps` steps under `config`, list-schedule it, measure its peak."""
    with _no_cyclic_gc():
        return _simulate(problem, config, rates, steps)


def _simulate(problem: Problem, config: PlanConfig, rates: Rates, steps: int) -> Schedule:
    sh = _Shape(problem)
    stray = sorted(set(config.offloaded) - set(sh.offloadable))
    if stray:
        raise ValueError(f"regions {stray} cannot be offloaded: no other region reads their output")
    stray = sorted(set(config.kept_weights) - set(sh.keepable))
    if stray:
        raise ValueError(f"regions {stray} cannot keep their weights for the backward: it reads "
                         "other weights, another region reads theirs, or there is no backward")
    if steps < 1:
        raise ValueError(f"steps={steps}: simulate at least one step")
    prog = _program(sh, config, steps)
    G = task_graph(prog, sh, config, rates)
    streams, start, end = list_schedule(G)
    peak, at = program_peak(prog, problem.base_bytes)
    return Schedule(problem, config, steps, G, streams, start, end, prog.slot_of, prog.buffers, peak, at)
