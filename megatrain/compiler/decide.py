"""From the planner's schedule and the options to the StepPlan the runtime is built from.

The schedule fixes what the graphs do (transfer nodes, peak, predicted step). What is
left is decided here, once per compiled graph pair, and written into one frozen
``plan.step_plan.StepPlan``: where each region's AdamW update runs (update_sites.py,
within the device memory the schedule leaves free), how gradients reach the host, what
the step adds to host memory and whether ``host_memory`` holds it (host_budget.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..plan.step_plan import GradientPath, RegionDecision, StepPlan
from . import host_budget, update_sites
from .options import Options
from .rates import probed_here


def step_plan(plan, cap, opts: Options, streamer, handoffs: Sequence[tuple[int, int]],
              training: bool, kept: frozenset[int] = frozenset()) -> StepPlan:
    """The StepPlan of `plan` (a GraphPlan whose schedule is set) for the capture `cap`;
    `handoffs`: the backward's (region, param id) gradient hand-offs to megatrain.AdamW
    (none for another optimizer); `training`: the pair has a backward; `kept`: the regions
    that keep their activations (compiler/keep.py). `streamer` is asked for its own sizes only (cast staging, the
    snapshot window), never changed. Raises where host_memory cannot hold the step."""
    sched = plan.schedule
    chosen = sched.plan
    regions = update_sites.gradient_regions(handoffs)
    sites, reserve, window = update_sites_for(
        chosen.schedule.problem, plan.predicted_peak_bytes, sched.rates, opts, streamer, regions,
        cap.params) if regions else ({}, 0, 0)

    needs = host_needs_of(chosen, cap, opts, training)
    host_budget.check_host_budget(needs, opts.host_memory)

    offloaded = {sched.units[u][-1] if sched.units.get(u) else u for u in sorted(chosen.config.offloaded)}
    by_region = {g.region: g for g in regions}
    decisions = []
    for r in cap.regions.regions:
        g = by_region.get(r.id)
        decisions.append(RegionDecision(
            id=r.id, name=r.name, params=tuple(g.pids) if g else (), update=sites.get(r.id, "host"),
            resident_candidate=bool(g) and opts.updates == "resident",
            boundary="offloaded" if r.id in offloaded else "kept",
            recompute=r.id not in kept))
    return StepPlan(
        regions=tuple(decisions), prefetch=chosen.config.slots - 1,
        weights_from="shadows" if opts.weight_shadow else "masters", keep_weights=opts.keep_weights,
        gradients=_gradient_path(opts, needs, host_updates=any(
            sites.get(g.region, "host") == "host" for g in regions)), handoffs=tuple(handoffs), update_reserve=reserve,
        snapshot_window=window, host_needs=tuple(needs.items()), host_memory=opts.host_memory,
        predicted_peak_bytes=plan.predicted_peak_bytes, predicted_step_s=chosen.step_time,
        host_update_rate=chosen.schedule.host_update_rate if probed_here(sched.rates, opts.device) else None)


def host_needs_of(chosen, cap, opts: Options, training: bool) -> dict[str, int]:
    """What the planner's schedule `chosen` (plan.search.Plan) adds to host memory for the
    capture `cap`: the AdamW moments and gradient slabs training needs, and the boundary
    activations (with any kept outputs of their regions) the schedule parks there."""
    out_bytes = {r.id: r.out_bytes for r in chosen.schedule.problem.regions}
    offloaded_bytes = sum(int(out_bytes[u]) for u in chosen.config.offloaded)
    return host_budget.host_needs(cap.params, cap.region_params, offloaded_bytes,
                                  opts.compute_dtype.itemsize, opts.weight_shadow, training=training)


def offload_room(cap, opts: Options, training: bool) -> int | None:
    """The host bytes the plan may park activations in: host_memory less what training adds
    beside them (moments, slabs, shadows); None without a host budget."""
    if opts.host_memory is None:
        return None
    beside = host_budget.host_needs(cap.params, cap.region_params, 0, opts.compute_dtype.itemsize,
                                    opts.weight_shadow, training=training)
    return max(0, opts.host_memory - sum(beside.values()))


def update_sites_for(problem, peak: int, rates, opts: Options, streamer, regions,
                     params: Sequence[torch.Tensor]):
    """(site per region, the reserve beside the plan, the snapshot window) for a schedule of
    `problem` peaking at `peak` bytes: the device memory it leaves free, less the weight
    path's cast staging, holds the gradient snapshots that may await their copy (up to one
    fetch's gradients: the copies may then lag the backward by a region) and then the
    updates placed on the device."""
    itemsize = opts.compute_dtype.itemsize
    largest = update_sites.largest_fetch_params(problem, itemsize)
    room = max(0, opts.gpu_memory - peak - streamer.cast_staging_bytes(largest))
    window = min(room, streamer.snapshot_window_bytes(largest))
    reserve = room - window
    sites = update_sites.choose_sites(
        opts.updates, regions, params, rates, grad_bytes=itemsize, reserve=reserve,
        streamed_params=update_sites.backward_streamed_params(problem, itemsize))
    return sites, reserve, window


def _gradient_path(opts: Options, needs, host_updates: bool) -> GradientPath:
    """How gradients reach the host. The planner's choice on a GPU, where some region's
    update runs on the host, is slabs with the host backlog: the host updates regions in
    the order the next forward fetches them (earliest deadline first), and what it has
    not reached at the backward's end is updated beside that forward, each fetch waiting
    for its own region. It moves the same bytes and computes the same bits as arrival
    order; it only lets the forward start before the host is done, so it never costs a
    step and saves the head's forward where the host bounds the step. An optimizer that
    cannot defer (clipping, accumulation) declines it and the backward's end waits as in
    arrival order."""
    slab_bytes = host_budget.slab_room(needs, opts.host_memory)
    backlog = opts.backlog
    if backlog is None and opts.grad_chunk is None and host_updates and opts.device.type == "cuda":
        backlog = "host"
    if backlog not in (None, "arrival"):
        return GradientPath("backlog", backlog=backlog, max_slabs=opts.grad_slabs,
                            host_slab_bytes=slab_bytes)
    if opts.grad_chunk is not None:
        return GradientPath("ring", chunk_bytes=opts.grad_chunk, max_slabs=opts.grad_slabs,
                            host_slab_bytes=slab_bytes)
    return GradientPath("slabs", max_slabs=opts.grad_slabs, host_slab_bytes=slab_bytes)
