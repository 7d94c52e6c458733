"""Why a simulated step is slower than its compute: the GPU's waits, each traced to the
stream that held it up, and the warning a plan much slower than a GPU-resident run gets.

The reference is the schedule's own compute seconds: every kernel of the step, recompute
included, back to back. A GPU-resident run of the same graph does that work with nothing to
wait for, so the ratio of the predicted step to it says what streaming costs. Where it is
large the user should hear which region waits and on what (the weights over PCIe, the host
optimizer, gradients leaving), because each has its own remedy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .simulate import Schedule

_HOST = ("host_step", "host_hold", "host_acc")
_TO_DEVICE = ("h2d", "reload")
_TO_HOST = ("d2h", "offload")
_EPS = 1e-9

REASONS = {
    "host": "the host optimizer's updates (AdamW on the CPU, which the next fetch of their weights waits for)",
    "h2d": "weights or activations coming to the GPU over PCIe",
    "d2h": "gradients or activations going to the host over PCIe",
    "other": "the order of the streams",
}
REMEDIES = {
    "host": "a larger gpu_memory keeps more regions' AdamW state on the GPU, where their updates "
            "take no host time",
    "h2d": "a larger gpu_memory keeps more weights and state on the GPU; more tokens per step "
           "give each byte crossing the link more compute",
    "d2h": "more tokens per step give each gradient byte more compute; a larger gpu_memory keeps "
           "more regions' state (and so their gradients) on the GPU",
    "other": "a larger gpu_memory lets the planner fetch further ahead",
}


@dataclass(frozen=True)
class Wait:
    seconds: float  # the GPU's idle time before `region`'s compute, per step
    reason: str     # a key of REASONS
    region: int     # the region whose transfer or update it waited for


def gpu_waits(sched: Schedule) -> list[Wait]:
    """The GPU's idle gaps in the schedule's last simulated step (the steady state: the
    first step has no previous step's updates to wait for), each traced back through the
    task graph to the first transfer or host task that held it, summed by (reason, region),
    largest first."""
    start, end = sched.start, sched.end
    compute = sched.streams["compute"]
    last = sched.steps - 1
    totals: dict[tuple[str, int], float] = {}
    for i, task in enumerate(compute):
        if task.step != last:
            continue
        ready = end[compute[i - 1]] if i else 0.0
        gap = start[task] - ready
        if gap <= _EPS:
            continue
        reason, region = _cause(sched, task)
        totals[(reason, region)] = totals.get((reason, region), 0.0) + gap
    return sorted((Wait(s, r, g) for (r, g), s in totals.items()), key=lambda w: -w.seconds)


def _cause(sched: Schedule, task) -> tuple[str, int]:
    """Walk back from a compute task that started late along the predecessor that ended
    last, through transfers and host tasks (their streams' queues included), to the first
    compute task (or none). The reason is the kind of stream that took the most seconds on
    that chain: a host update that waited for a slow gradient copy is the link's wait, a
    fetch that waited for a slow host update the host's. The region is that stream's
    task nearest the waiting compute."""
    G, start, end = sched.graph, sched.start, sched.end
    spent: dict[str, float] = {}
    nearest: dict[str, int] = {}
    node = task
    for _ in range(len(end)):
        preds = [p for p in G.predecessors(node) if p in end]
        if node is task:  # not the compute stream's FIFO predecessor: the GPU was free
            preds = [p for p in preds if G.edges[p, node].get("kind") != "stream"]
        if not preds:
            break
        node = max(preds, key=lambda p: end[p])
        if node.kind == "compute":
            break
        reason = _reason(node.kind)
        spent[reason] = spent.get(reason, 0.0) + end[node] - start[node]
        nearest.setdefault(reason, node.region)
    if not spent:
        return "other", task.region
    reason = max(spent, key=lambda r: spent[r])
    return reason, nearest[reason]


def _reason(kind: str) -> str:
    if kind in _HOST:
        return "host"
    if kind in _TO_DEVICE:
        return "h2d"
    if kind in _TO_HOST:
        return "d2h"
    return "other"


def slow_plan_warning(sched: Schedule, ratio: float, names: Mapping[int, str] | None = None,
                      top: int = 3) -> str | None:
    """The warning for a schedule whose predicted step is at least `ratio` times its compute
    seconds, naming the largest waits with their regions, reasons and remedies; None when
    it is not that slow."""
    compute = sched.compute_seconds
    step = sched.step_time
    if compute <= 0 or step < ratio * compute:
        return None
    names = names or {}
    waits = gpu_waits(sched)[:top]
    parts = [f"region {w.region}" + (f" ({names[w.region]})" if w.region in names else "")
             + f" {_fmt(w.seconds)} on {REASONS[w.reason]}" for w in waits]
    remedies = list(dict.fromkeys(REMEDIES[w.reason] for w in waits))
    return (f"the plan predicts {_fmt(step)} a step, {step / compute:.1f}x its GPU compute "
            f"({_fmt(compute)}, about what a GPU-resident run of this graph takes); the GPU waits: "
            + "; ".join(parts) + ". " + ". ".join(r[0].upper() + r[1:] for r in remedies) + ".")


def _fmt(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"
