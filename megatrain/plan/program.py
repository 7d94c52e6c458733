"""The program: where every op of a schedule goes in the compute stream, the device buffers
it allocates and frees, and the peak device bytes that follow from that order alone.

Where things happen is decided by rule (here) and by a small search (search.py), not by
the scheduler: every allocation and every free is a compute-stream op (prefetch/restore
allocate, free/offload_wait/grad_wait release, the last two wait for their copy), so peak
device bytes are a function of the program order alone, exactly like torch's
stream-ordered caching allocator. A `PlanConfig` (one point of the search space) fixes that
order; `_program` lays it out, `_side_streams` adds the copies and host work in issue order
with their data edges, and the slot edges free(j-k) -> prefetch(j) bound the weight
buffers in flight to k slots. The peak functions (`program_peak`, `peak_expression`,
`_PeakCurve`, `live_at`) walk those buffers without simulating any time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import sympy

from ..errors import format_bytes
from .problem import Problem, _env, _Shape


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
    kept_weights: regions whose forward weights stay on the device for their backward (no second
        fetch; `_Shape.keepable`): the buffer lives from the forward's prefetch to the
        backward's free, outside the slot rotation.
    """

    slots: int
    weight_lead: int | None
    reload_lead: int
    release_lag: int
    offloaded: frozenset = frozenset()
    kept_weights: frozenset = frozenset()

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
                + (f", {len(self.kept_weights)} region(s)' weights kept for the backward" if self.kept_weights else ""))


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
             "host_acc": "host", "host_step": "host", "host_hold": "host"}


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
        _side_streams(sh, prog, micro, steps, cfg.kept_weights)
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
        kept = cfg.kept_weights
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
            prog.buffers.append(Buffer(("actgrad", r, m, s), R[r].incoming_grad_bytes,
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
    if sh.problem.updates_wait:
        _updates_wait_for_norm(sh, prog)


def _updates_wait_for_norm(sh: _Shape, prog: Program) -> None:
    """The optimizer's step() knows the global norm only once the step's last gradient is
    on the host: each final gradient is held as it arrives (a "host_hold": copied out of
    the staging slab and its norm taken), each host update starts after the step's last
    gradient copy (the d2h stream is FIFO, so after every copy), and the host runs the
    updates in the next forward's order (regions' forward order), each step's after its
    accumulations and holds."""
    last_copy = {d.step: d for d in prog.d2h if d.kind == "d2h"}
    forward = {r.id: i for i, r in enumerate(sh.problem.regions)}
    holds = {h: Task("host_hold", h.region, "host", h.micro, h.step)
             for h in prog.host if h.kind == "host_step"}
    prog.host = [t for h in prog.host for t in ((holds[h], h) if h in holds else (h,))]
    for h, hold in holds.items():
        prog.data.extend([(Task("d2h", h.region, "bw", h.micro, h.step), hold), (hold, h)])
    # stable: accumulations and holds keep their arrival order
    prog.host.sort(key=lambda h: (h.step, h.kind == "host_step",
                                  forward[h.region] if h.kind == "host_step" else 0))
    prog.data.extend((last_copy[h.step], h) for h in prog.host if h.kind == "host_step")


_BUFFER_KINDS = {"work": "working set", "act": "boundary activations", "reload": "reloaded activations",
                 "actgrad": "activation gradients", "weights": "weights", "grad": "weight gradients"}


def live_at(sh: _Shape, cfg: PlanConfig, at: Task) -> dict[str, tuple[int, int]]:
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
