"""The step planner: a task graph over regions, a list scheduler, memory and time models.

Input: a `Problem` (regions in forward order with their weights, boundary-activation and
working-set bytes as sympy expressions or ints, FLOPs, the DAG of activations), a budget
and measured `Rates`. Output: a `Plan` holding the chosen `Schedule`: one task sequence per
stream (compute, h2d, d2h, host), the slot of every weight buffer, the simulated start and
end of every task, the predicted peak device bytes and step time; `graph_events` turns it
into the `Transfer` lists the FX pass materialises.

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

Where things happen is decided by rule and by a small search, not by the scheduler:
every allocation and every free is a compute-stream op (prefetch/restore allocate, free/
offload_wait/grad_wait release, the last two wait for their copy), so peak device bytes
are a function of the program order alone, exactly like torch's stream-ordered caching
allocator. The planner searches prefetch depth, weight lead, reload lead, release lag and
which boundary activations to offload (a nested family: longest-lived first), keeps the
configurations whose peak fits the budget and simulates those. The list scheduler
(critical-path priority) then yields the per-stream sequences and the timeline; since the
resource edges pin each stream's order to what the FX program and FIFO streams allow, its
priority only picks among orders with equal start times. Because the candidate set and
every peak are independent of budget and rates, and a fixed graph's longest path only
shrinks when tasks get shorter, more budget or faster links can never predict a slower
step: a heuristic free to reorder streams would lose that (list-scheduling anomalies).
With `PlannerOptions.keep`, a post-pass then lets the chosen schedule keep the forward
weights of as many regions as fit for their backward (`_with_kept`: their second fetch
goes); that claim covers the search, not the post-pass.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import networkx as nx
import sympy

from ..errors import MegatrainValueError, format_bytes
from . import costs
from .costs import Rates


# --------------------------------------------------------------------------------------
# The problem
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Weight:
    """A parameter group streamed as a unit; several regions may read it (tied weights)."""

    id: int
    nbytes: int  # device bytes in the compute dtype: what one h2d moves
    numel: int = 0  # parameters: the host optimizer's work
    grad_nbytes: int | None = None  # device gradient bytes (default: nbytes)
    # The device gradient is held until its owner's grad_wait (a buffer the planner counts);
    # False: each gradient leaves as it is produced and the regions' work_bw counts it.
    grad_held: bool = True
    # Bytes that cross PCIe (and host memory) per fetch and per gradient copy, where they
    # differ from the device bytes: the runtime fetches the fp32 master and casts on the
    # device, and sends gradients in fp32 (defaults: nbytes, grad_bytes).
    link_nbytes: int | None = None
    grad_link_nbytes: int | None = None

    @property
    def grad_bytes(self) -> int:
        return self.nbytes if self.grad_nbytes is None else self.grad_nbytes

    @property
    def h2d_bytes(self) -> int:
        return self.nbytes if self.link_nbytes is None else self.link_nbytes

    @property
    def d2h_bytes(self) -> int:
        return self.grad_bytes if self.grad_link_nbytes is None else self.grad_link_nbytes

    @property
    def grad_buffer_bytes(self) -> int:
        return self.grad_bytes if self.grad_held else 0


@dataclass(frozen=True)
class RegionSpec:
    """One region (a layer): what it reads, what it saves for backward, what it costs."""

    id: int
    weights: tuple[int, ...] = ()
    inputs: tuple[int, ...] = ()  # regions whose boundary output this region reads
    out_bytes: object = 0  # its boundary output (saved for backward), bytes
    work_fw: object = 0  # transient device bytes while its forward runs
    work_bw: object = 0  # transient device bytes while its recompute + backward runs
    flops_fw: object = 0
    flops_bw: object = None  # backward FLOPs without the recompute; default 2 * flops_fw
    # Weights its recompute + backward reads; None: `weights`. An embedding lookup's backward
    # needs no weight; a recompute the partitioner hoisted into this region's backward span
    # reads another region's. Gradients come from the regions whose forward reads a weight.
    bw_weights: tuple[int, ...] | None = None

    def reads(self, phase: str) -> tuple[int, ...]:
        """Weights fetched for this region's forward ("fw") or recompute + backward ("bw")."""
        return self.weights if phase == "fw" or self.bw_weights is None else self.bw_weights


@dataclass(frozen=True)
class Problem:
    """One training step's regions in forward (topological) order.

    backward_order: the order of the backward graph; default the reverse forward order.
    base_bytes: device bytes live through the whole step (inputs, loss, workspace).
    training: False for a forward-only step (inference): no backward, no gradients, and
        boundary outputs die after their last forward reader.
    """

    regions: tuple[RegionSpec, ...]
    weights: tuple[Weight, ...] = ()
    backward_order: tuple[int, ...] | None = None
    base_bytes: object = 0
    micro_batches: int = 1
    training: bool = True

    def __post_init__(self):
        object.__setattr__(self, "regions", tuple(self.regions))
        object.__setattr__(self, "weights", tuple(self.weights))
        if self.backward_order is not None:
            object.__setattr__(self, "backward_order", tuple(self.backward_order))
        _check_problem(self)

    @classmethod
    def chain(cls, weight_bytes, out_bytes=0, flops=0, work_fw=0, work_bw=0,
              micro_batches: int = 1, base_bytes=0) -> "Problem":
        """n regions in a line, region i owning weight i (numel = bytes / 2, bf16)."""
        n = len(weight_bytes)

        def at(v, i):
            return v[i] if isinstance(v, (list, tuple)) else v

        weights = tuple(Weight(i, int(b), int(b) // 2) for i, b in enumerate(weight_bytes))
        regions = tuple(RegionSpec(i, (i,) if weight_bytes[i] else (), (i - 1,) if i else (),
                                   at(out_bytes, i), at(work_fw, i), at(work_bw, i), at(flops, i))
                        for i in range(n))
        return cls(regions, weights, None, base_bytes, micro_batches)

    @property
    def phases(self) -> tuple[str, ...]:
        return ("fw", "bw") if self.training else ("fw",)

    @property
    def free_symbols(self) -> set:
        out = set()
        for v in self._sizes():
            if isinstance(v, sympy.Basic):
                out |= v.free_symbols
        return out

    def _sizes(self):
        yield self.base_bytes
        for r in self.regions:
            yield from (r.out_bytes, r.work_fw, r.work_bw, r.flops_fw, r.flops_bw)

    def substitute(self, dims: Mapping | None = None) -> "Problem":
        """The same problem with every size evaluated at `dims` ({symbol or name: int})."""
        env = _env(dims, self.free_symbols)

        def ev(v, what):
            if v is None or isinstance(v, int):
                return v
            out = sympy.sympify(v).subs(env)
            if out.free_symbols:
                raise MegatrainValueError(
                    f"{what} = {v} still depends on {sorted(map(str, out.free_symbols))} after "
                    f"substituting {dict(env)}: give every symbolic dim a value")
            return int(sympy.ceiling(out))

        regions = tuple(replace(r, out_bytes=ev(r.out_bytes, f"region {r.id} out_bytes"),
                                work_fw=ev(r.work_fw, f"region {r.id} work_fw"),
                                work_bw=ev(r.work_bw, f"region {r.id} work_bw"),
                                flops_fw=ev(r.flops_fw, f"region {r.id} flops_fw"),
                                flops_bw=ev(r.flops_bw, f"region {r.id} flops_bw"))
                        for r in self.regions)
        return replace(self, regions=regions, base_bytes=ev(self.base_bytes, "base_bytes"))


def with_update_sites(problem: Problem, sites: Mapping[int, str]) -> Problem:
    """`problem` as the runtime runs it once some weights' AdamW updates leave the host.
    `sites` maps weight ids (a parameter's first fetch) to "resident" or "device"
    (compiler/update_sites.py chooses them after planning, so the search never sees them):

    - "resident": master, m and v live on the device, so its fetches, its gradient's copy
      and its update move nothing over the link or through host memory;
    - "device": no host update; the state crosses the link, 12 B/param each way, charged
      to the gradient's copy (an upper bound: the runtime overlaps the two directions).

    Device bytes do not change (a site's buffers live in the reserve beside the plan's
    peak), so the chosen schedule stays valid under them; only its timeline moves."""
    weights = []
    for w in problem.weights:
        site = sites.get(w.id)
        if site == "resident":
            w = replace(w, numel=0, link_nbytes=0, grad_link_nbytes=0)
        elif site == "device":
            w = replace(w, numel=0, grad_link_nbytes=2 * costs.DEVICE_LINK_BYTES * w.numel)
        elif site not in (None, "host"):
            raise ValueError(f"update site {site!r} of weight {w.id}: expected 'host', 'device' or 'resident'")
        weights.append(w)
    return replace(problem, weights=tuple(weights))


def _env(dims: Mapping | None, symbols) -> dict:
    """{symbol: value} from keys that are symbols or symbol names (matched by name, so a
    name finds a symbol declared with assumptions)."""
    by_name = {str(s): s for s in symbols}
    return {(by_name.get(k, sympy.Symbol(k)) if isinstance(k, str) else k): v
            for k, v in (dims or {}).items()}


def _check_problem(p: Problem) -> None:
    if not p.regions:
        raise MegatrainValueError("Problem.regions is empty: a step needs at least one region")
    if not isinstance(p.micro_batches, int) or p.micro_batches < 1:
        raise MegatrainValueError(f"micro_batches={p.micro_batches!r}: give an int >= 1")
    wids = [w.id for w in p.weights]
    if len(set(wids)) != len(wids):
        raise MegatrainValueError(f"weight ids repeat: {wids}")
    for w in p.weights:
        if w.nbytes < 0 or w.numel < 0 or w.grad_bytes < 0:
            raise MegatrainValueError(f"weight {w.id}: sizes must be >= 0")
    seen: set[int] = set()
    for r in p.regions:
        if r.id in seen:
            raise MegatrainValueError(f"region id {r.id} appears twice")
        bad = [i for i in r.inputs if i not in seen]
        if bad:
            raise MegatrainValueError(
                f"region {r.id} reads regions {bad} that do not come before it: list regions "
                f"in forward (topological) order")
        for ws in (r.weights, r.bw_weights or ()):
            missing = [w for w in ws if w not in set(wids)]
            if missing:
                raise MegatrainValueError(f"region {r.id} uses unknown weights {missing}")
            if len(set(ws)) != len(ws):
                raise MegatrainValueError(f"region {r.id} lists a weight twice: {ws}")
        for name in ("out_bytes", "work_fw", "work_bw", "flops_fw", "flops_bw"):
            v = getattr(r, name)
            if isinstance(v, (int, float)) and v < 0:
                raise MegatrainValueError(f"region {r.id} {name}={v}: sizes must be >= 0")
        seen.add(r.id)
    if p.backward_order is not None:
        if sorted(p.backward_order) != sorted(seen):
            raise MegatrainValueError(
                f"backward_order {list(p.backward_order)} is not a permutation of the regions")
        pos = {r: i for i, r in enumerate(p.backward_order)}
        for r in p.regions:
            for i in r.inputs:
                if pos[i] < pos[r.id]:
                    raise MegatrainValueError(
                        f"backward_order runs region {i} before its consumer {r.id}: gradients "
                        f"flow from consumers to producers")


class _Shape:
    """Structural facts of a problem, derived once: orders, consumers, weight owners."""

    def __init__(self, p: Problem):
        self.problem = p
        self.region = {r.id: r for r in p.regions}
        self.weight = {w.id: w for w in p.weights}
        self.fw = tuple(r.id for r in p.regions)
        self.bw = p.backward_order or tuple(reversed(self.fw))
        self.pos = {"fw": {r: i for i, r in enumerate(self.fw)},
                    "bw": {r: i for i, r in enumerate(self.bw)}}
        cons: dict[int, list[int]] = {r: [] for r in self.fw}
        for r in p.regions:
            for i in r.inputs:
                if r.id not in cons[i]:
                    cons[i].append(r.id)
        self.consumers = {r: tuple(c) for r, c in cons.items()}
        pf, pb = self.pos["fw"], self.pos["bw"]
        self.last_fw_consumer = {i: max(c, key=pf.__getitem__) for i, c in cons.items() if c}
        self.first_bw_consumer = {i: min(c, key=pb.__getitem__) for i, c in cons.items() if c}
        self.last_bw_consumer = {i: max(c, key=pb.__getitem__) for i, c in cons.items() if c}
        self.phases = p.phases
        self.reads = {ph: {r.id: r.reads(ph) for r in p.regions} for ph in ("fw", "bw")}
        self.wbytes = {ph: {r: sum(self.weight[w].nbytes for w in ws) for r, ws in self.reads[ph].items()}
                       for ph in ("fw", "bw")}
        self.link_bytes = {ph: {r: sum(self.weight[w].h2d_bytes for w in ws) for r, ws in self.reads[ph].items()}
                           for ph in ("fw", "bw")}
        users: dict[int, list[int]] = {w.id: [] for w in p.weights}
        for r in p.regions:
            for w in r.weights:
                users[w].append(r.id)
        self.users = {w: tuple(u) for w, u in users.items() if u}
        # Gradients (and the host steps they feed) exist only in a training step.
        self.owner = {w: max(u, key=pb.__getitem__) for w, u in self.users.items()} if p.training else {}
        self.first_producer = {w: min(u, key=pb.__getitem__) for w, u in self.users.items()}
        owned: dict[int, list[int]] = {}
        for w in sorted(self.owner):
            owned.setdefault(self.owner[w], []).append(w)
        self.owned = {o: tuple(ws) for o, ws in owned.items()}
        # Host memory bytes the copies of each owner's weights move per micro-batch: every
        # fetch reads the master, every gradient copy writes it (see costs.host_step_seconds).
        fetches = collections.Counter(w for ph in self.phases for ws in self.reads[ph].values() for w in ws)
        self.copy_bytes = {o: sum(fetches[w] * self.weight[w].h2d_bytes + self.weight[w].d2h_bytes for w in ws)
                           for o, ws in self.owned.items()}
        # Regions whose forward weights may stay on the device for their backward: training,
        # the backward reads the same weights, and no other region reads them (a weight read
        # by two regions is fetched for each). Soonest-needed first: first in backward.
        readers: dict[int, set[int]] = collections.defaultdict(set)
        for ph in ("fw", "bw"):
            for r, ws in self.reads[ph].items():
                for w in ws:
                    readers[w].add(r)
        self.keepable = tuple(sorted(
            (r for r in self.fw if p.training and self.reads["fw"][r]
             and set(self.reads["bw"][r]) == set(self.reads["fw"][r])
             and all(readers[w] == {r} for w in self.reads["fw"][r])),
            key=pb.__getitem__)) if "bw" in self.phases else ()
        n = len(self.fw)
        # Offload candidates, longest-lived first: a kept output lives from its forward to
        # its last backward consumer, so those produced early and read late cost the most.
        self.offloadable = tuple(sorted(
            self.first_bw_consumer,
            key=lambda i: (-(n - pf[i] + pb[self.last_bw_consumer[i]]), i))) if p.training else ()


# --------------------------------------------------------------------------------------
# Configurations and the program (compute-stream order, buffers, side streams)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanConfig:
    """One point of the planner's search space.

    slots: device buffers for region weights (prefetch depth = slots - 1).
    weight_lead: issue a prefetch at most this many computes before its use (None: as
        soon as a slot frees).
    reload_lead: issue an offloaded activation's reload this many computes before its
        first backward use.
    release_lag: computes between a copy-out's issue and the op that waits for it and
        frees the device buffer (gradients, offloaded activations).
    offloaded: regions whose boundary output goes to pinned host between the passes.
    kept: regions whose forward weights stay on the device for their backward (no second
        fetch; `_Shape.keepable`): the buffer lives from the forward's prefetch to the
        backward's free, outside the slot rotation.
    """

    slots: int
    weight_lead: int | None
    reload_lead: int
    release_lag: int
    offloaded: frozenset = frozenset()
    kept: frozenset = frozenset()

    def __post_init__(self):
        if not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"PlanConfig.slots={self.slots!r}: need at least one slot")
        for name in ("reload_lead", "release_lag"):
            if getattr(self, name) < 0:
                raise ValueError(f"PlanConfig.{name}={getattr(self, name)!r} must be >= 0")
        if self.weight_lead is not None and self.weight_lead < 0:
            raise ValueError(f"PlanConfig.weight_lead={self.weight_lead!r} must be >= 0 or None")
        object.__setattr__(self, "offloaded", frozenset(self.offloaded))

    def describe(self) -> str:
        lead = "asap" if self.weight_lead is None else f"<= {self.weight_lead} ahead"
        return (f"{self.slots} slot(s), prefetch {lead}, reload {self.reload_lead} ahead, "
                f"release lag {self.release_lag}, {len(self.offloaded)} activation(s) offloaded"
                + (f", {len(self.kept)} region(s)' weights kept for the backward" if self.kept else ""))


class Task(NamedTuple):
    kind: str
    region: int  # the region; for d2h/host tasks the owner region of the weights moved
    phase: str  # "fw" | "bw" | "host"
    micro: int = 0
    step: int = 0


STREAMS = ("compute", "h2d", "d2h", "host")
STREAM_OF = {"prefetch": "compute", "compute": "compute", "free": "compute", "keep": "compute",
             "restore": "compute", "offload_wait": "compute", "grad_wait": "compute",
             "h2d": "h2d", "reload": "h2d", "offload": "d2h", "d2h": "d2h",
             "host_acc": "host", "host_step": "host"}


class Buffer(NamedTuple):
    """A device buffer: allocated when `alloc` starts, freed when `free` ends (both
    compute-stream tasks, so its life is a span of the program order)."""

    key: tuple
    nbytes: object
    alloc: Task
    free: Task


@dataclass
class Program:
    compute: list[Task]
    buffers: list[Buffer]
    slot_of: dict[Task, int]
    h2d: list[Task] = field(default_factory=list)
    d2h: list[Task] = field(default_factory=list)
    host: list[Task] = field(default_factory=list)
    data: list[tuple[Task, Task]] = field(default_factory=list)
    slot: list[tuple[Task, Task]] = field(default_factory=list)


def _program(sh: _Shape, cfg: PlanConfig, steps: int, memory_only: bool = False) -> Program:
    """Lay out every op of `steps` steps in program order, by rule (see module docstring)."""
    prog = Program([], [], {})
    micro = sh.problem.micro_batches
    for s in range(steps):
        for m in range(micro):
            _instance(sh, cfg, m, s, prog, memory_only)
    if not memory_only:
        _side_streams(sh, prog, micro, steps, cfg.kept)
    return prog


def _instance(sh: _Shape, cfg: PlanConfig, m: int, s: int, prog: Program, memory_only: bool) -> None:
    R = sh.region
    offl = cfg.offloaded
    L = cfg.release_lag
    for ph in sh.phases:
        order = sh.fw if ph == "fw" else sh.bw
        pos = sh.pos[ph]
        n = len(order)
        frees: list[list] = [[] for _ in range(n + 1)]
        waits: list[list] = [[] for _ in range(n + 1)]
        issues: list[list] = [[] for _ in range(n + 1)]
        wr = [r for r in order if sh.reads[ph][r]]
        k = cfg.slots
        kept = cfg.kept
        # The slot rotation: regions whose weights are fetched and freed in this pass. A kept
        # region's forward buffer is its own (issued where its place in the rotation would
        # issue it), and its backward has no fetch, only the free after its compute.
        rotating = [r for r in wr if r not in kept]
        slot_index = {r: j for j, r in enumerate(rotating)}
        for j, r in enumerate(wr):
            p = pos[r]
            if ph == "bw" and r in kept:
                frees[p + 1].append(((p, r), Task("free", r, ph, m, s)))
                continue
            if r in kept:
                g = 0 if j < k else pos[wr[j - k]] + 1
            else:
                i = slot_index[r]
                g = 0 if i < k else pos[rotating[i - k]] + 1
            if cfg.weight_lead is not None:
                g = max(g, p - cfg.weight_lead)
            pf = Task("prefetch", r, ph, m, s)
            issues[g].append(((p, 0, r), pf))
            if r in kept:  # forward, kept: its buffer goes in the backward, after its compute
                frees[p + 1].append(((p, r), Task("keep", r, ph, m, s)))
                prog.buffers.append(Buffer(("weights", r, ph, m, s), sh.wbytes[ph][r], pf,
                                           Task("free", r, "bw", m, s)))
                continue
            fr = Task("free", r, ph, m, s)
            frees[p + 1].append(((p, r), fr))
            prog.slot_of[pf] = slot_index[r] % k
            prog.buffers.append(Buffer(("weights", r, ph, m, s), sh.wbytes[ph][r], pf, fr))
            if slot_index[r] >= k and not memory_only:
                prog.slot.append((Task("free", rotating[slot_index[r] - k], ph, m, s), pf))
        if ph == "fw":
            for i in offl:
                g = min(n, max(pos[i] + L, pos[sh.last_fw_consumer[i]]) + 1)
                waits[g].append(((pos[i], i), Task("offload_wait", i, ph, m, s)))
        else:
            for i in offl:
                p1 = pos[sh.first_bw_consumer[i]]
                issues[max(0, p1 - cfg.reload_lead)].append(((p1, 1, i), Task("restore", i, ph, m, s)))
            for o in sh.owned:
                waits[min(n, pos[o] + L + 1)].append(((pos[o], o), Task("grad_wait", o, ph, m, s)))
        seq = prog.compute
        for g in range(n + 1):
            for lst in (frees[g], waits[g], issues[g]):
                if lst:
                    lst.sort()
                    seq.extend(t for _, t in lst)
            if g < n:
                r = order[g]
                c = Task("compute", r, ph, m, s)
                seq.append(c)
                spec = R[r]
                prog.buffers.append(Buffer(("work", r, ph, m, s),
                                           spec.work_fw if ph == "fw" else spec.work_bw, c, c))
    # Activation-side and gradient buffers span both passes of this micro-batch.
    for r in sh.fw:
        prog.buffers.extend(_output_buffers(sh, r, r in offl, m, s))
        if r in sh.first_bw_consumer and sh.problem.training:
            prog.buffers.append(Buffer(("actgrad", r, m, s), R[r].out_bytes,
                                       Task("compute", sh.first_bw_consumer[r], "bw", m, s),
                                       Task("compute", r, "bw", m, s)))
    for w, o in sh.owner.items():
        prog.buffers.append(Buffer(("grad", w, m, s), sh.weight[w].grad_buffer_bytes,
                                   Task("compute", sh.first_producer[w], "bw", m, s),
                                   Task("grad_wait", o, "bw", m, s)))


def _output_buffers(sh: _Shape, r: int, offloaded: bool, m: int, s: int) -> list[Buffer]:
    """Region r's boundary output: kept until its last backward reader, or offloaded (device
    copy until offload_wait) and reloaded (from restore to its last backward reader)."""
    size = sh.region[r].out_bytes
    c_fw = Task("compute", r, "fw", m, s)
    if not sh.problem.training:  # read by later forwards, or returned: to the pass's end
        reader = sh.last_fw_consumer.get(r, sh.fw[-1])
        return [Buffer(("act", r, m, s), size, c_fw, Task("compute", reader, "fw", m, s))]
    if offloaded:
        last = Task("compute", sh.last_bw_consumer[r], "bw", m, s)
        return [Buffer(("act", r, m, s), size, c_fw, Task("offload_wait", r, "fw", m, s)),
                Buffer(("reload", r, m, s), size, Task("restore", r, "bw", m, s), last)]
    reader = sh.last_bw_consumer.get(r, r)  # a sink's output feeds the loss: its own backward
    return [Buffer(("act", r, m, s), size, c_fw, Task("compute", reader, "bw", m, s))]


class _PeakCurve:
    """Peak bytes as a function of how many offload candidates (longest-lived first) are
    offloaded, other choices fixed. The program with every candidate offloaded has a place
    for every op any prefix needs (ops without buffers do not move the live bytes), so
    each prefix is that program's buffer deltas with each output's kept or offloaded
    spans added: a prefix sum instead of a new program."""

    def __init__(self, sh: _Shape, slots: int, weight_lead, reload_lead: int, release_lag: int):
        self.sh = sh
        self.cfg = PlanConfig(slots, weight_lead, reload_lead, release_lag, frozenset(sh.offloadable))
        prog = _program(sh, self.cfg, 1, memory_only=True)
        self.program = prog
        at = {t: i for i, t in enumerate(prog.compute)}
        self.at = at
        variable = set(sh.offloadable)
        fixed = [0] * (len(prog.compute) + 1)
        for b in prog.buffers:
            if b.key[0] in ("act", "reload") and b.key[1] in variable:
                continue
            fixed[at[b.alloc]] += b.nbytes
            fixed[at[b.free] + 1] -= b.nbytes
        self.fixed = fixed
        self.spans = {i: ([(at[b.alloc], at[b.free], b.nbytes) for b in _output_buffers(sh, i, False, 0, 0)],
                          [(at[b.alloc], at[b.free], b.nbytes) for b in _output_buffers(sh, i, True, 0, 0)])
                      for i in sh.offloadable}

    def config(self, m: int) -> PlanConfig:
        return replace(self.cfg, offloaded=frozenset(self.sh.offloadable[:m]))

    def peak(self, m: int) -> tuple[int, Task | None]:
        d = list(self.fixed)
        for j, i in enumerate(self.sh.offloadable):
            for a, f, size in self.spans[i][j < m]:
                d[a] += size
                d[f + 1] -= size
        live = best = self.sh.problem.base_bytes
        best_at = None
        for t, x in zip(self.program.compute, d):
            live += x
            if live > best:
                best, best_at = live, t
        return best, best_at


def _side_streams(sh: _Shape, prog: Program, micro: int, steps: int, kept: frozenset = frozenset()) -> None:
    """Copies and host work in issue order (CUDA streams and the host worker are FIFO),
    with their data edges."""
    data = prog.data
    offload_waits = {t for t in prog.compute if t.kind == "offload_wait"}
    for t in prog.compute:
        kind = t.kind
        if kind == "prefetch":
            h = Task("h2d", t.region, t.phase, t.micro, t.step)
            prog.h2d.append(h)
            data.append((t, h))
            data.append((h, Task("compute", t.region, t.phase, t.micro, t.step)))
        elif kind == "restore":
            h = Task("reload", t.region, "bw", t.micro, t.step)
            prog.h2d.append(h)
            data.append((t, h))
            data.append((h, Task("compute", sh.first_bw_consumer[t.region], "bw", t.micro, t.step)))
        elif kind == "compute":
            if sh.reads[t.phase][t.region]:
                kept_fw = t.phase == "fw" and t.region in kept
                data.append((t, Task("keep" if kept_fw else "free", t.region, t.phase, t.micro, t.step)))
            if t.phase == "fw":
                wait = Task("offload_wait", t.region, "fw", t.micro, t.step)
                if wait in offload_waits:
                    o = Task("offload", t.region, "fw", t.micro, t.step)
                    prog.d2h.append(o)
                    data.append((t, o))
                    data.append((o, wait))
            elif t.region in sh.owned:
                d = Task("d2h", t.region, "bw", t.micro, t.step)
                prog.d2h.append(d)
                data.append((t, d))
                data.append((d, Task("grad_wait", t.region, "bw", t.micro, t.step)))
    last = micro - 1
    for d in prog.d2h:
        if d.kind != "d2h":
            continue
        kind = "host_acc" if d.micro < last else "host_step"
        h = Task(kind, d.region, "host", d.micro, d.step)
        prog.host.append(h)
        data.append((d, h))
        if d.micro > 0:
            data.append((Task("host_acc", d.region, "host", d.micro - 1, d.step), h))
        if kind == "host_step" and d.step + 1 < steps:
            for w in sh.owned[d.region]:
                for r in sh.users[w]:
                    data.append((h, Task("h2d", r, "fw", 0, d.step + 1)))


_BUFFER_KINDS = {"work": "working set", "act": "boundary activations", "reload": "reloaded activations",
                 "actgrad": "activation gradients", "weights": "weights", "grad": "weight gradients"}


def live_at(sh: "_Shape", cfg: PlanConfig, at: Task) -> dict[str, tuple[int, int]]:
    """Device bytes live at `at` (a compute op of one step of `cfg`) by buffer kind (keys of
    _BUFFER_KINDS, and "base"): (bytes, buffers). They sum to the peak when `at` is where
    the program peaks."""
    prog = _program(sh, cfg, 1, memory_only=True)
    pos = {t: i for i, t in enumerate(prog.compute)}
    i = pos[at]
    kinds: dict[str, tuple[int, int]] = {}
    for b in prog.buffers:
        if pos[b.alloc] <= i <= pos[b.free] and b.nbytes:
            n, c = kinds.get(b.key[0], (0, 0))
            kinds[b.key[0]] = (n + b.nbytes, c + 1)
    if sh.problem.base_bytes:
        kinds["base"] = (sh.problem.base_bytes, 1)
    return kinds


def describe_live(kinds: dict[str, tuple[int, int]]) -> str:
    """The part of an infeasible-budget error that says what to shrink, largest first."""
    parts = sorted(kinds.items(), key=lambda kv: -kv[1][0])
    return ", ".join(f"{_BUFFER_KINDS.get(k, 'inputs and workspace')} {format_bytes(n)}"
                     + (f" ({c})" if c > 1 else "") for k, (n, c) in parts)


def program_peak(prog: Program, base=0) -> tuple[object, Task | None]:
    """Peak device bytes of a program: walk the compute stream, allocate at an op's start,
    free at its end. Works for int and sympy sizes alike (for sympy, see `peak_expression`)."""
    allocs: dict[Task, list] = {}
    frees: dict[Task, list] = {}
    for b in prog.buffers:
        allocs.setdefault(b.alloc, []).append(b.nbytes)
        frees.setdefault(b.free, []).append(b.nbytes)
    live = base
    peak, at = base, None
    for t in prog.compute:
        a = allocs.get(t)
        if a:
            live += sum(a)
            if live > peak:
                peak, at = live, t
        f = frees.get(t)
        if f:
            live -= sum(f)
    return peak, at


def peak_expression(problem: Problem, config: PlanConfig):
    """Peak device bytes of `config` as a sympy expression in the problem's symbolic dims:
    the Max, over every point of the program, of the bytes live there (terms dominated
    coefficient-wise by another are dropped)."""
    sh = _Shape(problem)
    prog = _program(sh, config, 1, memory_only=True)
    allocs: dict[Task, list] = {}
    frees: dict[Task, list] = {}
    for b in prog.buffers:
        allocs.setdefault(b.alloc, []).append(sympy.sympify(b.nbytes))
        frees.setdefault(b.free, []).append(sympy.sympify(b.nbytes))
    live = sympy.sympify(problem.base_bytes)
    points = [live]
    for t in prog.compute:
        if t in allocs:
            live = sympy.expand(live + sum(allocs[t]))
            points.append(live)
        if t in frees:
            live = sympy.expand(live - sum(frees[t]))
    return sympy.Max(*_undominated(points))


def _undominated(exprs: list) -> list:
    syms = sorted(set().union(*(e.free_symbols for e in exprs)), key=str)
    if not syms:
        return [max(exprs)]
    polys = []
    for e in set(exprs):
        try:
            polys.append((e, sympy.Poly(e, *syms).as_dict()))
        except sympy.PolynomialError:
            return list(set(exprs))
    keep = []
    for e, d in polys:
        dominated = False
        for f, g in polys:
            if f is e:
                continue
            monos = set(d) | set(g)
            if all(d.get(mo, 0) <= g.get(mo, 0) for mo in monos) and (d != g or str(f) < str(e)):
                dominated = True
                break
        if not dominated:
            keep.append(e)
    return keep


def largest_fitting(expr, symbol, budget: int, dims: Mapping | None = None, hi: int = 1 << 40) -> int:
    """The largest integer value of `symbol` (others fixed by `dims`) whose `expr` fits
    `budget`; 0 if even 1 does not fit. Sizes grow with dims, so a binary search suffices."""
    expr = sympy.sympify(expr)
    f = sympy.lambdify(symbol, expr.subs(_env(dims, expr.free_symbols)))
    if f(1) > budget:
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if f(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --------------------------------------------------------------------------------------
# Task graph and list scheduler
# --------------------------------------------------------------------------------------


def _durations(sh: _Shape, cfg: PlanConfig, rates: Rates) -> dict:
    """Seconds per (kind, region, phase), from the cost model; zero for compute-stream ops."""
    link = {"fw": costs.link_rates(rates, any(sh.wbytes["fw"].values()), bool(cfg.offloaded)),
            "bw": costs.link_rates(rates, any(sh.wbytes["bw"].values()) or bool(cfg.offloaded),
                                   bool(sh.owned))}
    out = {}
    for r in sh.problem.regions:
        f = r.flops_fw
        b = 2 * f if r.flops_bw is None else r.flops_bw
        out[("compute", r.id, "fw")] = costs.compute_seconds(f, rates)
        out[("compute", r.id, "bw")] = costs.compute_seconds(f + b, rates)
        for ph in ("fw", "bw"):
            out[("h2d", r.id, ph)] = costs.copy_seconds(sh.link_bytes[ph][r.id], link[ph].h2d)
        out[("offload", r.id, "fw")] = costs.copy_seconds(r.out_bytes, link["fw"].d2h)
        out[("reload", r.id, "bw")] = costs.copy_seconds(r.out_bytes, link["bw"].h2d)
    for o, ws in sh.owned.items():
        out[("d2h", o, "bw")] = costs.copy_seconds(sum(sh.weight[w].d2h_bytes for w in ws), link["bw"].d2h)
        numel = sum(sh.weight[w].numel for w in ws)
        # a kept region (its weights are its own) is fetched once: no backward fetch
        copy = sh.copy_bytes[o] - (sh.link_bytes["bw"][o] if o in cfg.kept else 0)
        out[("host_step", o, "host")] = costs.host_step_seconds(numel, rates, copy)
        out[("host_acc", o, "host")] = costs.host_accumulate_seconds(numel, rates, copy)
    return out


def task_graph(prog: Program, sh: _Shape, cfg: PlanConfig, rates: Rates) -> nx.DiGraph:
    """The networkx task graph: nodes carry stream, seconds (and weights moved, for copies
    and host steps); edges carry kind "data", "stream" (FIFO order) or "slot"."""
    dur = _durations(sh, cfg, rates)
    G = nx.DiGraph()
    for seq in (prog.compute, prog.h2d, prog.d2h, prog.host):
        for t in seq:
            attrs = {"stream": STREAM_OF[t.kind], "seconds": dur.get(t[:3], 0.0)}
            if t.kind in ("d2h", "host_step", "host_acc"):
                attrs["weights"] = sh.owned[t.region]
            G.add_node(t, **attrs)
    for seq in (prog.compute, prog.h2d, prog.d2h, prog.host):
        G.add_edges_from(zip(seq, seq[1:]), kind="stream")
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
            if end[p] > t0:
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
    stray = sorted(set(config.kept) - set(sh.keepable))
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


# --------------------------------------------------------------------------------------
# The planner: search configurations that fit, simulate them, keep the fastest
# --------------------------------------------------------------------------------------


class InfeasibleBudget(MegatrainValueError):
    """No configuration fits: `min_budget` is the smallest budget that would."""

    def __init__(self, message: str, min_budget: int):
        super().__init__(message)
        self.min_budget = min_budget


@dataclass(frozen=True)
class PlannerOptions:
    """The search space. The leanest point (1 slot issued just in time, reload lead 0,
    release lag 0, every boundary output offloaded) is always included, so the planner
    fails only when no schedule of this model fits.

    offload: whether boundary outputs may go to host memory between the passes (False
    while the runtime has no activation offload: every output stays on the device).
    keep: whether regions may keep their forward weights for their backward where the
        budget has room beside the chosen schedule (`_with_kept`).
    """

    max_slots: int = 3
    reload_leads: tuple[int, ...] = (0, 1, 2)
    release_lags: tuple[int, ...] = (0, 1)
    steps: int = 2
    offload: bool = True
    keep: bool = False


@dataclass
class Plan:
    schedule: Schedule
    budget: int
    simulated: int  # schedules simulated to choose this one
    symbolic: Problem | None = None  # the problem before substitution, if it had symbols
    candidates: tuple[PlanConfig, ...] = ()  # every configuration that fit the budget
    dims: dict = field(default_factory=dict)  # the symbolic dims' values planned for

    @property
    def config(self) -> PlanConfig:
        return self.schedule.config

    @property
    def peak_bytes(self) -> int:
        return self.schedule.peak_bytes

    @property
    def step_time(self) -> float:
        return self.schedule.step_time

    @property
    def gpu_idle(self) -> float:
        return self.schedule.gpu_idle

    def peak_expression(self):
        """The chosen schedule's peak as a sympy expression in the problem's dims."""
        return peak_expression(self.symbolic or self.schedule.problem, self.config)

    def events(self, forward_uses: list[RegionUse], backward_uses: list[RegionUse]) -> "GraphEvents":
        return graph_events(self.schedule, forward_uses, backward_uses)


def plan_step(problem: Problem, budget: int, rates: Rates, dims: Mapping | None = None,
              options: PlannerOptions = PlannerOptions()) -> Plan:
    """The fastest schedule (predicted) whose peak device bytes fit `budget`.

    Raises InfeasibleBudget (a MegatrainValueError) naming the minimum budget when none fits.
    """
    with _no_cyclic_gc():
        return _plan_step(problem, budget, rates, dims, options)


def _plan_step(problem: Problem, budget: int, rates: Rates, dims: Mapping | None,
               options: PlannerOptions) -> Plan:
    if options.max_slots < 1 or options.steps < 1 or min(options.reload_leads + options.release_lags, default=0) < 0:
        raise ValueError(f"{options}: max_slots and steps must be >= 1, leads and lags >= 0")
    symbolic = problem if problem.free_symbols else None
    concrete = problem.substitute(dims) if symbolic is not None or dims else problem
    sh = _Shape(concrete)
    n_weight_regions = sum(1 for r in concrete.regions if r.weights)
    modes = [(1, 0)] + [(k, None) for k in range(1, max(1, min(options.max_slots, n_weight_regions)) + 1)]
    offl = sh.offloadable if options.offload else ()
    leads = sorted(set(options.reload_leads) | {0}) if offl else [0]
    lags = sorted(set(options.release_lags) | {0}) if (offl or sh.owned) else [0]
    fits: list[PlanConfig] = []
    leanest: tuple | None = None
    for slots, wlead in modes:
        for rlead in leads:
            least_m = None  # offloads needed with the next-smaller release lag
            for lag in lags:
                curve = _PeakCurve(sh, slots, wlead, rlead, lag)
                p_full, at = curve.peak(len(offl))
                if leanest is None or p_full < leanest[0]:
                    leanest = (p_full, at, curve.config(len(offl)))
                if p_full > budget:
                    continue
                lo, hi = 0, len(offl)  # peak is non-increasing in m: the least m that fits
                while lo < hi:
                    mid = (lo + hi) // 2
                    if curve.peak(mid)[0] <= budget:
                        hi = mid
                    else:
                        lo = mid + 1
                cfg = curve.config(lo)
                if not cfg.offloaded:
                    cfg = replace(cfg, reload_lead=0)
                if least_m is not None and least_m[0] == lo and least_m[1] in fits:
                    # A longer lag only moves waits later: same offloads, never slower.
                    fits.remove(least_m[1])
                least_m = (lo, cfg)
                if cfg not in fits:
                    fits.append(cfg)
    if not fits:
        p, at, cfg = leanest
        where = f" (during the {'forward' if at.phase == 'fw' else 'backward'} of region {at.region}: " \
                f"{describe_live(live_at(sh, cfg, at))})" if at else ""
        raise InfeasibleBudget(
            f"gpu_memory={budget} bytes ({format_bytes(budget)}) is too small: the leanest "
            f"schedule of this step ({cfg.describe()}) still peaks at {p} bytes ({format_bytes(p)})"
            f"{where}; give gpu_memory >= {p} bytes or use a smaller batch/sequence", int(p))
    best = None
    for i, cfg in enumerate(fits):
        sched = _simulate(concrete, cfg, rates, options.steps)
        key = (sched.step_time, sched.peak_bytes, i)
        if best is None or key < best[0]:
            best = (key, sched)
    chosen, simulated = best[1], len(fits)
    if options.keep and sh.keepable:
        cfg = _with_kept(sh, chosen.config, budget)
        if cfg.kept:
            sched = _simulate(concrete, cfg, rates, options.steps)
            simulated += 1
            fits.append(cfg)
            if sched.step_time <= chosen.step_time:
                chosen = sched
    return Plan(chosen, budget, simulated, symbolic, tuple(fits), _env(dims, problem.free_symbols))


def _with_kept(sh: _Shape, cfg: PlanConfig, budget: int) -> PlanConfig:
    """`cfg` with the most regions keeping their forward weights for the backward (the
    soonest needed first, `_Shape.keepable`) whose peak still fits `budget`. Each kept
    region saves a fetch of its weights: PCIe bytes and, for the host optimizer's memory
    bandwidth, a read of its masters; it costs device memory from its forward to its
    backward. Peaks grow with the count, so a binary search (which only ever settles on a
    count it saw fit)."""
    def fits(n: int) -> bool:
        trial = replace(cfg, kept=frozenset(sh.keepable[:n]))
        return program_peak(_program(sh, trial, 1, memory_only=True), sh.problem.base_bytes)[0] <= budget

    lo, hi = 0, len(sh.keepable)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return replace(cfg, kept=frozenset(sh.keepable[:lo]))


# --------------------------------------------------------------------------------------
# From a schedule to the FX pass's event lists
# --------------------------------------------------------------------------------------

WEIGHT_KINDS = ("prefetch", "wait", "evict", "keep")
ACTIVATION_KINDS = ("offload", "offload_wait", "reload", "reload_wait")


@dataclass(frozen=True)
class RegionUse:
    """Where a region runs in one FX graph: node positions of its first and last node."""

    region: int
    first: int
    last: int


@dataclass(frozen=True)
class Transfer:
    """One compute-stream op of the schedule, anchored to a node position of an FX graph."""

    kind: str  # "prefetch" | "wait" | "evict" | "keep" (and, in GraphEvents.*_all, the others)
    region: int
    anchor: int  # node position; -1 means "at graph start"
    after: bool  # insert after the anchor (True) or before it (False)


@dataclass
class GraphEvents:
    """Events of one forward and one backward graph, in program order.

    `forward` and `backward` hold the weight events (prefetch / wait / evict). `*_all` add
    (`passes.insert_transfers` materialises the weight and activation events, not grad_wait):
    offload (start D2H of region i's boundary output), offload_wait (wait for it, drop the
    device copy), reload (start its H2D in backward), reload_wait (before its first
    backward use), grad_wait (wait for region o's gradients' D2H, free them on the device).
    """

    forward_all: list[Transfer]
    backward_all: list[Transfer]

    @property
    def forward(self) -> list[Transfer]:
        return [t for t in self.forward_all if t.kind in WEIGHT_KINDS]

    @property
    def backward(self) -> list[Transfer]:
        return [t for t in self.backward_all if t.kind in WEIGHT_KINDS]


def graph_events(schedule: Schedule, forward_uses: list[RegionUse], backward_uses: list[RegionUse],
                 step: int = 0, micro: int = 0) -> GraphEvents:
    """Anchor the schedule's compute-stream ops of one micro-batch to FX node positions.

    An op between compute(a) and compute(b) goes after region a's last use (after=True,
    in order), or at graph start (anchor -1) before the first compute; waits go before the
    consuming region's first use. A region without a RegionUse has no nodes in that graph
    (e.g. no backward at all): ops after it go where ops after its predecessor went.
    """
    sh = _Shape(schedule.problem)
    out = {"fw": [], "bw": []}
    for ph, uses in zip(sh.phases, (forward_uses, backward_uses)):
        by_region = {u.region: u for u in uses}
        order = sh.fw if ph == "fw" else sh.bw
        seen = [u.region for u in sorted(uses, key=lambda u: u.first) if u.region in sh.pos[ph]]
        expected = [r for r in order if r in by_region]
        if seen != expected:
            raise ValueError(f"the {ph} graph uses regions in order {seen}, the plan computes "
                             f"them in order {expected}")
        reload_first: dict[int, list[int]] = {}
        if ph == "bw":
            for i in schedule.config.offloaded:
                reload_first.setdefault(sh.first_bw_consumer[i], []).append(i)
        events: list[Transfer] = []
        anchor: tuple[int, bool] = (-1, True)
        for t in schedule.streams["compute"]:
            if t.phase != ph or t.step != step or t.micro != micro:
                continue
            if t.kind == "compute":
                r = t.region
                if sh.reads[ph][r] or r in reload_first or (ph == "fw" and r in schedule.config.offloaded):
                    if r not in by_region:
                        raise ValueError(f"region {r} has transfers but no RegionUse in the {ph} graph")
                    first = by_region[r].first
                    for i in sorted(reload_first.get(r, ())):
                        events.append(Transfer("reload_wait", i, first, False))
                    if sh.reads[ph][r]:
                        events.append(Transfer("wait", r, first, False))
                if r in by_region:
                    anchor = (by_region[r].last, True)
                if ph == "fw" and r in schedule.config.offloaded:
                    events.append(Transfer("offload", r, *anchor))
                continue
            kind = {"prefetch": "prefetch", "free": "evict", "keep": "keep", "restore": "reload",
                    "offload_wait": "offload_wait", "grad_wait": "grad_wait"}[t.kind]
            events.append(Transfer(kind, t.region, *anchor))
        out[ph] = events
    return GraphEvents(out["fw"], out["bw"])
