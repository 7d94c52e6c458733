"""Which regions keep their activations for the backward instead of recomputing them.

Every region's backward recomputes its forward by default: only boundary activations
cross from the forward to the backward, so the step's device memory is a few layers'
worth. A *kept* region saves its FLOP-bound outputs (matmuls, attention) instead, and its
backward skips their recompute: less compute, more device memory held from the region's
forward to its backward. Streaming leaves most of the device free of weights, so at a
generous budget many regions can keep; where memory is short, resident optimizer state or
fewer offloads may be worth more than the compute saved, and a step bound by the host or
the link gains nothing from less compute at all.

The chooser compares whole steps, not rules of thumb. It is given the problem with every
region recomputing and the problem with every candidate kept (the compiler partitions the
graph both ways and reads each off its graphs), mixes them region by region, and asks a
`score` (the planner plus whatever the runtime adds, e.g. resident state in the room the
plan leaves) for each mix's predicted step. Candidates enter in the order of compute saved
per extra byte held; the prefixes of that order are scored on a grid and around its best
point, and the fastest wins (the fewest kept on a near tie). Pure: problems in, a set out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from . import costs
from .problem import Problem, RegionSpec

# Prefix lengths scored on the first pass (the grid), before the refinement around the best.
GRID_POINTS = 8
# Steps within this fraction of the fastest count as a tie (the cost model is not finer).
TIE = 0.005


@dataclass(frozen=True)
class KeepChoice:
    """The chooser's answer: the kept regions, the predicted step with them, and every
    (number kept, predicted step or None where nothing fit) it scored, for explain; and
    the step the same scorer predicts with the fused loss in place of a plain one, where
    the compiler asked (compiler/loss_choice.py)."""

    kept: frozenset[int]
    step_s: float | None
    scored: tuple[tuple[int, float | None], ...] = ()
    fused_loss_step_s: float | None = None


def mixed(recompute: Problem, kept: Problem, keep: Iterable[int]) -> Problem:
    """`recompute` with the regions in `keep` taken from `kept`: their saved bytes, backward
    FLOPs, traffic and working sets as the kept partition has them."""
    keep = set(keep)
    by_id = {r.id: r for r in kept.regions}
    return replace(recompute, regions=tuple(by_id[r.id] if r.id in keep else r
                                            for r in recompute.regions))


def comparable(recompute: Problem, kept: Problem) -> bool:
    """Whether the two partitions' problems can be mixed region by region: the same
    regions in the same order, whose forwards read the same weights and inputs (a kept
    region's backward may read fewer weights: its spec carries its own)."""
    a, b = recompute.regions, kept.regions
    return (len(a) == len(b) and recompute.weights == kept.weights
            and recompute.backward_order == kept.backward_order
            and all((x.id, x.weights, x.inputs) == (y.id, y.weights, y.inputs) for x, y in zip(a, b)))


def keep_order(recompute: Problem, kept: Problem, rates: costs.Rates) -> list[int]:
    """Regions whose backward keeping makes cheaper, most compute saved per extra byte
    held first (ties: the later region, whose saved tensors live shorter)."""
    by_id = {r.id: r for r in kept.regions}
    gains = []
    for pos, r in enumerate(recompute.regions):
        k = by_id[r.id]
        saved_s = _backward_seconds(r, rates) - _backward_seconds(k, rates)
        if saved_s <= 0:
            continue
        extra = max(int(k.out_bytes) - int(r.out_bytes), 1)
        gains.append((-saved_s / extra, -pos, r.id))
    return [rid for *_, rid in sorted(gains)]


def _backward_seconds(r: RegionSpec, rates: costs.Rates) -> float:
    """The region's recompute + backward compute, as the simulator charges it."""
    flops, traffic = r.backward_work()
    return costs.compute_seconds(flops, rates, traffic)


def choose_kept(recompute: Problem, kept: Problem, rates: costs.Rates,
                score: Callable[[Problem], float | None]) -> KeepChoice:
    """The kept set whose mixed problem `score`s fastest (module docstring). `score`
    returns the predicted step in seconds, or None where the problem does not fit. Both
    problems must be concrete (no symbolic sizes) and `comparable`."""
    order = keep_order(recompute, kept, rates)
    results: dict[int, float | None] = {}

    def at(n: int) -> None:
        if n not in results:
            results[n] = score(mixed(recompute, kept, order[:n]))

    for n in _grid(len(order)):
        at(n)
    best = _best(results)
    if best is not None:
        step = max(1, len(order) // GRID_POINTS)
        lo, hi = max(0, best - step + 1), min(len(order), best + step - 1)
        for n in range(lo, hi + 1):
            at(n)
        best = _best(results)
    scored = tuple(sorted(results.items()))
    if best is None:
        return KeepChoice(frozenset(), None, scored)
    return KeepChoice(frozenset(order[:best]), results[best], scored)


def _grid(n: int) -> list[int]:
    """0, n and up to GRID_POINTS - 1 evenly spaced counts between."""
    return sorted({round(i * n / GRID_POINTS) for i in range(GRID_POINTS + 1)})


def _best(results: dict[int, float | None]) -> int | None:
    """The fewest kept whose step is within TIE of the fastest, or None if none fit: memory
    held for no measurable gain is memory the runtime could give resident state."""
    fits = [(n, s) for n, s in results.items() if s is not None]
    if not fits:
        return None
    fastest = min(s for _, s in fits)
    return min(n for n, s in fits if s <= fastest * (1 + TIE))
