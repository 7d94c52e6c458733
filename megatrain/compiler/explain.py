"""`megatrain.explain(compiled)`: the plan of the graphs compiled for a model."""

from __future__ import annotations

import torch

from .plan import GraphPlan, Plan

_PLANS: list[GraphPlan] = []
_MAX_PLANS = 256


def record(plan: GraphPlan) -> None:
    _PLANS.append(plan)
    del _PLANS[:-_MAX_PLANS]


def explain(compiled=None) -> Plan:
    """Plans of the graphs megatrain compiled for `compiled` (a torch.compile'd module), newest
    per distinct parameter set; without an argument, the most recently compiled graph."""
    if compiled is None:
        return Plan(_PLANS[-1:])
    module = getattr(compiled, "_orig_mod", compiled)
    if not isinstance(module, torch.nn.Module):
        return Plan(_PLANS[-1:])
    mine = {id(p) for p in module.parameters()}
    newest: dict[tuple, GraphPlan] = {}
    for plan in _PLANS:
        ids = tuple(id(p) for p in plan.streamer.params)
        if ids and all(i in mine for i in ids):
            newest.pop(ids, None)
            newest[ids] = plan
    return Plan(list(newest.values()))
