"""Which regions keep their activations: the compiler's side of plan/keep.py.

The partition function hands the backend `split(kept)`, which partitions the joint graph
with a set of kept regions (partition.py tags their matmul and attention outputs to be
saved). Deciding needs both extremes' costs, read off real graphs: the pair with every
region recomputing (what the step is without this decision) and the pair with every
candidate kept. plan.keep.choose_kept mixes the two problems region by region and scores
each mix as the runtime would run it: the planner's fastest schedule within gpu_memory,
then the update sites the room it leaves allows (resident AdamW state grows into the same
device memory kept activations take), with the optimizer's wait for the clip's norm. The
chosen pair is partitioned once more when it is neither extreme, and planned for real
by the caller: should that plan not fit (the mix is an estimate of the real graphs), the
recompute pair stands. A choice made once is remembered across processes
(decision_cache.py): a warm start partitions only the pair it plans.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.fx as fx

from .. import config
from ..errors import MegatrainValueError
from ..plan import inputs as plan_inputs
from ..plan.keep import KeepChoice, choose_kept, comparable
from ..plan.search import InfeasibleBudget, OffloadRoomExceeded, plan_step
from . import decide, decision_cache, loss_choice, rates, update_sites
from .options import Options
from .passes import gradient_handoffs
from .schedule import planner_options, step_problem


@dataclass
class Split:
    """One partition of the joint graph: the pair, what it saves, and its kept regions."""

    fw: fx.GraphModule
    bw: fx.GraphModule | None
    saved: object  # partition.SavedActivations
    kept: frozenset[int] = frozenset()
    problem: tuple | None = None  # (StepProblem, Rates) once read off the pair: not read twice


def choose(split, candidates_of, cap, opts: Options, streamer, joint: fx.GraphModule | None = None,
           head: "loss_choice.LossHead | None" = None) -> tuple[Split, Callable[[], Split], KeepChoice | None]:
    """(the pair to plan, a function giving the recompute pair to fall back to, the
    chooser's answer or None where the set was forced). `split(kept)` partitions with `kept`
    (graph region ids); `candidates_of()` lists the regions that may keep, asked only where
    it matters; `joint`, the joint graph, keys the choice in the decision cache; `head`, a
    plain loss the fused one could replace: the answer then also prices that (loss_choice).
    Keeping is a speed-up, so a failure while deciding it (a graph whose kept partition
    torch cannot make) warns and recomputes rather than stopping the compile; a forced
    set raises."""
    forced = opts.keep_activations
    graph = None
    if forced is None and joint is not None and config.decision_cache and rates.calibrated(opts.device):
        graph = decision_cache.graph_fingerprint(joint)
        k = decision_cache.key(graph, opts)
        hit = decision_cache.load(k)
        if hit is not None:
            plan_inputs.note_decision(graph, "remembered", decision_cache.stored_text(k) or "")
            return _remembered(split, *hit)
    plain = Split(*split(frozenset()))
    if plain.bw is None or forced is False or (forced is None and not rates.calibrated(opts.device)):
        return plain, lambda: plain, None
    candidates = candidates_of()
    if not candidates:
        return plain, lambda: plain, None
    if isinstance(forced, frozenset):
        regions = _named(forced, cap.regions.regions) & frozenset(candidates)
        return (Split(*split(regions), kept=regions) if regions else plain), lambda: plain, None
    if forced:
        return Split(*split(frozenset(candidates)), kept=frozenset(candidates)), lambda: plain, None
    try:
        chosen, choice = _decide(split, plain, candidates, cap, opts, streamer, head)
    except Exception as e:  # noqa: BLE001  (any failure here only costs the speed-up)
        plan_inputs.note_unrepeatable(f"deciding the kept regions failed ({type(e).__name__})")
        warnings.warn(f"megatrain: could not decide which regions keep their activations "
                      f"({type(e).__name__}: {e}); every region recomputes its forward",
                      RuntimeWarning, stacklevel=2)
        return plain, lambda: plain, None
    if graph is not None:   # keyed again: the choice may have timed kernels into the rates' cache
        decision_cache.store(decision_cache.key(graph, opts), chosen.kept, choice)
        plan_inputs.note_decision(graph, "decided", decision_cache.entry_text(chosen.kept, choice))
    return chosen, lambda: plain, choice


def _remembered(split, regions: frozenset[int],
                choice: KeepChoice | None) -> tuple[Split, Callable[[], Split], KeepChoice | None]:
    """The remembered choice's pair, partitioned once; the recompute pair only if asked."""
    chosen = Split(*split(regions), kept=regions)
    if not regions:
        return chosen, lambda: chosen, choice
    return chosen, functools.cache(lambda: Split(*split(frozenset()))), choice


def _decide(split, plain: Split, candidates: list[int], cap, opts: Options,
            streamer, head=None) -> tuple[Split, KeepChoice | None]:
    """The cost model's pick (module docstring): the pair to plan and the chooser's answer."""
    everything = Split(*split(frozenset(candidates)), kept=frozenset(candidates))
    plain.problem = step_problem(plain.fw, plain.bw, cap.params, opts.device, opts.compute_dtype,
                                 opts.fused_lowering, opts.inductor_walk)
    everything.problem = step_problem(everything.fw, everything.bw, cap.params, opts.device,
                                      opts.compute_dtype, opts.fused_lowering, opts.inductor_walk)
    (sp0, planned_rates), (sp1, _) = plain.problem, everything.problem
    p0, p1 = sp0.problem.substitute(sp0.dims), sp1.problem.substitute(sp1.dims)
    if sp0.units != sp1.units or not comparable(p0, p1):
        return plain, None  # the two partitions stream differently: keep it simple
    score = _scorer(cap, opts, streamer, gradient_handoffs(plain.bw), planned_rates)
    choice = choose_kept(p0, p1, planned_rates, score)
    if head is not None and choice.step_s is not None:
        choice = replace(choice, fused_loss_step_s=loss_choice.fused_step(p0, p1, choice.kept, sp0.units,
                                                                          head, score))
    regions = frozenset(g for u in choice.kept for g in sp0.units.get(u, (u,))) & frozenset(candidates)
    if not regions:
        return plain, choice
    if regions == everything.kept:
        return everything, choice
    return Split(*split(regions), kept=regions), choice


def _scorer(cap, opts: Options, streamer, handoffs, planned_rates):
    """score(problem) -> the predicted step as the runtime runs it, or None where no
    schedule fits gpu_memory with its offloads within host_memory."""
    regions = update_sites.gradient_regions(handoffs)
    pids = {g.region: g.pids for g in regions}
    waits = update_sites.optimizer_waits_for_norm([cap.params[p] for _, p in handoffs])
    # kept outputs of offloaded regions wait in host memory too: the planner holds every
    # mix's offloads to what host_memory leaves for them
    options = planner_options(opts.prefetch, opts.offload, opts.keep_weights, training=True,
                              offload_room=decide.offload_room(cap, opts, training=True))

    def score(problem) -> float | None:
        try:
            plan = plan_step(problem, opts.gpu_memory, planned_rates, options=options)
        except (InfeasibleBudget, OffloadRoomExceeded):
            return None
        if not regions:
            return plan.step_time
        sites, _, _ = decide.update_sites_for(problem, plan.peak_bytes, planned_rates, opts, streamer,
                                              regions, cap.params)
        return update_sites.timed_with_sites(plan.schedule, planned_rates, sites, pids,
                                             updates_wait=waits).step_time

    return score


def _named(names: frozenset[str], regions) -> frozenset[int]:
    """The ids of the regions called `names`; an unknown name is an error naming them all."""
    ids = {r.name: r.id for r in regions}
    unknown = sorted(names - set(ids))
    if unknown:
        raise MegatrainValueError(f"keep_activations names {unknown}, which are not regions of this "
                                  f"graph; its regions are {list(ids)}")
    return frozenset(ids[n] for n in names)
