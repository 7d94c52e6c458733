"""The plain loss or the fused linear-cross-entropy: which one makes the faster step.

The fused loss (kernels/fused_linear_cross_entropy.py) never holds the [tokens, vocab]
logits that the plain loss holds at once under Inductor (one buffer:
fusions.unfused_logits_bytes), and it computes the logits' two gradient products in its
forward, so a head region that recomputes its forward in the backward runs them twice.
It trades compute (and passes over the logits) for device memory, which the planner turns into resident optimizer
state and kept activations. Which side wins depends on the whole step: at a budget the
logits crowd, the memory is worth more; where they are a sliver of it, the compute is.

The backend compiles the plain loss first. Beside the keep chooser's answer, the same
scorer prices the step with the head region changed as the fused loss changes it
(`fused_variant`): its working sets less the logits, its forward two products and two
passes over the logits more, its backward as many fewer. Where that is predicted MARGIN faster than the chosen plain step, the
backend raises FusedLossFaster out of planning and compiles the fused loss instead. The
answer is remembered per dynamo graph (decision_cache), so a warm start compiles the
fused loss without tracing the plain one first.

The estimate changes one region's numbers of a problem read off the plain graphs; the
fused plan is then planned from its own graphs, as any plan is. The passes: Inductor's
plain loss reads the logits once in the forward and twice in the backward (the gradient
written over them), the fused kernel three times in its forward (op_costs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from ..plan.keep import mixed
from ..plan.problem import Problem

# How much faster the fused estimate must be: a second compile costs a trace and a plan,
# and the estimate leaves the kept set and the traffic as the plain plan had them.
MARGIN = 0.02


class FusedLossFaster(Exception):
    """Planning found the step predicted faster with the fused loss: compile that instead."""

    def __init__(self, plain_s: float, fused_s: float, remembered: bool = False):
        super().__init__(f"predicted {fused_s:.3f} s per step with it against {plain_s:.3f} s with the plain "
                         f"loss" + (" (a choice remembered from an earlier compile)" if remembered else ""))
        self.plain_s, self.fused_s = plain_s, fused_s


@dataclass(frozen=True)
class LossHead:
    """The plain loss's head as the estimate needs it: the graph region of its product, the
    logits bytes it holds at once, and the FLOPs of the two gradient products and the
    bytes of the two passes over the logits the fused loss moves from the backward into
    the forward."""

    region: int
    logits_bytes: int
    moved_flops: int
    moved_bytes: int = 0


def pending_head(gm: fx.GraphModule, compute_dtype: torch.dtype, inductor: bool):
    """The head of `gm` (dynamo's graph, before capture edits it) as (its product node,
    logits bytes, moved FLOPs, moved bytes), or None where no plain linear-cross-entropy
    matches, its sizes are symbolic, or its logits are also read elsewhere (returned). The
    node's region is read after capture tags it (`head_of`)."""
    from . import fusions  # imports the Triton kernels: only when a graph is compiled

    heads = fusions.linear_ce_heads(gm)
    if len(heads) != 1:
        return None  # no head, or several (their regions' numbers would mix): no estimate
    product, tokens, width, vocab, logits_dtype = heads[0]
    if not all(isinstance(v, int) for v in (tokens, width, vocab)):
        return None
    if len(product.users) > 1:
        return None  # the logits are also returned: the fused loss would not free them
    logits = fusions.head_logits_bytes(tokens, vocab, logits_dtype, compute_dtype, inductor)
    one_pass = tokens * vocab * fusions._val(product).dtype.itemsize
    return product, logits, 2 * (2 * tokens * width * vocab), 2 * one_pass


def head_of(pending) -> LossHead | None:
    """`pending_head`'s answer with its region, once capture has tagged the product."""
    if pending is None:
        return None
    node, logits, moved, passes = pending
    region = (node.meta.get("custom") or {}).get("megatrain_region")
    return None if region is None else LossHead(region, logits, moved, passes)


def fused_variant(problem: Problem, unit: int, head: LossHead) -> Problem:
    """`problem` with the planner region `unit` (the head's) changed as the fused loss
    changes it: working sets less the logits, the gradient products and passes moved from
    the backward into the forward (a region that recomputes runs its forward twice)."""
    def changed(r):
        if r.id != unit:
            return r
        backward = 2 * r.flops_fw if r.flops_bw is None else r.flops_bw
        traffic = 2 * r.traffic_fw if r.traffic_bw is None else r.traffic_bw
        return replace(r, work_fw=max(int(r.work_fw) - head.logits_bytes, 0),
                       work_bw=max(int(r.work_bw) - head.logits_bytes, 0),
                       flops_fw=r.flops_fw + head.moved_flops,
                       flops_bw=max(backward - head.moved_flops, 0),
                       traffic_fw=r.traffic_fw + head.moved_bytes,
                       traffic_bw=max(traffic - head.moved_bytes, 0))

    return replace(problem, regions=tuple(map(changed, problem.regions)))


def fused_step(recompute: Problem, kept: Problem, kept_units: frozenset[int], units: dict,
               head: LossHead, score: Callable[[Problem], float | None]) -> float | None:
    """The step `score` predicts with the fused loss in the chosen mix (`kept_units` of the
    `kept` problem, the rest from `recompute`), the head recomputing; None where the head's
    region is not one of the planner's."""
    unit = next((r.id for r in recompute.regions if head.region in units.get(r.id, (r.id,))), None)
    if unit is None:
        return None
    return score(fused_variant(mixed(recompute, kept, kept_units - {unit}), unit, head))


def fused_is_faster(plain_s: float | None, fused_s: float | None) -> bool:
    return plain_s is not None and fused_s is not None and fused_s < plain_s * (1 - MARGIN)
