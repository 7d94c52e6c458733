"""The streaming runtime behind megatrain's transfer ops.

One `Streamer` serves one compiled graph pair (forward, backward). It is the object the
ops call (compiler/ops.py), and it coordinates parts that each do one job:

- weights in (weight_fetch.py): a region's weights fetched into a device buffer by the
  cheapest path its sources allow. The streamer keeps which buffer each region computes
  with and when: prefetch -> wait -> evict, or keep -> claim across forward and backward,
  fetches started early by the graph that ran before (graph_order.py), and the always-on
  check at `wait` that a buffer holds the parameters its prefetch named;
- gradients out to an optimizer: offered to the ways out in order (grad_routes.py:
  resident state, device updates, the ring, the device backlog, host slabs), counted in
  per region and handed over on one thread (grad_handoff.py); gradients bound for
  ``p.grad`` instead go through host_grads.py;
- the room beside the plan (update_room.py): the reserve, the updates placed in it, and
  how measured steps grow or shrink it;
- boundary activations parked in host memory between the passes (activation_offload.py);
- the step's stats (step_stats.py), and the device pool that enforces `gpu_memory`, which
  the parts share through a `StreamContext` with the device's two copy streams.

Device buffers are allocated on the compute stream at prefetch time, filled on the copy
stream after an event, and handed to the graph at `wait`, after which the graph owns them:
Inductor frees them at their last use, in compute-stream order, so they can never be
recycled while a copy into them is in flight.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

import torch

from .. import config
from ..memory.host_store import (
    release_cached_pinned_blocks,
    release_unused_pinned_blocks,
)
from ..memory.layout import FlatLayout
from ..memory.pool import DevicePool
from ..optim.registry import by_owner
from ..plan.step_plan import StepPlan
from . import graph_order, handoff_graphs
from .activation_offload import ActivationStore
from .deadlines import Deadlines
from .grad_backlog import GradBacklog
from .grad_copies import GRAD_TRANSFER_DTYPE, Snapshots
from .grad_handoff import GradHandoff
from .grad_ring import GradRing
from .grad_routes import (
    BacklogRoute,
    DeviceUpdateRoute,
    GradRoute,
    ResidentRoute,
    RingRoute,
    SlabRoute,
)
from .grad_slabs import GradSlabs
from .host_rate import HostRateWatch
from .host_grads import HostGrads
from .step_stats import StepStats
from .stream_context import StreamContext
from .update_room import UpdateRoom
from .weight_fetch import Inflight, WeightCopier, host_copies_current

# Chunks of the gradient ring (grad_ring.py) when it is on: one being filled, one waiting,
# one being updated, and one of slack for the hand-off's latency.
GRAD_RING_CHUNKS = 4

# fp32 elements per device staging chunk of the weight path (64 MiB): large enough that the
# cast kernel after each chunk's copy costs ~1% of the copy, small beside a layer. Read when
# a Streamer is made (its WeightCopier's chunk).
CAST_CHUNK = 16 << 20


def cuda_cast_staging_bytes(region_numel: int, compute_dtype: torch.dtype) -> int:
    """`Streamer.cast_staging_bytes` on a CUDA device: the fp32 staging chunk the weight
    path casts from (none when it computes in fp32)."""
    return 0 if compute_dtype == torch.float32 else min(CAST_CHUNK, region_numel) * 4


_REGISTRY: list[Streamer] = []
_LOCK = threading.Lock()
_last_begun: int | None = None  # the streamer whose step began last (end_step's measurement)


def register(streamer: Streamer) -> int:
    with _LOCK:
        _REGISTRY.append(streamer)
        streamer.index = len(_REGISTRY) - 1
        return streamer.index


def get(index: int) -> Streamer:
    return _REGISTRY[index]


class Streamer:
    """One graph pair's runtime: the ops' entry points, and what ties the parts together
    (a fetch tells the gradient side its region's slab bytes; whether slabs may grow
    depends on the updates placed beside the plan; the step boundaries reset or measure
    every part). Private attributes the tests and benchmarks read (``_slabs``, ``_ring``,
    ``_sealed``, ``_defer_declined``, ``_cast_chunk``, ``_early``) stay reachable here."""

    def __init__(self, device: torch.device, compute_dtype: torch.dtype, budget: int,
                 params: list[torch.nn.Parameter], staging_slots: int = 2,
                 grad_slabs: int | None = None):
        self.device = device
        self.compute_dtype = compute_dtype
        self.params = params
        self.pool = DevicePool(budget)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
        streams = (self.h2d_stream, self.d2h_stream) if self.cuda else (None, None)
        self._ctx = StreamContext(device, self.pool, StepStats(), *streams)
        self.last_stats: StepStats | None = None
        self.index = -1
        self.region_names: dict[int, str] = {}  # for the safety net's error (wait)
        self.weight_shadow = False  # fetch from AdamW's bf16 shadows (StepPlan.weights_from)
        self.step_plan: StepPlan | None = None  # configure
        self.host_rate: HostRateWatch | None = None  # configure, where the plan names a rate
        self.grad_transfer_dtype: torch.dtype | None = GRAD_TRANSFER_DTYPE  # None: compute dtype
        # -- weights in: each region's buffers, from prefetch to evict --
        self._weights = WeightCopier(self._ctx, compute_dtype, CAST_CHUNK, staging_slots)
        self._inflight: dict[int, collections.deque[Inflight]] = collections.defaultdict(collections.deque)
        # Forward weight buffers the plan keeps for their region's backward, with the host
        # parameters they hold (keep -> claim -> wait), and each region's host parameters
        # as last prefetched (what keep records).
        self._kept: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._claimed: dict[int, torch.Tensor] = {}
        self._host_params: dict[int, list[torch.Tensor]] = {}
        self._layouts: dict[tuple, FlatLayout] = {}
        self._computing: dict[int, torch.cuda.Event] = {}  # region -> its weights-ready event
        # Prefetch across graphs (graph_order.py): each phase's first fetch, and fetches
        # started early by the graph that ran before, with the parameters' versions then.
        self._phase, self._awaiting_first = "forward", True
        self._first: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self._early: dict[int, Inflight] = {}
        # The safety net (wait): the parameters each queued prefetch asked for, per region.
        self._requested: dict[int, collections.deque[list[torch.Tensor]]] = collections.defaultdict(
            collections.deque)
        # -- updates beside the plan (_place_updates) --
        self._room = UpdateRoom(self._ctx)
        self._resident_claimed = False  # begin_step sends other graphs' residents home, once
        # grow_reserve's measurement: whole steps of this graph alone (begin/end_step)
        self._measurable, self._begun_since_end = False, 0
        # -- gradients out --
        self._slabs = GradSlabs(pin=self.cuda, max_slabs=grad_slabs, overlap=self._host_lag_overlaps)
        self._snapshots = Snapshots(device)
        self._handoff = GradHandoff(self._ctx, self._slabs, self._snapshots, self._region_out)
        self._host_grads = HostGrads(self._ctx)
        self._ring: GradRing | None = None  # _enable_grad_ring
        # The backlog (_enable_backlog): the forward's fetch order, by which sealed regions
        # are handed over (None: in arrival order, and backward's end waits for them all),
        # and the device side of backlog="device".
        self.deadlines: Deadlines | None = None
        self.backlog: GradBacklog | None = None
        self._routes: list[GradRoute] = []
        self._route_gradients()
        self._autotune_pins_released = False  # drain: release_cached_pinned_blocks, once
        # Boundary activations the plan parks in host memory between the passes.
        self.activations = ActivationStore(device, self._ctx.h2d_stream, self._ctx.d2h_stream)

    # -- what the parts hold, as the compiler, explain, tests and benchmarks read it ----
    @property
    def stats(self) -> StepStats:
        """Bytes moved and device memory seen during this step (so far)."""
        return self._ctx.stats

    @stats.setter
    def stats(self, value: StepStats) -> None:
        self._ctx.stats = value

    @property
    def reserve(self):
        """What the plan leaves free on the device (_place_updates); None before."""
        return self._room.reserve

    @property
    def resident(self):
        """Regions whose AdamW state lives on the device (ResidentRegions), or None."""
        return self._room.resident

    @property
    def device_updates(self):
        """Regions whose AdamW update runs on the device (DeviceUpdates), or None."""
        return self._room.device_updates

    @property
    def snapshot_window(self) -> int:
        """Bytes of gradient snapshots, the newest excepted, that may wait for their copy
        before the compute stream is made to (settle_snapshots); set beside the plan."""
        return self._snapshots.window

    @snapshot_window.setter
    def snapshot_window(self, nbytes: int) -> None:
        self._snapshots.window = nbytes

    @property
    def _sealed(self):
        """Sealed regions waiting for the hand-off thread (its `served` record)."""
        return self._handoff.sealed

    @property
    def _defer_declined(self) -> bool:
        """The last backward's optimizers would not defer (GradHandoff.defer_rest)."""
        return self._handoff.defer_declined

    @property
    def _cast_chunk(self) -> torch.Tensor | None:
        """The weight path's device staging chunk, if it has one."""
        return self._weights.cast_chunk

    # -- step boundaries -------------------------------------------------------------
    def begin_step(self) -> None:
        global _last_begun
        self._phase, self._awaiting_first = "forward", True
        # A step measures this graph's whole step only if no other graph began since this
        # one last did, and this graph runs once per step (not once per module).
        self._measurable = _last_begun in (None, self.index) and self._begun_since_end == 0
        _last_begun = self.index
        self._begun_since_end += 1
        if self.resident is not None and not self._resident_claimed:
            self._resident_claimed = True
            self._send_other_residents_home()
        self._room.shed_overrun()  # between steps: no update of this graph is pending
        for flat, _ in self._kept.values():  # kept by a forward whose backward has not run
            self._release(flat)
        self._kept.clear()
        if self.device_updates is not None:
            self.device_updates.abandon()
        if self.host_rate is not None:  # the last step's updates are all in: they ran until now
            self.host_rate.observe(self.stats.host_updates)
        self.stats = StepStats()
        self.stats.phase_starts["forward"] = time.perf_counter()
        self.pool.reset_peak()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.stats.cuda_base = torch.cuda.memory_allocated(self.device)

    def end_step(self) -> None:
        self.stats.pool_peak = self.pool.peak
        measured = self._allocator_peak()
        if measured is not None:
            self.stats.cuda_peak = measured - self.stats.cuda_base
        self.last_stats = self.stats
        whole = self._measurable and _last_begun == self.index and self._begun_since_end == 1
        self._begun_since_end = 0
        if whole and measured is not None:
            self._room.measured(measured)

    def _allocator_peak(self) -> int | None:
        """The device allocator's high-water mark since begin_step (every byte allocated,
        whoever holds it); None off CUDA, where only the pool's own count is known."""
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def _host_lag_overlaps(self) -> bool:
        """Whether a host optimizer lagging behind backward has GPU work to overlap, so
        that the gradient slabs may grow (grad_slabs.py): some regions' updates skip the
        host (resident state, device sites), or the host backlog defers updates into the
        next forward (unless the optimizers declined last time)."""
        bypass = ((self.resident is not None and self.resident.regions)
                  or (self.device_updates is not None and self.device_updates.regions))
        host_backlog = self.deadlines is not None and self.backlog is None
        return bool(bypass or (host_backlog and not self._handoff.defer_declined))

    def _region_out(self) -> None:
        """A region's last gradient is out (GradHandoff.count_in): in the first backward,
        give back the pinned blocks autotuning this region's kernels left cached unused,
        before the optimizer's moments grow, so they do not add to the host's peak."""
        if self.cuda and not self._autotune_pins_released:
            release_unused_pinned_blocks()

    # -- the room beside the plan (update_room.py; the sites: compiler/update_sites.py) --
    def _place_updates(self, regions: dict[int, list[int]], reserve: int,
                      resident: dict[int, list[int]] | None = None) -> None:
        """Run the AdamW update of ``regions`` (region -> its parameter ids) on the device,
        their buffers in flight held within ``reserve`` bytes beside the plan; keep the
        AdamW state of ``resident`` regions on the device for good, their bytes taken from
        the reserve first (resident_regions.py). Resident bytes outlive this graph's step,
        which other graphs' plans do not count: every other streamer's go home."""
        self._room.place(self.params, regions, reserve, resident)
        self._route_gradients()

    def grow_reserve(self, measured_peak: int) -> None:
        """Lend resident regions what a measured step left free (UpdateRoom.grow)."""
        self._room.grow(measured_peak)

    def shrink_reserve(self, measured_peak: int) -> None:
        """Send resident regions home for a step over gpu_memory (UpdateRoom.shrink)."""
        self._room.shrink(measured_peak)

    def _send_other_residents_home(self) -> None:
        """Resident bytes outlive their graph's step and no other graph's plan counts them:
        before this graph's first step, every other graph's resident regions go home (at
        run time: demotion copies real tensors, which compile-time fake mode forbids)."""
        with _LOCK:
            others = [s for s in _REGISTRY if s is not self and s.resident is not None]
        for other in others:
            other.resident.demote_all("another compiled graph holds resident regions now")

    def configure(self, step: StepPlan) -> None:
        """Build this graph pair's runtime side from its plan (plan/step_plan.py), once:
        the gradients the backward sends, the updates beside the plan and the resident
        candidates, how gradients reach the host and the host memory their slabs may hold.
        A second, different plan for the same streamer is a bug: the graphs were lowered
        for the first."""
        if self.step_plan is not None:
            assert step == self.step_plan, "a streamer is configured from one StepPlan"
            return
        self.step_plan = step
        self.region_names = {r.id: r.name for r in step.regions}
        self.weight_shadow = step.weights_from == "shadows"
        g = step.gradients
        self._slabs.set_max_slabs(g.max_slabs)
        self._slabs.host_bytes = g.host_slab_bytes
        if not step.handoffs:
            return
        self._expect_gradients(collections.Counter(p for _, p in step.handoffs),
                              collections.Counter(r for r, _ in step.handoffs))
        self.snapshot_window = step.snapshot_window
        if step.host_update_rate is not None:
            self.host_rate = HostRateWatch(self.device, step.host_update_rate)
        self._place_updates(step.device_regions, step.update_reserve, resident=step.resident_order)
        if g.route == "backlog":
            self._enable_backlog(g.backlog, list(step.handoffs))
        elif g.route == "ring":
            self._enable_grad_ring(g.chunk_bytes)

    def cast_staging_bytes(self, region_numel: int) -> int:
        """Device bytes the weight path's cast staging may take beside the plan when the
        largest fetch is ``region_numel`` parameters (only CUDA casts on the device)."""
        return cuda_cast_staging_bytes(region_numel, self.compute_dtype) if self.cuda else 0

    def snapshot_window_bytes(self, region_numel: int) -> int:
        """The most bytes of older gradient snapshots worth letting wait for their copies
        (settle_snapshots) when the largest fetch is ``region_numel`` parameters: one
        region's gradients in the transfer dtype (only CUDA copies from snapshots)."""
        return region_numel * (self.grad_transfer_dtype or self.compute_dtype).itemsize if self.cuda else 0

    # -- weights in ------------------------------------------------------------------
    def layout(self, shapes) -> FlatLayout:
        key = tuple(tuple(s) for s in shapes)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = FlatLayout.of(shapes)
        return lay

    def fetch_now(self, param: torch.Tensor) -> torch.Tensor:
        """Unscheduled fetch (only reached when a graph runs without the transfer pass)."""
        host_copies_current([param])
        return param.detach().to(self.device, self.compute_dtype, copy=True)

    def prefetch(self, region: int, host_params: list[torch.Tensor]) -> None:
        self._host_params[region] = host_params
        self._requested[region].append(host_params)
        if self._awaiting_first:
            self._first[self._phase] = (region, list(host_params))
            self._awaiting_first = False
        if self.deadlines is not None and self._phase == "forward":
            self.deadlines.learn(region)  # its deadline: when the forward fetches it
        t0 = time.perf_counter()
        self.wait_updates(host_params)
        self.stats.optimizer_wait_s += time.perf_counter() - t0
        early = self._early.pop(region, None)
        if early is not None:
            if early.holds(host_params):
                self._inflight[region].append(early)
                self.stats.early_hits += 1
                return
            # Another module's weights (dynamo reuses one graph for every layer a graph
            # break splits), or an update landed after the early fetch: fetch afresh.
            self.stats.early_misses += 1
            self._weights.discard(early)
        self._inflight[region].append(self._start_fetch(region, host_params))

    def prefetch_next(self, phase: str) -> None:
        """End of this graph's schedule: start the first fetch of the graph that ran next
        last time (same step only), if the device budget has room beside what is live."""
        nxt = graph_order.finished((self.index, phase))
        if phase == "forward":
            self._phase, self._awaiting_first = "backward", True
            self.stats.phase_starts["backward"] = time.perf_counter()
        if nxt is not None:
            get(nxt[0])._fetch_early(nxt[1], beside=self)

    def _fetch_early(self, phase: str, beside: Streamer) -> None:
        first = self._first.get(phase)
        if first is None or first[0] in self._early:
            return
        region, host_params = first
        nbytes = self.layout([p.shape for p in host_params]).numel * self.compute_dtype.itemsize
        live = self.pool.live + (beside.pool.live if beside is not self else 0)
        if live + nbytes > self.pool.budget:
            return
        self.wait_updates(host_params)
        self._early[region] = self._start_fetch(region, host_params)

    def _start_fetch(self, region: int, host_params: list[torch.Tensor]) -> Inflight:
        """Start copying ``region``'s weights into a fresh buffer (weight_fetch.py), once
        the gradient side knows the slab bytes the region's gradients will take."""
        lay = self.layout([p.shape for p in host_params])
        # This region's gradients come back in the transfer dtype (fp32 on the CPU path).
        grad_size = (self.grad_transfer_dtype or self.compute_dtype).itemsize if self.cuda else 4
        self._handoff.reserve(region, lay.numel * grad_size + 64 * len(host_params))
        # No weight shadow for regions updated on the device: each copy back would leave
        # the shadow stale, so it would only cost memory.
        updated_here = self.device_updates is not None and region in self.device_updates.regions
        return self._weights.start(region, host_params, lay, self.resident,
                                   shadow=self.weight_shadow and not updated_here)

    def wait(self, region: int, numel: int) -> torch.Tensor:
        queue = self._inflight[region]
        claimed = self._claimed.pop(region, None)
        if claimed is not None:  # the forward's buffer (claim): same master, same bits
            assert claimed.numel() == numel, (claimed.numel(), numel)
            if self.cuda:  # the region's compute starts now (stats.computes)
                now = torch.cuda.Event(enable_timing=True)
                now.record(torch.cuda.current_stream(self.device))
                self._computing[region] = now
            return claimed
        if not queue:
            raise RuntimeError(f"megatrain: wait for region {region} without a prefetch (schedule bug)")
        entry = queue.popleft()
        entry.check(self.region_names.get(region, f"region {region}"), self._requested[region].popleft())
        assert entry.flat.numel() == numel, (entry.flat.numel(), numel)
        if self.cuda:
            done = entry.done
            if isinstance(done, concurrent.futures.Future):  # the host cast thread's
                t0 = time.perf_counter()
                done = done.result()
                self.stats.cast_wait_s += time.perf_counter() - t0
            stream = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(done)
            after.record(stream)
            self.stats.waits.append((region, before, after))
            self._computing[region] = after
        if config.check_fetched_weights and not entry.from_device_masters:
            entry.compare_with_masters(self.region_names.get(region, region),
                                       self.layout([p.shape for p in entry.params]), self.compute_dtype)
        return entry.flat

    def evict(self, region: int, flat: torch.Tensor) -> None:
        self._release(flat)
        self._note_compute_end(region)

    def _release(self, flat: torch.Tensor) -> None:
        """A weight buffer's bytes go back to the budget (evicted, or a kept one unused)."""
        self.pool.release(flat.numel() * flat.element_size())

    def keep(self, region: int, flat: torch.Tensor) -> None:
        """The forward is done with `flat`; the plan keeps it for the region's backward,
        which claims it (its bytes stay counted until that backward's evict)."""
        self._kept[region] = (flat, self._host_params[region])
        self._note_compute_end(region)

    def claim(self, region: int, host_params: list[torch.Tensor]) -> None:
        """The backward of a region the plan keeps, in place of its prefetch: take the
        forward's buffer if it holds these very parameters; else fetch them now. Else
        happens when dynamo runs one graph for several modules (a graph break inside a
        layer loop: every layer's forward runs before the backwards, and each forward
        gives back the previous one's kept buffer), and the plan's memory is then that of
        fetching twice, which it also fits."""
        kept = self._kept.pop(region, None)
        if kept is not None and len(kept[1]) == len(host_params) \
                and all(a is b for a, b in zip(kept[1], host_params)):
            self._claimed[region] = kept[0]
            self.stats.kept_hits += 1
            early = self._early.pop(region, None)  # fetched ahead when a fallback went first
            if early is not None:
                self._weights.discard(early)
            return
        if kept is not None:  # another module's weights
            self._release(kept[0])
        self.prefetch(region, host_params)

    def _note_compute_end(self, region: int) -> None:
        started = self._computing.pop(region, None)
        if started is not None:  # the region's compute: from its weights' arrival to here
            evicted = torch.cuda.Event(enable_timing=True)
            evicted.record(torch.cuda.current_stream(self.device))
            self.stats.computes.append((region, started, evicted))

    def wait_updates(self, host_params: list[torch.Tensor]) -> None:
        """A region is never fetched before its pending update (from the last step) is done."""
        for opt, ps in by_owner(host_params):
            opt.wait_params(ps)
        if self.device_updates is not None:
            self.device_updates.retire()

    # -- gradients out ---------------------------------------------------------------
    def _expect_gradients(self, per_param: dict[int, int], per_region: dict[int, int]) -> None:
        """How many gradient contributions one backward sends, per parameter and per region
        (a tied weight sends one per region that fetched it)."""
        self._handoff.expect(per_param, per_region)
        for pid in per_param:
            handoff_graphs.note(self.params[pid], self.index)

    def _enable_backlog(self, where: str, handoffs: list[tuple[int, int]]) -> None:
        """Hand sealed regions to the host optimizer earliest deadline first and defer
        those left at the end of backward into the next forward (deadlines.py); with
        ``where="device"`` also keep gradients that find no free slab on the device,
        within the reserve of _place_updates (grad_backlog.py). ``handoffs``: the
        backward's (region, param id) hand-offs; there, regions holding part of a tied
        weight's gradient stay on the slab path."""
        assert where in ("host", "device"), where
        self.deadlines = Deadlines()
        if where == "device":
            assert self.reserve is not None, "_place_updates first"
            counts = collections.Counter(p for _, p in handoffs)
            tied = {r for r, p in handoffs if counts[p] > 1}
            self.backlog = GradBacklog(self.device, self.reserve, tied, self.deadlines)
        self._handoff.use_backlog(self.deadlines, self.backlog)
        self._route_gradients()

    def _enable_grad_ring(self, chunk_bytes: int, chunks: int = GRAD_RING_CHUNKS) -> None:
        """Send untied gradients to their optimizer through a ring of fixed-size host chunks
        instead of region slabs (grad_ring.py): host memory for gradients becomes
        ``chunks x chunk_bytes`` whatever the largest region."""
        assert self.deadlines is None, "the backlog hands over whole regions: slabs only"
        if self._ring is None:
            self._ring = GradRing(chunk_bytes, chunks, pin=self.cuda)
            self._route_gradients()

    def _route_gradients(self) -> None:
        """The ways out grad_to_optimizer offers a gradient, in order (grad_routes.py),
        from what is placed and enabled now; host slabs, last, take any gradient."""
        handoff, routes = self._handoff, []
        if self.resident is not None:
            routes.append(ResidentRoute(self.resident, handoff))
        if self.device_updates is not None:
            routes.append(DeviceUpdateRoute(self.device_updates, self.params))
        if self._ring is not None:
            routes.append(RingRoute(self._ctx, self._ring, handoff, self._snapshots))
        if self.backlog is not None:
            routes.append(BacklogRoute(self._ctx, self.backlog, self._slabs, handoff))
        routes.append(SlabRoute(self._ctx, self._slabs, handoff, self._snapshots))
        self._routes = routes

    def grad_to_optimizer(self, grad: torch.Tensor, region: int, param_id: int,
                          param: torch.Tensor) -> None:
        """Hand `grad`, the gradient of `param` (graph slot `param_id`: the same graph may
        run for several modules, each with its own parameters), to `param`'s optimizer, by
        the first route that takes it."""
        dtype = grad.dtype if grad.device.type == "cpu" else self.grad_transfer_dtype or grad.dtype
        for route in self._routes:
            if route.take(grad, region, param_id, param, dtype):
                return

    def grad_to_host(self, grad: torch.Tensor, param_id: int) -> torch.Tensor:
        """The host gradient of graph slot `param_id` for `p.grad` (host_grads.py)."""
        return self._host_grads.send(grad, self.params[param_id], param_id)

    def drain(self) -> None:
        """Block until every gradient of this backward is on the host (in the parameter's
        dtype) or handed to its optimizer, so `opt.step()` sees all of them. With the
        backlog, regions not handed over yet are deferred instead (AdamW.defer) where every
        optimizer concerned agrees: then step() has nothing to wait for."""
        for route in self._routes:
            route.flush()  # the ring's last, partly filled chunk
        self.stats.phase_starts["drained"] = time.perf_counter()
        if self.deadlines is None or not self._handoff.defer_rest():
            self._handoff.wait_handoffs()
        self._host_grads.finish()
        if self.cuda and not self._autotune_pins_released:
            self._autotune_pins_released = True  # the first backward's autotuning is over
            release_cached_pinned_blocks(self.device)
        self.end_step()
