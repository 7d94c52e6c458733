"""An independent check of a planned schedule, and the least budget any schedule needs.

It re-derives what every task requires from the `Problem` alone (which weights a region
reads, which outputs it consumes, which regions produce a weight's gradient) and checks the
`Schedule`'s sequences, buffers and timeline against that, sharing no code with the
planner beyond the data classes. Invariants:

- every compute runs after the h2d of the weights its pass reads completed, between
  their prefetch and evict, with its inputs resident (kept, or reloaded after their offload);
  a region whose forward weights the config keeps for its backward may keep them, and its
  backward fetches nothing and runs while their buffer lives;
- no weight slot holds two regions at once, and at most `config.slots` slots exist;
- every buffer lives over a span of the compute stream; the peak walked from them equals
  the schedule's claim and fits the budget;
- every gradient leaves exactly once per micro-batch, after its last producer, and its
  device buffer is freed only after it left;
- every host step runs once per step, at the last micro-batch, after all of its weights'
  gradients (and accumulations) arrived; the next step's h2d of a region waits for it;
- the timeline respects the graph (no task before its predecessors; streams never overlap).
A forward-only problem (`training=False`) has no backward, gradients or host steps.
"""

from __future__ import annotations

import itertools

from .problem import Problem
from .simulate import Schedule

_EPS = 1e-12


class ScheduleInvalid(AssertionError):
    """A schedule breaks an invariant; `violations` lists every one found."""

    def __init__(self, violations: list[str]):
        super().__init__(f"{len(violations)} violation(s):\n  " + "\n  ".join(violations[:20]))
        self.violations = violations


class _Facts:
    """What the problem says, derived here independently of the planner."""

    def __init__(self, p: Problem):
        self.p = p
        self.fw = [r.id for r in p.regions]
        self.bw = list(p.backward_order) if p.backward_order else self.fw[::-1]
        self.spec = {r.id: r for r in p.regions}
        self.wsize = {w.id: w for w in p.weights}
        # Weights fetched per pass (bw_weights: the backward may read others).
        self.fetched = {"fw": {r.id: r.weights for r in p.regions},
                        "bw": {r.id: r.weights if r.bw_weights is None else r.bw_weights for r in p.regions}}
        self.region_bytes = {ph: {r: sum(self.wsize[w].nbytes for w in ws) for r, ws in by.items()}
                             for ph, by in self.fetched.items()}
        self.consumers = {r: [] for r in self.fw}
        for r in p.regions:
            for i in set(r.inputs):
                self.consumers[i].append(r.id)
        self.producers = {w.id: [r.id for r in p.regions if w.id in r.weights] for w in p.weights} \
            if p.training else {}
        self.bwpos = {r: i for i, r in enumerate(self.bw)}
        # Regions that may keep their forward weights for their backward: it reads exactly
        # them, and no other region reads them in either pass.
        readers: dict[int, set[int]] = {}
        for by in self.fetched.values():
            for r, ws in by.items():
                for w in ws:
                    readers.setdefault(w, set()).add(r)
        self.may_keep = {r for r in self.fw if "bw" in p.phases
                         and set(self.fetched["bw"][r]) == set(self.fetched["fw"][r])
                         and all(readers[w] == {r} for w in self.fetched["fw"][r])}
        self.fwpos = {r: i for i, r in enumerate(self.fw)}


def min_budget(problem: Problem) -> int:
    """Bytes that must be on the device at the worst moment of any schedule in the model:
    during each compute, its weights, working set and output, the inputs still to be read,
    accumulating activation and weight gradients, and outputs feeding the loss. Boundary
    outputs are assumed offloaded whenever nothing on the device reads them."""
    f = _Facts(problem)
    p = problem
    worst = 0
    for x in f.fw:  # forward of x
        q = f.fwpos[x]
        live = p.base_bytes + f.region_bytes["fw"][x] + f.spec[x].work_fw
        for i in f.fw[:q + 1]:
            cons = f.consumers[i]
            if not cons or max(f.fwpos[c] for c in cons) >= q:
                live += f.spec[i].out_bytes  # still read ahead, or a loss output kept to bw
        worst = max(worst, live)
    for x in (f.bw if p.training else ()):  # recompute + backward of x
        q = f.bwpos[x]
        live = p.base_bytes + f.region_bytes["bw"][x] + f.spec[x].work_bw
        for i in f.fw:
            cons = f.consumers[i]
            size = f.spec[i].out_bytes
            if not cons:
                if f.bwpos[i] >= q:
                    live += size  # loss output, read by its own backward
                continue
            first = min(f.bwpos[c] for c in cons)
            last = max(f.bwpos[c] for c in cons)
            if first <= q <= last:
                live += size  # the output, for a consumer's recompute
            if first <= q <= f.bwpos[i]:
                live += size  # its gradient, accumulating until i's backward
        for w, prods in f.producers.items():
            if prods and min(f.bwpos[r] for r in prods) <= q <= max(f.bwpos[r] for r in prods):
                live += f.wsize[w].grad_buffer_bytes
        worst = max(worst, live)
    return int(worst)


def violations(s: Schedule, budget: int | None = None) -> list[str]:
    f = _Facts(s.problem)
    out: list[str] = []
    M = s.problem.micro_batches
    seq = s.streams.get("compute", [])
    pos = {t: i for i, t in enumerate(seq)}
    start, end = s.start, s.end

    # -- the timeline respects the graph and the streams ------------------------------
    placed = [t for st in s.streams.values() for t in st]
    if len(placed) != len(set(placed)) or set(placed) != set(s.graph.nodes):
        out.append("every task must sit on exactly one stream")
    for a, b in s.graph.edges:
        if start[b] + _EPS < end[a]:
            out.append(f"{b} starts at {start[b]:.6g} before its predecessor {a} ends at {end[a]:.6g}")
    for name, st in s.streams.items():
        for a, b in itertools.pairwise(st):
            if start[b] + _EPS < end[a]:
                out.append(f"stream {name}: {b} overlaps {a}")

    # -- the compute program: each pass's computes in the problem's order --------------
    computes = [t for t in seq if t.kind == "compute"]
    want = [(r, ph, m, st) for st in range(s.steps) for m in range(M)
            for ph, order in (("fw", f.fw), ("bw", f.bw)) if ph in s.problem.phases for r in order]
    if [(t.region, t.phase, t.micro, t.step) for t in computes] != want:
        out.append("compute stream does not run every pass's regions in the problem's order")
        return out

    buffers = {b.key: b for b in s.buffers}
    for b in s.buffers:
        if b.alloc not in pos or b.free not in pos:
            out.append(f"buffer {b.key} is not allocated and freed by compute-stream ops")
        elif pos[b.free] < pos[b.alloc]:
            out.append(f"buffer {b.key} is freed before it is allocated")

    def alive(key, t) -> bool:
        b = buffers.get(key)
        return b is not None and b.alloc in pos and b.free in pos and pos[b.alloc] <= pos[t] <= pos[b.free]

    by_tuple = {tuple(t): t for t in s.graph.nodes}

    def get(*key):
        return by_tuple.get(key)

    for c in computes:
        r, ph, m, st = c.region, c.phase, c.micro, c.step
        spec = f.spec[r]
        # weights
        if f.fetched[ph][r] and r in s.config.kept_weights:
            out += _kept_weights(f, s, c, get, pos, start, end, buffers)
        elif f.fetched[ph][r]:
            wkey = ("weights", r, ph, m, st)
            h, pf, ev = get("h2d", r, ph, m, st), get("prefetch", r, ph, m, st), get("free", r, ph, m, st)
            if h is None or pf is None or ev is None:
                out.append(f"{c}: missing prefetch/h2d/evict of its weights")
            else:
                if end[h] > start[c] + _EPS:
                    out.append(f"{c} starts before its weights' h2d completed")
                if start[h] + _EPS < end[pf]:
                    out.append(f"h2d of region {r} starts before its prefetch was issued")
                if not pos[pf] < pos[c] < pos[ev]:
                    out.append(f"{c} is not between its weights' prefetch and evict")
                b = buffers.get(wkey)
                if b is None or b.nbytes != f.region_bytes[ph][r] or b.alloc != pf or b.free != ev:
                    out.append(f"{c}: weight buffer missing, mis-sized or not spanning prefetch..evict")
        # working set and output
        work = spec.work_fw if ph == "fw" else spec.work_bw
        if work and not alive(("work", r, ph, m, st), c):
            out.append(f"{c}: working set not allocated")
        if ph == "fw":
            if not alive(("act", r, m, st), c) or buffers[("act", r, m, st)].nbytes != spec.out_bytes:
                out.append(f"{c}: its output buffer is not allocated at its size")
            for i in spec.inputs:
                if not alive(("act", i, m, st), c):
                    out.append(f"{c}: input {i} is not resident")
        else:
            for i in spec.inputs:
                if alive(("act", i, m, st), c):
                    continue
                rl = get("reload", i, "bw", m, st)
                off = get("offload", i, "fw", m, st)
                if rl is None or off is None or not alive(("reload", i, m, st), c):
                    out.append(f"{c}: input {i} is neither kept nor reloaded")
                elif end[rl] > start[c] + _EPS or start[rl] + _EPS < end[off]:
                    out.append(f"{c}: input {i} reloaded late, or before its offload finished")
            for w in spec.weights:
                if not alive(("grad", w, m, st), c):
                    out.append(f"{c}: gradient buffer of weight {w} not allocated")
            for i in set(spec.inputs) | ({r} if f.consumers[r] else set()):
                if not alive(("actgrad", i, m, st), c):
                    out.append(f"{c}: gradient of region {i}'s output not allocated")
            if not f.consumers[r] and not alive(("act", r, m, st), c):
                out.append(f"{c}: its loss output is gone before its backward")
    # offloaded outputs: the device copy goes only after its D2H and its forward readers
    for key, b in buffers.items():
        if key[0] != "act":
            continue
        i, m, st = key[1:]
        if b.free.kind == "offload_wait":
            off = get("offload", i, "fw", m, st)
            if off is None or start[off] + _EPS < end[get("compute", i, "fw", m, st)] \
                    or start[b.free] + _EPS < end[off]:
                out.append(f"output of region {i} freed before its offload completed")
            for c in f.consumers[i]:
                if pos[get("compute", c, "fw", m, st)] > pos[b.free]:
                    out.append(f"output of region {i} freed before forward consumer {c} ran")

    # -- slots -------------------------------------------------------------------------
    spans: dict[int, list] = {}
    for t, slot in s.slot_of.items():
        if not 0 <= slot < s.config.slots:
            out.append(f"{t} uses slot {slot} of {s.config.slots}")
        ev = get("free", t.region, t.phase, t.micro, t.step)
        if t in pos and ev in pos:
            spans.setdefault(slot, []).append((pos[t], pos[ev], t))
    for slot, iv in spans.items():
        iv.sort()
        for (a0, a1, ta), (b0, b1, tb) in itertools.pairwise(iv):
            if b0 <= a1:
                out.append(f"slot {slot} holds region {ta.region} and region {tb.region} at once")
    prefetches = [t for t in seq if t.kind == "prefetch" and t.region not in s.config.kept_weights]
    if set(prefetches) != set(s.slot_of):
        out.append("every prefetch needs exactly one slot (a kept region's forward fetch none)")

    # -- peak ---------------------------------------------------------------------------
    delta_a: dict = {}
    delta_f: dict = {}
    for b in s.buffers:
        delta_a[b.alloc] = delta_a.get(b.alloc, 0) + b.nbytes
        delta_f[b.free] = delta_f.get(b.free, 0) + b.nbytes
    live = peak = s.problem.base_bytes
    for t in seq:
        live += delta_a.get(t, 0)
        peak = max(peak, live)
        live -= delta_f.get(t, 0)
    if live != s.problem.base_bytes:
        out.append(f"{live - s.problem.base_bytes} bytes never freed by the end of the schedule")
    if peak != s.peak_bytes:
        out.append(f"schedule claims peak {s.peak_bytes} bytes, its buffers peak at {peak}")
    if budget is not None and peak > budget:
        out.append(f"peak {peak} bytes exceeds the budget {budget}")

    # -- gradients and host steps --------------------------------------------------------
    fetches: dict = {}
    for t in s.streams.get("h2d", []):
        if t.kind == "h2d":
            fetches.setdefault((t.region, t.step), []).append(t)
    carried: dict = {}
    for t, attrs in s.graph.nodes(data=True):
        if t.kind in ("d2h", "host_step", "host_acc"):
            for w in attrs.get("weights", ()):
                carried.setdefault((t.kind, w, t.micro, t.step), []).append(t)
    for w, prods in f.producers.items():
        if not prods:
            continue
        for st in range(s.steps):
            for m in range(M):
                ds = carried.get(("d2h", w, m, st), [])
                if len(ds) != 1:
                    out.append(f"gradient of weight {w} leaves {len(ds)} times in micro-batch {m} of step {st}")
                    continue
                d = ds[0]
                for r in prods:
                    if start[d] + _EPS < end[get("compute", r, "bw", m, st)]:
                        out.append(f"gradient of weight {w} leaves before producer region {r} ran")
                g = buffers.get(("grad", w, m, st))
                if g is None or start[g.free] + _EPS < end[d]:
                    out.append(f"device gradient of weight {w} freed before its D2H completed")
                if m < M - 1:
                    acc = carried.get(("host_acc", w, m, st), [])
                    if len(acc) != 1 or start[acc[0]] + _EPS < end[d]:
                        out.append(f"weight {w}: micro-batch {m} gradient not accumulated after arrival")
                if carried.get(("host_step", w, m, st)) and m != M - 1:
                    out.append(f"weight {w}: host step at micro-batch {m}, not the last")
            hs = carried.get(("host_step", w, M - 1, st), [])
            if len(hs) != 1:
                out.append(f"weight {w} gets {len(hs)} host steps in step {st}")
                continue
            h = hs[0]
            arrived = [t for m in range(M) for t in carried.get(("d2h", w, m, st), [])]
            arrived += [t for m in range(M - 1) for t in carried.get(("host_acc", w, m, st), [])]
            if any(start[h] + _EPS < end[a] for a in arrived):
                out.append(f"host step of weight {w} in step {st} before all its gradients arrived")
            for r in prods:
                for t in fetches.get((r, st + 1), ()):
                    if start[t] + _EPS < end[h]:
                        out.append(f"step {st + 1} fetches region {r} before weight {w}'s host step")
    return out


def _kept_weights(f: _Facts, s: Schedule, c, get, pos, start, end, buffers) -> list[str]:
    """A region that keeps its forward weights for its backward: it may (its backward reads
    exactly those weights, which no other region reads), its forward fetches them (prefetch,
    h2d done before the compute, keep after it), its backward fetches nothing, and one
    buffer holds them from the forward's prefetch until the backward's free, after it."""
    r, ph, m, st = c.region, c.phase, c.micro, c.step
    out = []
    if r not in f.may_keep:
        return [(f"{c}: region {r} keeps weights it may not (read by another region, or not "
                 "the ones its backward reads)")]
    pf, h, kp = get("prefetch", r, "fw", m, st), get("h2d", r, "fw", m, st), get("keep", r, "fw", m, st)
    fr = get("free", r, "bw", m, st)
    if pf is None or h is None or kp is None or fr is None:
        return [f"{c}: missing the forward's prefetch/h2d/keep or the backward's free of its kept weights"]
    if ph == "fw":
        if end[h] > start[c] + _EPS:
            out.append(f"{c} starts before its weights' h2d completed")
        if not pos[pf] < pos[c] < pos[kp]:
            out.append(f"{c} is not between its weights' prefetch and keep")
    else:
        if get("prefetch", r, "bw", m, st) is not None or get("h2d", r, "bw", m, st) is not None:
            out.append(f"{c}: fetches the weights its forward kept")
        if not pos[kp] < pos[c] < pos[fr]:
            out.append(f"{c} is not between its forward's keep and its free")
    b = buffers.get(("weights", r, "fw", m, st))
    if b is None or b.nbytes != f.region_bytes["fw"][r] or b.alloc != pf or b.free != fr:
        out.append(f"{c}: kept weight buffer missing, mis-sized or not spanning forward prefetch..backward free")
    return out


def validate(schedule: Schedule, budget: int | None = None) -> None:
    """Raise ScheduleInvalid listing every broken invariant (see the module docstring)."""
    found = violations(schedule, budget)
    if found:
        raise ScheduleInvalid(found)
