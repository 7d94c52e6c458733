"""Where each region's AdamW update runs: on the host (megatrain.AdamW's worker) or on the
compute device (``AdamW.submit_on_device``: master, m, v streamed in, updated, streamed
back). The cost model and the mechanism are megatrain.optim.device_update.

Decided once per compiled graph pair, after the planner, from:

- the regions that hand gradients to megatrain.AdamW, in the order the backward completes
  them (a region's update can start once its last gradient is out);
- the rates the plan used (``StepSchedule.rates``) and the backward's own load: the weight
  fetches it streams (``PhaseLoad.streaming``: the runtime DMAs fp32 masters);
- the device memory the plan leaves free (the *reserve*, below).

Policy (``updates`` option):

- a region holding a parameter whose gradient arrives in pieces (a tied weight fetched by
  two regions, or twice by one) is never updated with streamed state ("device"), whose
  update runs per region: it stays on the host, where the pieces are summed, unless it is
  resident (below: the regions sharing the parameter together, the first pieces summed
  on the device);
- so does a region whose device update would not fit the reserve on its own;
- ``"host"``: every region on the host. ``"device"``: every other region on the device.
  ``"auto"``: :func:`~megatrain.optim.device_update.assign_sites` over the other regions,
  with the load of the fixed host regions added to the backward's streaming load: a
  region goes to the device when that ends the backward's transfer phase sooner.
- ``"resident"``: first, regions whose AdamW state then lives on the device for good
  (megatrain.optim.resident: no host memory, no link bytes for their fetches and
  updates), as many as the reserve holds at 12 B/param beside one fp32 upcast scratch
  (regions sharing a parameter as one, with room for the buffers its first gradient
  pieces wait in), taken from the end of the backward's order: the regions whose updates
  come last, which the next forward needs first (the step's serial tail on a host-bound
  step); then ``"auto"`` over the rest with what is left of the reserve. Whatever the rates: a
  resident region moves no bytes at all, so no cost model is needed to prefer it.

Memory: a device update's buffers (``device_update.held_bytes``: ~16 bytes per parameter)
live from the region's first gradient until the update's copy back completes, which a
waiter thread observes: not a compute-stream span, so the planner's program (whose every
allocation and free is a compute-stream op) cannot place them. They are not added to the
planner's memory model; instead they must fit beside the plan's proven peak: the reserve
is ``gpu_memory - predicted peak - the weight path's cast staging`` (which also lives
outside the plan). A region goes to the device only if its update fits the reserve alone,
and the runtime counts updates in flight against the reserve, waiting for earlier ones to
finish (never changing the site) when the next one would not fit. So the plan's peak plus
the updates in flight stay within ``gpu_memory``, and which path a region takes does not
depend on timing. (One exception: should the streamer's pool hold more than the plan, e.g.
a fetch started early for the next graph, and no update be in flight to wait for, that
region takes the host path for that step rather than exceed ``gpu_memory``.)
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ..optim import device_update as du
from ..optim import resident
from ..optim.registry import sole_owner
from ..plan.costs import Rates
from ..plan.problem import Problem, with_update_sites
from ..plan.simulate import Schedule, simulate

UPDATES = ("auto", "host", "device", "resident")


@dataclass(frozen=True)
class GradientRegion:
    """One region that hands gradients to megatrain.AdamW: its parameter ids, and whether
    one of them also gets gradient pieces elsewhere (then the host sums them, or the
    device where the regions sharing it are resident)."""

    region: int
    pids: tuple[int, ...]
    shared: bool


def gradient_regions(handoffs: Sequence[tuple[int, int]]) -> list[GradientRegion]:
    """Regions from the backward's (region, param id) hand-offs, in the order their last
    gradient is handed off (the order their updates can start)."""
    pieces = collections.Counter(pid for _, pid in handoffs)
    last: dict[int, int] = {}
    pids: dict[int, list[int]] = {}
    for i, (region, pid) in enumerate(handoffs):
        last[region] = i
        if pid not in pids.setdefault(region, []):
            pids[region].append(pid)
    return [GradientRegion(r, tuple(pids[r]), any(pieces[p] > 1 for p in pids[r]))
            for r in sorted(last, key=last.__getitem__)]


def backward_streamed_params(problem: Problem, itemsize: int) -> int:
    """Parameters the backward fetches (weights read by recompute + backward), from the
    planner's own problem: the streaming load device updates share the link with."""
    nbytes = {w.id: w.nbytes for w in problem.weights}
    return sum(nbytes[w] for r in problem.regions for w in r.reads("bw")) // itemsize


def largest_fetch_params(problem: Problem, itemsize: int) -> int:
    """Parameters of the largest single fetch (one planner region, one pass): what sizes
    the weight path's device cast staging."""
    nbytes = {w.id: w.nbytes for w in problem.weights}
    return max((sum(nbytes[w] for w in r.reads(ph)) for r in problem.regions for ph in problem.phases),
               default=0) // itemsize


def choose_sites(mode: str, regions: Sequence[GradientRegion], params: Sequence[torch.Tensor],
                 rates: Rates, *, streamed_params: int, grad_bytes: int,
                 reserve: int) -> dict[int, str]:
    """Site per region, "host", "device" or "resident" (see the module docstring). Pure:
    the same inputs give the same sites."""
    assert mode in UPDATES, mode  # parse_options validated it
    numel = {g.region: sum(params[p].numel() for p in g.pids) for g in regions}
    sites: dict[int, str] = {g.region: "host" for g in regions}
    if mode == "resident":
        resident, reserve = resident_sites(regions, params, reserve)
        sites.update(dict.fromkeys(resident, "resident"))
        streamed_params -= sum(numel[r] for r in resident)
        regions = [g for g in regions if g.region not in resident]
        mode = "auto"
    free = [g.region for g in regions if mode != "host" and not g.shared
            and du.held_bytes([params[p].shape for p in g.pids]) <= reserve]
    if mode == "device":
        sites.update(dict.fromkeys(free, "device"))
    elif mode == "auto" and free:
        load = du.PhaseLoad.streaming(max(streamed_params, 0))
        for g in regions:
            if g.region not in free:
                load = load + du.update_load(numel[g.region], "host", grad_bytes)
        chosen, _ = du.assign_sites([numel[r] for r in free], rates, load=load, grad_bytes=grad_bytes)
        sites.update(zip(free, chosen))
    return sites


def resident_sites(regions: Sequence[GradientRegion], params: Sequence[torch.Tensor],
                   reserve: int) -> tuple[list[int], int]:
    """The regions to keep resident, in the order the runtime acquires them (the end of
    the backward's order first), and the reserve left: each region's
    ``resident.resident_bytes`` plus one upcast scratch (``resident.upcast_scratch_numel``:
    the largest parameter among the candidates, at most 64 MiB; what the runtime's
    ResidentRegions acquires, or more). Regions sharing a parameter (a tied embedding's
    two) go together or not at all, their state counted once, and the buffers the first
    pieces of the shared gradients wait in taken with them (``resident.group_bytes``)."""
    candidates = list(regions)
    scratch = 4 * resident.upcast_scratch_numel(params[p].numel() for g in candidates for p in g.pids)
    if not candidates or scratch > reserve:
        return [], reserve
    left = reserve - scratch
    pids = {g.region: list(g.pids) for g in candidates}
    groups = resident.sharing_groups(pids)
    chosen: list[int] = []
    for g in reversed(candidates):
        if g.region in chosen:
            continue
        group = groups[g.region]
        state, buffers = resident.group_bytes({r: pids[r] for r in group}, params)
        waiting = sum(buffers.values())
        if state + waiting <= left:
            chosen.extend(r for r in reversed(pids) if r in group)
            left -= state + waiting   # the runtime books the waiting buffers at admission too
    return chosen, (left if chosen else reserve)


def optimizer_waits_for_norm(params: Sequence[torch.Tensor]) -> bool:
    """Whether the one optimizer owning ``params`` (the parameters handed to it) holds
    every update until step(): it clips, or checks for non-finite values
    (Problem.updates_wait). False where none or several own them."""
    opt = sole_owner(params) if params else None
    return opt is not None and opt.waits_for_norm()


def with_live_resident(sites: Mapping[int, str], live) -> dict[int, str]:
    """`sites` (the compile's choice) with the regions in `live` resident and any other the
    compile made resident back on the host: the runtime's resident set grows once a
    measured step shows room and shrinks as regions are sent home."""
    return {r: "resident" if r in live else ("host" if s == "resident" else s) for r, s in sites.items()}


def timed_with_sites(planned: Schedule, rates: Rates, sites: Mapping[int, str],
                     pids: Mapping[int, Sequence[int]], updates_wait: bool = False) -> Schedule:
    """`planned`, the planner's schedule (every update on the host when it was chosen),
    timed as the runtime runs it with `sites` (region -> "host" | "device" | "resident",
    `pids`: region -> its parameter ids, which are the planner's weight ids) and, with
    `updates_wait`, the host's updates after the backward's last gradient (the optimizer
    clips: Problem.updates_wait): the same configuration, so the same peak; `planned`
    itself when every update is on the host and none waits."""
    by_weight = {pid: site for r, site in sites.items() if site != "host" for pid in pids.get(r, ())}
    if not by_weight and not updates_wait:
        return planned
    problem = replace(planned.problem, updates_wait=True) if updates_wait else planned.problem
    return simulate(with_update_sites(problem, by_weight), planned.config, rates, planned.steps)
