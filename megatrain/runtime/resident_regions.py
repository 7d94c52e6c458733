"""The streamer's side of resident regions: AdamW state kept on the device between steps
(``updates="resident"``; the optimizer's side is megatrain.optim.resident).

For a region the plan made resident (megatrain.compiler.update_sites):

    placement: its bytes (``resident.resident_bytes``: 12 per parameter) are acquired in
        the streamer's reserve, the memory the plan leaves free, for good; one fp32 upcast
        scratch beside them, as large as the largest such parameter but at most
        ``resident.UPCAST_PIECE`` elements (64 MiB; ``resident.upcast_scratch_numel``): a
        larger one is upcast and updated piece by piece, so the scratch does not grow with
        the largest parameter (a 3B model's embedding would need 0.37 GiB, which can be
        enough to keep that embedding off the device). Candidates that do not fit keep
        their other site until the reserve grows (``Streamer.grow_reserve``, from the
        second step's measured peak); ``acquire`` then admits them in the same order.
    fetch: the first one adopts the region (``AdamW.make_resident``: master, m, v copied to
        the device once); every fetch then casts the device master into the plan's weight
        buffer on the copy stream, after the region's last update (its event): no PCIe, no
        host memory.
    sharing: regions holding one parameter (a tied embedding's first and last) are
        acquired and demoted together, its state counted once (``resident.sharing_groups``,
        ``resident.group_bytes``); its gradient's pieces but the last wait in a lent
        buffer, summed as the host path sums them in a slab, and the last one updates.
    hand-off of each gradient: ``AdamW.update_resident`` with the scratch, which upcasts
        it there piece by piece, each piece's update right after its upcast, on the
        compute stream, in stream order: the gradient's memory, which Inductor reuses
        right after the hand-off, has been read before anything can overwrite it, so the
        region needs no gradient buffer and no copy. Where the update must wait
        (micro-batches, clipping, the non-finite check) the optimizer asks for one: an
        fp32 buffer laid out like the region, from the reserve, kept for good.
    demotion: where the optimizer refuses (a subclass, several owners, a gradient left in
        ``p.grad``, no room for the buffer), or a measured step went over gpu_memory
        (``Streamer.shrink_reserve``), the region leaves the device for good
        (``AdamW.drop_resident``: newest values flushed to the host), its bytes go back to
        the reserve and the host path takes over, bitwise where it continues on the CPU.

Only one compiled graph holds resident regions at a time: their bytes outlive the graph's
step, and another graph's plan does not count them. A graph placing resident regions
therefore demotes every other streamer's (see ``Streamer._place_updates``).
"""

from __future__ import annotations

import torch

from ..optim import resident as resident_mod
from ..optim.registry import owner_of, sole_owner
from . import handoff_graphs
from ..memory.layout import FlatLayout
from ..memory.pool import Reserve


_TIED = ("a parameter's gradient comes from several graphs (a weight tied across a graph "
         "break): summed in p.grad on the host")


class ResidentRegions:
    """Per streamer: the resident regions, the reserve bytes each holds, the upcast
    scratch, and the fetch sources and updates through their optimizer."""

    def __init__(self, device: torch.device, params: list, candidates: dict[int, list[int]],
                 reserve: Reserve):
        self.device = device
        self.params = params
        self.reserve = reserve
        self.candidates = {r: list(pids) for r, pids in candidates.items()}  # in acquiring order
        self.groups = resident_mod.sharing_groups(self.candidates)  # region -> the regions it shares a parameter with
        self.regions: dict[int, list[int]] = {}
        self.held: dict[int, int] = {}  # region -> reserve bytes its state holds
        self.buffered: dict[int, int] = {}  # region -> reserve bytes of its gradient buffer
        self.updates = 0  # resident updates run, for tests and benchmarks
        self.demoted: dict[int, str] = {}  # region -> why it left the device
        self._scratch_bytes = 4 * resident_mod.upcast_scratch_numel(
            params[p].numel() for pids in candidates.values() for p in pids)
        self._scratch_held = False
        self._scratch: torch.Tensor | None = None
        self.acquire()

    def acquire(self, keep_free: int = 0) -> None:
        """Make resident, in order, every candidate region whose bytes fit the reserve
        with ``keep_free`` bytes of it left over (skipping those that do not fit, as
        update_sites.resident_sites does at compile time, which this reproduces there);
        the upcast scratch first. Called at placement, and again when the reserve grows."""
        if not self._scratch_held:
            if not self.reserve.fits(self._scratch_bytes + keep_free) or not self.reserve.try_acquire(
                    self._scratch_bytes, "resident upcast scratch"):
                return
            self._scratch_held = True
        for region in self.candidates:
            group = self.groups[region]
            if any(r in self.regions or r in self.demoted for r in group):
                continue
            # the buffers the first pieces of a shared gradient wait in are booked now, so
            # that regions admitted after these cannot take their room (_lend_buffers)
            nbytes, waiting = resident_mod.group_bytes({r: self.candidates[r] for r in group}, self.params)
            total = nbytes + sum(waiting.values())
            if self.reserve.fits(total + keep_free) and self.reserve.try_acquire(
                    total, f"resident state of region(s) {sorted(group)}"):
                for r in sorted(group):
                    self.regions[r], self.held[r] = list(self.candidates[r]), 0
                self.held[min(group)] = nbytes
                self.buffered.update(waiting)
        if not self.regions:
            self._free_scratch()

    def sources(self, region: int, host_params: list) -> list | None:
        """The device fp32 masters to fetch ``host_params`` (all of ``region``'s, or some:
        a backward fetches only the weights it reads) from, with the events to wait for;
        None: fetch from the host (the caller makes the host copies current first)."""
        pids = self.regions.get(region)
        if pids is None:
            return None
        params = [self.params[i] for i in pids]
        if not {id(p) for p in host_params} <= {id(p) for p in params}:
            return None  # another module's parameters (a graph dynamo runs for several)
        opt = _owner(params)
        if opt is None:
            self.demote(region, "the parameters have no single megatrain.AdamW owner")
            return None
        if any(handoff_graphs.several(p) for p in params):
            self.demote(region, _TIED)
            return None
        if not all(opt.is_resident(p) for p in params):
            reason = opt.make_resident(params, self.device)
            if reason is not None:
                self.demote(region, reason)
                return None
        return [(opt.resident_master(p), opt.resident_ready(p)) for p in host_params]

    def take(self, grad: torch.Tensor, region: int, param: torch.Tensor, last_piece: bool = True) -> bool:
        """Update ``param`` from ``grad`` on the device now (True), or leave the gradient to
        the host path (False: the region is not resident, or no longer). ``last_piece``
        False: more of ``param``'s gradient comes this backward (a tied weight, one piece
        per region that read it): summed into a lent buffer until the last."""
        if region not in self.regions:
            return False
        if handoff_graphs.several(param):
            self.demote(region, _TIED)
            return False
        opt = owner_of(param)
        if opt is None or not opt.is_resident(param):
            return False  # not adopted yet, or a host path took it home: the host path
        in_place = grad.dtype == torch.float32 and grad.is_contiguous()  # else upcast
        scratch = None if in_place else self._upcast_scratch()
        declined = opt.update_resident([param], [grad], scratch, last_piece)
        if declined is not None and declined.needs_buffers and self._lend_buffers(region, opt):
            declined = opt.update_resident([param], [grad], scratch, last_piece)
        if declined is not None:
            self.demote(region, declined.reason)
            return False
        self.updates += 1
        return True

    def _lend_buffers(self, region: int, opt) -> bool:
        """The region's gradients must wait on the device (micro-batches, clipping, the
        non-finite check): one fp32 buffer laid out like the region, from the reserve, for
        good (like the host optimizer's recycled gradient buffers). False: no room."""
        params = [self.params[p] for p in self.regions[region]]
        layout = FlatLayout.of([p.shape for p in params])
        nbytes = 4 * layout.numel
        # The bytes booked for it at admission (a region holding a shared parameter), or
        # of a buffer lent before that went with the state (synchronize() brings it home).
        self.reserve.release(self.buffered.pop(region, 0))
        if not self.reserve.try_acquire(nbytes, f"resident gradient buffer of region {region}"):
            return False
        self.buffered[region] = nbytes
        flat = torch.empty(layout.numel, dtype=torch.float32, device=self.device)
        opt.give_resident_buffers(params, layout.views(flat))
        return True

    @property
    def held_bytes(self) -> int:
        """Reserve bytes held for good: the regions' state and the scratch."""
        return (sum(self.held.values()) + sum(self.buffered.values())
                + (self._scratch_bytes if self._scratch_held else 0))

    def demote(self, region: int, reason: str) -> None:
        """The region leaves the device for good, with the regions it shares a parameter
        with: newest values to the host (a piece of a tied gradient waiting on the device
        becomes its p.grad, where the host path adds the rest), bytes back."""
        for r in sorted(self.groups.get(region, {region})):
            pids = self.regions.pop(r, None)
            if pids is None:
                continue
            self.demoted[r] = reason
            params = [self.params[p] for p in pids]
            for opt in {id(o): o for o in map(owner_of, params) if o is not None}.values():
                opt.drop_resident(params)  # each brings home the ones it holds
            self.reserve.release(self.held.pop(r) + self.buffered.pop(r, 0))
        if not self.regions:
            self._free_scratch()

    def demote_all(self, reason: str) -> None:
        """Every region home, none to come (another graph holds the device's now)."""
        for region in list(self.regions):
            self.demote(region, reason)
        for region in self.candidates:
            self.demoted.setdefault(region, reason)

    def _upcast_scratch(self) -> torch.Tensor:
        """The fp32 scratch gradients not in fp32 (or not contiguous) are upcast into,
        piece by piece (reused in stream order); allocated at its first use."""
        if self._scratch is None:
            self._scratch = torch.empty(self._scratch_bytes // 4, dtype=torch.float32, device=self.device)
        return self._scratch

    def _free_scratch(self) -> None:
        if self._scratch_held:
            if self._scratch is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # queued updates may still read it
            self._scratch = None
            self.reserve.release(self._scratch_bytes)
            self._scratch_held = False


def _owner(params: list):
    """The one optimizer owning all of ``params``, which can keep their state on the
    device; None where they have several owners or none."""
    return sole_owner(params)
