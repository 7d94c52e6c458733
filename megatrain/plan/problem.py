"""The planner's input: one step's regions, their weights and sizes, and the structure
derived from them once.

A `Problem` lists the regions in forward (topological) order with their weights,
boundary-activation and working-set bytes as sympy expressions or ints, FLOPs, and the DAG
of activations; it is checked on construction and `substitute` evaluates its symbolic dims.
`_Shape` derives the structural facts every later stage reads (orders, consumers, weight
owners, which regions may offload their output or keep their weights). They live apart from
the search so the compiler (compiler/problem.py reads a Problem off the FX graphs), the
validator and the tests build problems without the scheduler; `with_update_sites` restates
a problem as the runtime runs it once some weights' updates leave the host.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, replace

import sympy

from ..errors import MegatrainValueError
from . import costs


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
    # Device memory bytes its memory-bound kernels move (norms, activations, casts): the
    # compute time beside the FLOPs. Backward without the recompute; default 2 * traffic_fw.
    traffic_fw: object = 0
    traffic_bw: object = None
    # The gradient its backward receives from the regions that read its boundary output,
    # bytes (alive from their backward to its own); None: as `out_bytes`. A region keeping
    # its matmul outputs saves far more than the hidden state whose gradient comes back.
    grad_in_bytes: object = None

    @property
    def incoming_grad_bytes(self) -> object:
        return self.out_bytes if self.grad_in_bytes is None else self.grad_in_bytes

    def backward_work(self) -> tuple[object, object]:
        """(FLOPs, traffic bytes) of its recompute + backward, as the cost model charges
        them: the forward's again plus the backward's own (default twice the forward's)."""
        b = 2 * self.flops_fw if self.flops_bw is None else self.flops_bw
        tb = 2 * self.traffic_fw if self.traffic_bw is None else self.traffic_bw
        return self.flops_fw + b, self.traffic_fw + tb

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
    # The host updates wait for the step's last gradient (the optimizer clips, or checks
    # for non-finite values: it needs the global norm first) and then run in the next
    # forward's order; False: each runs once its region's gradient is on the host.
    updates_wait: bool = False

    def __post_init__(self):
        object.__setattr__(self, "regions", tuple(self.regions))
        object.__setattr__(self, "weights", tuple(self.weights))
        if self.backward_order is not None:
            object.__setattr__(self, "backward_order", tuple(self.backward_order))
        _check_problem(self)

    @classmethod
    def chain(cls, weight_bytes, out_bytes=0, flops=0, work_fw=0, work_bw=0,
              micro_batches: int = 1, base_bytes=0) -> Problem:
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
            yield from (r.out_bytes, r.work_fw, r.work_bw, r.flops_fw, r.flops_bw,
                        r.traffic_fw, r.traffic_bw, r.grad_in_bytes)

    def substitute(self, dims: Mapping | None = None) -> Problem:
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
                                flops_bw=ev(r.flops_bw, f"region {r.id} flops_bw"),
                                traffic_fw=ev(r.traffic_fw, f"region {r.id} traffic_fw"),
                                traffic_bw=ev(r.traffic_bw, f"region {r.id} traffic_bw"),
                                grad_in_bytes=ev(r.grad_in_bytes, f"region {r.id} grad_in_bytes"))
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
        for name in ("out_bytes", "work_fw", "work_bw", "flops_fw", "flops_bw", "traffic_fw",
                     "traffic_bw", "grad_in_bytes"):
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
