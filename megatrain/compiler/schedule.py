"""The transfer schedule of one compiled graph pair: the planner's, validated.

    forward/backward FX graphs --problem.build_problem--> planner Problem, and where each
    region runs in each graph --plan.search.plan_step--> the fastest predicted schedule whose
    peak fits gpu_memory (prefetch depth up to the `prefetch` option) --validate--> checked
    by the independent validator --graph_events--> per-graph Transfer lists, which
    passes.insert_transfers materialises as FX nodes in exactly that order.

There is no other schedule: a budget that no depth fits raises the planner's error naming
the minimum budget; a budget that fits only a shallower depth than asked warns and uses it.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import format_bytes, noting
from ..plan.costs import Rates
from ..plan.events import ACTIVATION_KINDS, WEIGHT_KINDS, Transfer, graph_events
from ..plan.search import Plan, PlannerOptions, plan_step
from ..plan.validate import validate
from .merges import joined_streaming
from .problem import build_problem
from .rates import compile_rates, kernel_flop_scales


@dataclass
class StepSchedule:
    plan: Plan  # the planner's choice: config, simulated schedule, peak, step time
    rates: Rates
    units: dict[int, tuple[int, ...]]  # planner region -> graph regions it streams together
    forward: list[Transfer]
    backward: list[Transfer]
    forward_fetches: dict[str, int]  # fetch node name -> the planner region it streams with
    backward_fetches: dict[str, int]
    # Regions whose boundary outputs wait in host memory: (saved tensor's name, key) each.
    offloaded: dict[int, list[tuple[str, int]]]

    @property
    def slots(self) -> int:
        return self.plan.config.slots


def step_problem(fw: fx.GraphModule, bw: fx.GraphModule | None, params: list[torch.nn.Parameter],
                 device: torch.device, dtype: torch.dtype, fused: bool = False, inductor: bool = False):
    """(the planner's problem read off the graph pair, the rates it is planned with)."""
    rates = compile_rates(device)
    scale = kernel_flop_scales([fw.graph] + ([bw.graph] if bw is not None else []), device, rates)
    return build_problem(fw, bw, params, device, dtype, fused, scale, inductor), rates


def planner_options(prefetch: int, offload: bool, keep_weights: bool, training: bool,
                    offload_room: int | None = None) -> PlannerOptions:
    """The planner's search space for the options (schedule_step's arguments)."""
    return PlannerOptions(max_slots=prefetch + 1, offload=offload and training,
                          keep=keep_weights and training, offload_room=offload_room)


def schedule_step(fw: fx.GraphModule, bw: fx.GraphModule | None, params: list[torch.nn.Parameter],
                  device: torch.device, dtype: torch.dtype, budget: int, prefetch: int,
                  offload: bool = True, fused: bool = False, keep_weights: bool = False,
                  region_names: dict[int, str] | None = None, param_names: list[str] = (),
                  problem: tuple | None = None, offload_room: int | None = None,
                  inductor: bool = False) -> StepSchedule:
    """Plan one step of the graph pair (`bw=None`: forward only) within `budget` bytes;
    `offload`: boundary activations may wait in host memory between the passes; `fused`:
    Inductor lowers the graphs to Triton kernels (problem.py counts their working sets);
    `inductor`: Inductor lowers them, on any device (what it never writes is not counted);
    `keep_weights`: regions may keep their forward weights for their backward;
    `region_names` and `param_names` name graph regions and parameters in what it says;
    `problem`: step_problem's answer for this pair with these arguments, if already read;
    `offload_room`: the most bytes of activations the plan may park in host memory."""
    sp, rates = problem if problem is not None else step_problem(fw, bw, params, device, dtype, fused, inductor)
    joined = joined_streaming(sp, region_names or {}, param_names)
    if joined:
        warnings.warn(f"megatrain: {joined}", stacklevel=3)
    with noting(joined):
        plan = plan_step(sp.problem, budget, rates, dims=sp.dims,
                         options=planner_options(prefetch, offload, keep_weights, bw is not None,
                                                 offload_room))
    validate(plan.schedule, budget)
    events = graph_events(plan.schedule, sp.forward_uses, sp.backward_uses)
    wanted = min(prefetch + 1, max(1, sum(1 for r in sp.problem.regions if r.weights)))
    if plan.config.slots < wanted and not any(c.slots >= wanted for c in plan.candidates):
        warnings.warn(f"megatrain: prefetch={prefetch} does not fit gpu_memory={format_bytes(budget)}; "
                      f"using prefetch={plan.config.slots - 1}", stacklevel=3)
    keys = itertools.count()
    offloaded = {u: [(name, next(keys)) for name in sp.saved[u]] for u in sorted(plan.config.offloaded)}
    kinds = (*WEIGHT_KINDS, *ACTIVATION_KINDS)
    return StepSchedule(plan, rates, sp.units, [t for t in events.forward_all if t.kind in kinds],
                        [t for t in events.backward_all if t.kind in kinds], sp.forward_fetches,
                        sp.backward_fetches, offloaded)

