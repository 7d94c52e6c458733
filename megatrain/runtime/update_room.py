"""The device memory the plan leaves free, and the AdamW updates placed in it that skip the
host: device-site updates (device_updates.py) and resident regions (resident_regions.py).

The compiler sizes the reserve (``gpu_memory`` - the plan's peak - staging) and picks the
sites (compiler/update_sites.py); `UpdateRoom.place` makes them real. With resident
regions the reserve then follows measured steps, because the plan's peak is a proof, not
a measurement: it grows once to what a whole measured step left free (`grow`), and shrinks
whenever a measured step went over ``gpu_memory`` (`shrink`). The streamer decides which
steps are whole and measured (streamer.py: begin_step, end_step).
"""

from __future__ import annotations

import warnings

import torch

from ..errors import format_bytes
from ..memory import allocator
from ..memory.pool import Reserve
from ..optim import device_update
from .device_updates import DeviceUpdates
from .resident_regions import ResidentRegions
from .stream_context import StreamContext

# updates="resident": after this many whole steps of the graph alone were measured (the
# first one adopts and autotunes) the reserve may grow to what the last one left free, less
# this fraction of gpu_memory (UpdateRoom.grow); from then on a measured step over
# gpu_memory shrinks it to peak this fraction below (UpdateRoom.shrink).
MEASURED_STEP = 2
RESERVE_MARGIN = 1 / 16


class UpdateRoom:
    """Per streamer: the reserve, the regions updated on the device and those resident
    (each None until `place`), and what measured steps said about the reserve."""

    def __init__(self, ctx: StreamContext):
        self._ctx = ctx
        self.pool = ctx.pool
        self.params: list = []
        self.reserve: Reserve | None = None  # what the plan leaves free (place)
        self.device_updates: DeviceUpdates | None = None  # regions whose AdamW runs here
        self.resident: ResidentRegions | None = None  # regions whose AdamW state lives here
        self._measured_steps = 0
        self._overran: int | None = None  # a measured peak over gpu_memory (shrink)
        self._overrun_warned = False

    def place(self, params: list, regions: dict[int, list[int]], reserve: int,
              resident: dict[int, list[int]] | None = None) -> None:
        """Run the AdamW update of ``regions`` (region -> its parameter ids) on the device,
        their buffers in flight held within ``reserve`` bytes beside the plan; keep the
        AdamW state of ``resident`` regions on the device for good, their bytes taken from
        the reserve first. ``params``: the graph's parameters, by slot."""
        ctx = self._ctx
        streams = (ctx.h2d_stream, ctx.d2h_stream) if ctx.cuda else None
        self.params = params
        self.reserve = Reserve(self.pool, reserve)
        if resident:
            self.resident = ResidentRegions(ctx.device, params, resident, self.reserve)
        self.device_updates = (DeviceUpdates(ctx.device, self.pool, params, streams, regions,
                                             self.reserve) if regions else None)

    def measured(self, peak: int) -> None:
        """A whole step of this graph alone peaked at ``peak`` bytes allocated on the
        device (called before the next step resets the allocator's marks): the second one
        grows the reserve, up to `_growth_peak`; from then on one over gpu_memory makes the
        next step begin by shrinking it (`shed_overrun`). Only with resident regions."""
        if self.resident is None:
            return
        self._measured_steps += 1
        if self._measured_steps >= MEASURED_STEP and peak > self.pool.budget:
            self._overran = peak  # the next step begins by sending regions home
        elif self._measured_steps == MEASURED_STEP:
            self.grow(self._growth_peak(peak))

    def _growth_peak(self, allocated_peak: int) -> int:
        """The step's peak that resident growth may fill up to: the allocator's allocated
        peak where segments are expandable, else its reserved peak, which counts the
        fragmentation that fixed segments leave (memory/allocator.py). An overrun is judged
        by allocated bytes alone: cached blocks would send regions home step after step."""
        if not self._ctx.cuda or allocator.expandable_segments():
            return allocated_peak
        return max(allocated_peak, torch.cuda.max_memory_reserved(self._ctx.device))

    def shed_overrun(self) -> None:
        """Between steps (no update of this graph is pending): shrink for an overrun."""
        if self._overran is not None:
            self.shrink(self._overran)
            self._overran = None

    def grow(self, measured_peak: int) -> None:
        """Lend resident regions what a measured step left free beyond the plan's proof.

        Why: the plan's peak is an upper bound, and a loose one where Inductor fuses what
        the planner's walk counts as separate tensors: at a long sequence it counts three
        fp32 [tokens, vocab] tensors in the loss's backward that Inductor never makes, a
        large share of a tight budget. Static shapes repeat the
        same step, so the second whole step's allocator peak (``measured_peak``: every
        byte allocated on the device at the step's high-water mark, whoever holds it; the
        first step also adopts resident state and autotunes) is what later steps need,
        device updates and backlog in flight included. The reserve grows here, once, to
        ``gpu_memory - (measured_peak - resident bytes held) - gpu_memory/16``; more
        candidate regions become resident, keeping room for one device-site update. Where
        the plan counts short instead, shrink gives room back."""
        if self.reserve is None or self.resident is None:
            return
        margin = int(self.pool.budget * RESERVE_MARGIN)
        total = self.pool.budget - (measured_peak - self.resident.held_bytes) - margin
        if total <= self.reserve.nbytes:
            return
        self.reserve.nbytes = total
        keep_free = 0
        if self.device_updates is not None:
            keep_free = max((device_update.held_bytes([self.params[p].shape for p in pids])
                             for r, pids in self.device_updates.regions.items()
                             if r not in self.resident.regions), default=0)
        self.resident.acquire(keep_free)
        if self.device_updates is not None:
            self.device_updates.forget(list(self.resident.regions))

    def shrink(self, measured_peak: int) -> None:
        """A measured step went over gpu_memory: the plan's peak, which the reserve was
        sized against, counted short (with the fused loss, a long sequence's allocator
        peak can go past the budget).
        The excess is what the step must shed to peak ``gpu_memory/16`` below the budget
        (the margin grow keeps): resident regions go home, the last admitted
        first, until their bytes cover it, and the reserve shrinks by the excess, so
        neither they nor other holders take the room again. Where the resident state
        cannot cover it, it warns once: the rest is the plan's, which a smaller
        gpu_memory (a leaner schedule) fixes."""
        if self.reserve is None or self.resident is None:
            return
        budget = self.pool.budget
        excess = measured_peak - (budget - int(budget * RESERVE_MARGIN))
        why = (f"a measured step peaked at {measured_peak} bytes ({format_bytes(measured_peak)}), "
               f"over gpu_memory={budget} bytes ({format_bytes(budget)})")
        held = self.reserve.live
        for region in reversed(list(self.resident.regions)):
            if held - self.reserve.live >= excess:
                break
            self.resident.demote(region, why)
        self.reserve.nbytes = max(self.reserve.live, self.reserve.nbytes - excess)
        short = excess - (held - self.reserve.live)
        if short > 0 and not self._overrun_warned:
            self._overrun_warned = True
            warnings.warn(
                f"megatrain: {why}, and no resident state is left to give back the other {short} "
                f"bytes ({format_bytes(short)}): this graph peaks higher than its plan predicts; pass "
                f"a gpu_memory about {short} bytes smaller to keep the device within {budget} bytes",
                RuntimeWarning, stacklevel=2)
