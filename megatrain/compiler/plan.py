"""The plan of a compiled graph: what `megatrain.explain` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..plan import timeline as timeline_mod
from ..plan.step_plan import StepPlan
from .regions import Region


@dataclass
class GraphPlan:
    """One dynamo graph (one backend call): its regions, the planner's schedule, the
    transfer ops it materialised and the lowered code."""

    regions: list[Region]
    budget: int
    forward_code: str = ""
    backward_code: str = ""
    forward_events: list[str] = field(default_factory=list)
    backward_events: list[str] = field(default_factory=list)
    prefetch_count: int = 0
    saved_activation_bytes: int = 0
    saved_activations: list[str] = field(default_factory=list)
    schedule: object = None  # schedule.StepSchedule: the planner's plan, rates, event lists
    streamer: object = None
    # The kernel patterns swapped into this graph (fusions.PATTERNS names), and why, in words,
    # when megatrain chose them itself (the fused loss applied because the budget needed it).
    kernels: tuple[str, ...] = ()
    note: str = ""
    # Token-wise modules swapped for megatrain::token_chunks (compiler/token_chunks.py).
    token_chunks: int = 0
    # Every decision the runtime was built from (plan/step_plan.py); the properties below
    # that describe decisions read it, so explain and the runtime cannot disagree.
    step_plan: StepPlan | None = None
    # Wall seconds of each compile phase of this graph (phases.py); the backward's lowering
    # lands here when AOTAutograd compiles it, at the first backward.
    compile_seconds: dict[str, float] = field(default_factory=dict)
    # The keep chooser's scores (plan.keep.KeepChoice; None where nothing was decided).
    keep_choice: object = None
    # Restored from the cache beside AOTAutograd's (compiler/aot_cache.py): this process
    # neither traced, partitioned, planned nor lowered the graph.
    cached: bool = False
    _sited: tuple | None = field(default=None, repr=False)  # (sites, schedule) last simulated

    @property
    def code(self) -> str:
        return f"# forward\n{self.forward_code}\n# backward\n{self.backward_code}"

    def record(self, step: StepPlan) -> None:
        """Keep the StepPlan the runtime is built from."""
        self.step_plan = step

    @property
    def update_sites(self) -> dict[int, str]:
        """Where each region's megatrain.AdamW update runs ("host" | "device" | "resident";
        update_sites.py), for the regions that hand their gradients to one."""
        return self.step_plan.sites if self.step_plan is not None else {}

    @property
    def kept_regions(self) -> frozenset[int]:
        """Regions whose backward reads their saved matmul and attention outputs instead of
        recomputing their forward (compiler/keep.py)."""
        if self.step_plan is None:
            return frozenset()
        return frozenset(r.id for r in self.step_plan.regions if not r.recompute)

    @property
    def update_reserve(self) -> int:
        """The device bytes the plan leaves free, within which updates on the device and
        resident state are held."""
        return self.step_plan.update_reserve if self.step_plan is not None else 0

    @property
    def update_params(self) -> dict[int, tuple[int, ...]]:
        """Region -> the parameter ids whose gradients it hands to megatrain.AdamW: the
        planner weights a site takes off the host (their ids are the parameters')."""
        if self.step_plan is None:
            return {}
        return {r.id: r.params for r in self.step_plan.regions if r.params}

    @property
    def host_needs(self) -> dict[str, int]:
        """Host bytes the graph adds beyond the model's parameters, by what holds them
        (compiler/host_budget.py)."""
        return dict(self.step_plan.host_needs) if self.step_plan is not None else {}

    @property
    def host_memory(self) -> int | None:
        """The host_memory budget the host needs were held to."""
        return self.step_plan.host_memory if self.step_plan is not None else None

    @property
    def slots(self) -> int:
        """Device buffers for region weights the planner chose (prefetch depth + 1)."""
        return self.schedule.slots if self.schedule is not None else 0

    @property
    def predicted_peak_bytes(self) -> int:
        return self.schedule.plan.peak_bytes if self.schedule is not None else 0

    @property
    def predicted_step_s(self) -> float | None:
        """Seconds per step the cost model predicts for this graph's schedule, with the
        update sites in effect (predicted_schedule)."""
        sched = self.predicted_schedule
        return sched.step_time if sched is not None else None

    def sites_now(self) -> dict[int, str]:
        """`update_sites` as the runtime has them now: with updates="resident" the regions
        resident at this moment (the set grows once a measured step shows room, and
        shrinks as regions are sent home), whatever the compile chose for them."""
        r = self._resident
        if r is None:
            return dict(self.update_sites)
        live = r.regions
        from .update_sites import with_live_resident
        return with_live_resident(self.update_sites, live)

    @property
    def predicted_schedule(self):
        """The planner's chosen schedule as the runtime runs it: simulated again with the
        update sites in effect (plan.problem.with_update_sites: a resident region moves no
        bytes and leaves the host no update, a device site leaves the host no update), or
        the planner's own schedule, which counts every update on the host, when all are
        there. The planner picks its configuration before the sites exist; they change
        the step's time, never its device memory."""
        if self.schedule is None:
            return None
        sites = self.sites_now()
        wait = self.updates_wait
        key = (tuple(sorted(sites.items())), wait)
        if self._sited is None or self._sited[0] != key:
            from .update_sites import timed_with_sites
            self._sited = (key, timed_with_sites(self.schedule.plan.schedule, self.schedule.rates,
                                                 sites, self.update_params, updates_wait=wait))
        return self._sited[1]

    @property
    def updates_wait(self) -> bool:
        """Whether the optimizer these regions hand their gradients to holds every update
        until step() (it clips, or checks for non-finite values): read now, since it is
        the optimizer's setting, not the graph's."""
        from .update_sites import optimizer_waits_for_norm

        params = self.streamer.params if self.streamer is not None else []
        return optimizer_waits_for_norm([params[pid] for pids in self.update_params.values() for pid in pids])

    @property
    def measured_peak_bytes(self) -> int | None:
        """Device bytes megatrain held at most during the last step (CUDA: allocator peak)."""
        s = self.streamer.last_stats if self.streamer is not None else None
        if s is None:
            return None
        if s.cuda_peak is not None:
            return s.cuda_peak
        return s.pool_peak

    @property
    def resident_regions(self) -> dict[int, str]:
        """updates="resident": the regions whose AdamW state lives on the device now (the
        runtime's live set: ``update_sites`` is the compile's choice, and the set grows
        once a measured step shows room, or shrinks as regions go home), with "resident",
        and those sent home with why."""
        r = self._resident
        if r is None:
            return {}
        return {**dict.fromkeys(r.regions, "resident"), **r.demoted}

    @property
    def waits(self) -> list:
        """What the GPU waits for in the predicted steady step, with the update sites in
        effect: plan.waits.Wait (seconds, reason, region), largest first."""
        from ..plan.waits import gpu_waits

        sched = self.predicted_schedule
        return gpu_waits(sched) if sched is not None else []

    @property
    def resident_params(self) -> int:
        """Parameters whose master weights and AdamW moments live on the device now."""
        r = self._resident
        if r is None:
            return 0
        return sum(self.streamer.params[p].numel() for pids in r.regions.values() for p in pids)

    @property
    def _resident(self):
        """The runtime's resident regions (runtime/resident_regions.py), None without
        resident state or a runtime."""
        return self.streamer.resident if self.streamer is not None else None

    @property
    def measured_records(self) -> list:
        """The last step's measured intervals from the runtime's CUDA events (weight copies,
        compute-stream waits for them, region compute, gradient copies); [] before a CUDA
        step ran."""
        s = self.streamer.last_stats if self.streamer is not None else None
        return timeline_mod.cuda_records(s) if s is not None else []


@dataclass
class Plan:
    graphs: list[GraphPlan]

    @property
    def regions(self) -> list[Region]:
        return [r for g in self.graphs for r in g.regions]

    @property
    def code(self) -> str:
        return "\n".join(g.code for g in self.graphs)

    @property
    def predicted_peak_bytes(self) -> int:
        return max((g.predicted_peak_bytes for g in self.graphs), default=0)

    @property
    def predicted_step_s(self) -> float | None:
        """Predicted seconds per step: the graphs run one after another, each once."""
        times = [g.predicted_step_s for g in self.graphs if g.predicted_step_s is not None]
        return sum(times) if times else None

    @property
    def compile_seconds(self) -> dict[str, float]:
        """Wall seconds per compile phase (phases.py), summed over the graphs."""
        return _summed(g.compile_seconds for g in self.graphs)

    @property
    def measured_peak_bytes(self) -> int | None:
        vals = [g.measured_peak_bytes for g in self.graphs if g.measured_peak_bytes is not None]
        return max(vals) if vals else None

    @property
    def resident_params(self) -> int:
        return sum(g.resident_params for g in self.graphs)

    @property
    def kept_regions(self) -> list[str]:
        """The regions whose backward reads the matmul and attention outputs their forward
        saved instead of recomputing them (compiler/keep.py), by name."""
        return [r.name for g in self.graphs for r in g.regions if r.id in g.kept_regions]

    @property
    def waits(self) -> list:
        """Every graph's predicted GPU waits (GraphPlan.waits), largest first."""
        return sorted((w for g in self.graphs for w in g.waits), key=lambda w: -w.seconds)

    @property
    def prefetch_count(self) -> int:
        return sum(g.prefetch_count for g in self.graphs)

    @property
    def host_needs(self) -> dict[str, int]:
        """Host bytes the graphs add beyond the model's parameters, by what holds them."""
        return _summed(g.host_needs for g in self.graphs)

    @property
    def notes(self) -> list[str]:
        """What megatrain decided on its own for the graphs (e.g. the fused loss, and why)."""
        return [f"graph {i}: {g.note}" for i, g in enumerate(self.graphs) if g.note]

    def timeline(self, path) -> str:
        """Write a Chrome-trace JSON (open it in ui.perfetto.dev) of every graph's predicted
        schedule, one track per stream, and beside it the measured last step where the
        runtime recorded one. Returns the path."""
        traces = []
        for i, g in enumerate(self.graphs):
            if g.schedule is None:
                continue
            name = f"graph {i}: {g.schedule.rates.device}"
            traces.append(timeline_mod.chrome_trace(g.predicted_schedule, pid=2 * i + 1,
                                                    process=f"megatrain predicted ({name})"))
            records = g.measured_records
            if records:
                traces.append(timeline_mod.measured_trace(records, pid=2 * i + 2,
                                                          process=f"megatrain measured (graph {i})"))
        return timeline_mod.write_trace(timeline_mod.merge(traces), path)


def _summed(per_graph) -> dict:
    """Mappings of the graphs summed key by key, in the order keys first appear."""
    total: dict = {}
    for values in per_graph:
        for k, v in values.items():
            total[k] = total.get(k, 0) + v
    return total
