"""The plan is the contract: every decision for one compiled graph pair, in one frozen value.

The compiler decides (the planner's schedule, where each region's update runs, how
gradients leave the device, what host memory the step may take) and writes the decisions
here; the runtime is configured from this value alone (``Streamer.configure``), and
``megatrain.explain`` shows it. Nothing here imports the compiler or the runtime: a plan
can be built, compared and printed without a GPU, and two equal plans configure a runtime
the same way.

What the transfer nodes of the scheduled graphs already say (the order of fetches,
evictions, offloads and reloads, the prefetch depth) is recorded for reading, not
re-applied: the graphs and this plan come from the same schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

UPDATE_SITES = ("host", "device", "resident")
GRADIENT_ROUTES = ("slabs", "ring", "backlog")


@dataclass(frozen=True)
class RegionDecision:
    """One region: where its weights come from on a fetch, where its AdamW update runs,
    what happens to its boundary activation between the passes, and whether its backward
    recomputes its forward or reads the matmul and attention outputs the forward saved
    (plan/keep.py)."""

    id: int
    name: str
    params: tuple[int, ...] = ()  # parameter ids whose gradients it hands off
    update: str = "host"  # "host" | "device" | "resident" (megatrain.AdamW's site)
    resident_candidate: bool = False  # may keep its state on the device once room allows
    boundary: str = "kept"  # "kept" on the device | "offloaded" to host memory
    recompute: bool = True  # False: its FLOP-bound outputs are saved for its backward

    def __post_init__(self):
        assert self.update in UPDATE_SITES, self.update
        assert self.boundary in ("kept", "offloaded"), self.boundary


@dataclass(frozen=True)
class GradientPath:
    """How gradients reach the host optimizer (runtime/grad_routes.py): region slabs, a ring
    of fixed chunks, or slabs with the earliest-deadline backlog (waiting on the host or
    the device); and the host memory the slabs may hold."""

    route: str = "slabs"
    backlog: str | None = None  # "host" | "device" with route "backlog"
    chunk_bytes: int | None = None  # route "ring"
    max_slabs: int | None = None  # None: two, more while the host lags and memory allows
    host_slab_bytes: int | None = None  # all slabs together, past two (None: no bound)

    def __post_init__(self):
        assert self.route in GRADIENT_ROUTES, self.route
        assert (self.route == "backlog") == (self.backlog is not None), (self.route, self.backlog)
        assert (self.route == "ring") == (self.chunk_bytes is not None), (self.route, self.chunk_bytes)


@dataclass(frozen=True)
class StepPlan:
    """Every decision for one compiled graph pair (see the module docstring)."""

    regions: tuple[RegionDecision, ...]
    prefetch: int  # the most regions fetched ahead of the one computing
    weights_from: str = "masters"  # "masters" (fp32, cast on the device) | "shadows" (bf16 copies)
    keep_weights: bool = False  # the backward reuses forward weights where the plan kept them
    gradients: GradientPath = field(default_factory=GradientPath)
    # The backward's gradient hand-offs, (region, param id) in order: what it sends.
    handoffs: tuple[tuple[int, int], ...] = ()
    update_reserve: int = 0  # device bytes beside the plan for updates in flight and resident state
    snapshot_window: int = 0  # device bytes of gradient snapshots that may await their copy
    host_needs: tuple[tuple[str, int], ...] = ()  # host bytes beyond the parameters, by holder
    host_memory: int | None = None  # the budget they were held to
    predicted_peak_bytes: int = 0
    predicted_step_s: float | None = None  # the planner's schedule, every update on the host
    # Parameters/s the plan charged each host AdamW update at, where they came from this
    # machine's probe and run as their gradients arrive (runtime/host_rate.py holds
    # training to it); None: nothing to hold it to.
    host_update_rate: float | None = None

    def __post_init__(self):
        assert self.weights_from in ("masters", "shadows"), self.weights_from

    @property
    def sites(self) -> dict[int, str]:
        """Region -> where its update runs, for regions that hand off gradients."""
        return {r.id: r.update for r in self.regions if r.params}

    @property
    def device_regions(self) -> dict[int, list[int]]:
        """Regions updated on the device with streamed state -> their parameter ids."""
        return {r.id: list(r.params) for r in self.regions if r.update == "device"}

    @property
    def resident_order(self) -> dict[int, list[int]]:
        """Regions that may keep their state on the device, in the order the runtime
        acquires room for them, -> their parameter ids."""
        order = sorted((r for r in self.regions if r.resident_candidate),
                       key=lambda r: self._handoff_rank[r.id], reverse=True)
        return {r.id: list(r.params) for r in order}

    @property
    def _handoff_rank(self) -> Mapping[int, int]:
        last: dict[int, int] = {}
        for i, (region, _) in enumerate(self.handoffs):
            last[region] = i
        return last

    def describe(self) -> str:
        """A few lines for a person: the decisions, region by region."""
        lines = [f"prefetch {self.prefetch}, weights from {self.weights_from}, "
                 f"gradients by {self.gradients.route}"
                 + (f" ({self.gradients.backlog})" if self.gradients.backlog else "")
                 + f", update reserve {self.update_reserve} B"]
        for r in self.regions:
            lines.append(f"  {r.name}: update {r.update}"
                         + (" (resident candidate)" if r.resident_candidate and r.update != "resident" else "")
                         + f", boundary {r.boundary}"
                         + ("" if r.recompute else ", matmul outputs saved (no recompute)"))
        return "\n".join(lines)
