"""megatrain's own figures for a bench row, read from `megatrain.explain(...)` after the
timed steps: what the planner predicted per stream beside what the runtime's CUDA events
and timers measured (weights' stalls, gradient copies, the optimizer's host time, slabs,
backlog, resident updates). They say why a step took what it took, which tokens/s cannot."""

from __future__ import annotations

import collections


def _streamers(plan) -> list:
    """The runtime streamer of each graph in `megatrain.explain(...)`'s plan that has one."""
    return [g.streamer for g in plan.graphs if g.streamer is not None]


def _megatrain_stats(step_fn) -> dict:
    import megatrain
    from megatrain.memory import host_store

    plan = megatrain.explain(step_fn)
    streamers = _streamers(plan)
    stats = [s.last_stats for s in streamers if s.last_stats is not None]
    # as the runtime runs them: with the update sites in effect (resident regions move nothing)
    schedules = [g.predicted_schedule for g in plan.graphs if g.schedule is not None]

    def per_step(stream: str) -> float:  # the cost model's busy seconds of one stream
        return sum(sum(s.end[t] - s.start[t] for t in s.streams[stream]) / s.steps for s in schedules)

    def measured(pairs: str) -> float:  # seconds covered by the last step's CUDA event pairs
        return sum(s.event_seconds(pairs) for s in stats)

    from torch._dynamo.utils import counters

    from megatrain.compiler import aot_cache

    return {"predicted_step_s": plan.predicted_step_s,
            # how the warm-start caches answered: megatrain's plan cache (compiler/aot_cache.py
            # counters: stored, reused, why not) and torch's AOTAutograd and FX graph caches
            "warm_start_cache": {"megatrain": dict(aot_cache.counters),
                                 "aot_autograd": {k: v for k, v in counters["aot_autograd"].items()
                                                  if "cache" in k},
                                 "inductor": {k: v for k, v in counters["inductor"].items()
                                              if "cache" in k}},
            # the backend's compile phases in wall seconds (megatrain/compiler/phases.py);
            # dynamo's tracing is the first step's time less these and the step itself
            "compile_phases_s": {k: round(v, 3) for k, v in plan.compile_seconds.items()},
            # regions whose forward weights the plans keep for the backward (keep_weights)
            "kept_regions": sum(len(s.config.kept_weights) for s in schedules),
            # regions whose backward reads their saved matmul outputs instead of recomputing
            # (compiler/keep.py), and the bytes every saved activation takes
            "activations_kept": sum(len(g.kept_regions) for g in plan.graphs),
            "saved_activation_bytes": sum(g.saved_activation_bytes for g in plan.graphs),
            # what megatrain applied on its own (the fused loss, token chunks) and why
            "applied_kernels": sorted({k for g in plan.graphs for k in g.kernels}),
            "token_chunks": sum(g.token_chunks for g in plan.graphs),
            "plan_notes": plan.notes,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            # what the GPU waits for in the predicted step, largest first (plan/waits.py),
            # beside the measured stalls below
            "predicted_waits": [{"s": round(w.seconds, 5), "reason": w.reason, "region": w.region}
                                for w in plan.waits[:8]],
            # FLOPs the backward spends recomputing forwards, per step (issue 35: counted
            # apart from the model's)
            "recompute_flops_per_step": sum(recompute_flops(g) for g in plan.graphs if g.schedule is not None),
            "predicted_compute_s": per_step("compute"), "predicted_h2d_s": per_step("h2d"),
            "predicted_d2h_s": per_step("d2h"), "predicted_host_s": per_step("host"),
            "measured_compute_s": measured("computes"), "measured_d2h_s": measured("grad_copies"),
            "grad_slab_bytes": sum(s._slabs.allocated * s._slabs.slab_bytes for s in streamers),
            "grad_own_buffers": sum(s._slabs.own_buffers for s in streamers),
            "grad_ring_bytes": sum(s._ring.allocated * s._ring.chunk_bytes for s in streamers if s._ring),
            # the device memory the plan leaves free (device-site updates, the backlog) and
            # how many regions' gradients waited there over the whole run (backlog="device")
            "update_reserve_bytes": sum(s.reserve.nbytes for s in streamers if s.reserve is not None),
            # ... as the compile planned it (updates="resident" grows it from a measured step)
            "update_reserve_planned_bytes": sum(g.update_reserve for g in plan.graphs),
            "backlogged_regions_total": sum(s.backlog.backlogged for s in streamers if s.backlog is not None),
            # updates="resident": regions whose AdamW state lives on the GPU, its bytes, and
            # the regions sent home (why) over the run
            "resident_regions": sum(len(s.resident.regions) for s in streamers if s.resident is not None),
            "resident_bytes": sum(sum(s.resident.held.values()) for s in streamers if s.resident is not None),
            "resident_params": plan.resident_params,
            "resident_demoted": {r: why for s in streamers if s.resident is not None
                                 for r, why in s.resident.demoted.items()},
            "device_update_sites": sum(list(g.update_sites.values()).count("device") for g in plan.graphs),
            "page_lock_failures": list(host_store.register_failures),
            # the host update rate each plan charged, what training reached (the median of
            # its observed steps) and the scale written to the probe's cache for the next
            # compile, if any (runtime/host_rate.py)
            "host_rate_watch": [{"planned": w.planned, "observed": w.observed, "steps": w.rates,
                                 "written_scale": w.written_scale}
                                for w in (s.host_rate for s in streamers) if w is not None],
            "planned_with": sorted({g.schedule.rates.device for g in plan.graphs if g.schedule is not None}),
            "planned_rates": next((g.schedule.rates.to_json() for g in plan.graphs if g.schedule is not None), None),
            "h2d_bytes": sum(s.h2d_bytes for s in stats), "d2h_bytes": sum(s.d2h_bytes for s in stats),
            "transfer_stall_s": sum(s.transfer_stall_s() for s in stats),
            "optimizer_wait_s": sum(s.optimizer_wait_s for s in stats),
            "slab_wait_s": sum(s.slab_wait_s for s in stats),
            # backlog: regions whose update the last backward's end deferred into the forward
            "deferred_regions": sum(s.deferred_regions for s in stats),
            # the last step's host updates by the phase they began in (does the host's rate
            # fall beside the forward's weight copies?)
            "host_updates_by_phase": _merge_phases(s.host_updates_by_phase() for s in stats),
            "cast_wait_s": sum(s.cast_wait_s for s in stats),
            "fetch_paths": dict(sum((s.fetch_paths for s in stats), collections.Counter())),
            "h2d_busy_s": sum(s.h2d_busy_s() for s in stats),
            "stall_by_region": [{r: round(t, 4) for r, t in s.stall_by_region().items() if t > 1e-4}
                                for s in stats]}


def _merge_phases(per_streamer) -> dict:
    out: dict = {}
    for phases in per_streamer:
        for phase, row in phases.items():
            into = out.setdefault(phase, {"updates": 0, "params": 0, "busy_s": 0.0})
            for k, v in row.items():
                into[k] += v
    return out


def recompute_flops(graph) -> float:
    """FLOPs one graph pair's step spends recomputing forwards: the forward FLOPs of every
    planner region whose backward recomputes it, i.e. all but those whose graph regions all
    keep their activations (explain's kept_regions)."""
    kept, units = graph.kept_regions, graph.schedule.units
    return sum(float(r.flops_fw) for r in graph.predicted_schedule.problem.regions
               if not set(units.get(r.id, (r.id,))) <= kept)


def host_rates_again(device) -> dict:
    """The host AdamW rates the planner reads (runtime/probe.py), timed twice more after the
    timed steps on the same machine: beside the row's `planned_rates` (the compile's probe)
    they say how far the probe moves within one machine, and beside `host_updates_by_phase`
    how far it is from the rate training reached (G params/s). The first timing right after
    training may still share the host with the optimizer's threads settling; the second
    (`again`) says whether it did."""
    import torch

    from megatrain.runtime.probe import probe

    rates, _ = probe(device)
    again, _ = probe(device)
    torch.cuda.empty_cache()  # the probe's blocks back, as the backend's probe hands them
    return {"adamw": rates.adamw, "adamw_quiet": rates.adamw_quiet,
            "again": {"adamw": again.adamw, "adamw_quiet": again.adamw_quiet}}
