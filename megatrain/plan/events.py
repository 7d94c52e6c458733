"""From a simulated schedule to the FX pass's event lists.

`graph_events` anchors the compute-stream ops of one micro-batch of a `Schedule` to node
positions of the forward and backward FX graphs (`RegionUse`: where each region runs
there), giving the `Transfer` lists `passes.insert_transfers` materialises. It reads only
the schedule and the graphs' region spans, so it sits after the search and apart from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .problem import _Shape
from .simulate import Schedule

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
