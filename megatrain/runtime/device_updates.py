"""The streamer's side of device-site updates: gradients kept on the device, one
``AdamW.submit_on_device`` per region, their device bytes counted.

For a region the plan put on the device (megatrain.compiler.update_sites):

    first gradient of the backward: ask the owner ``device_update_blocker(params)``; no
        objection and the bytes fit the reserve -> acquire them in the streamer's pool,
        allocate one fp32 buffer laid out like the region; else the host path, this step
    each gradient: copy it into its view, on the compute stream (no device-to-host copy).
        Copy, not keep: Inductor hands the gradient's memory to the next kernel right after
        the hand-off (``buf61 = buf57; del buf57  # reuse``), so holding the tensor would
        let later compute overwrite it while the update is queued. fp32, not the compute
        dtype: the upcast is exact and the update then needs no upcast buffer of its own.
    last gradient: ``opt.submit_on_device(params, views, device, copy_streams=(the
        streamer's H2D, D2H streams))``; the readiness event is recorded on the compute
        stream right after the last copy. The optimizer tracks the handle, so the next
        fetch of these parameters (``Streamer.wait_updates`` -> ``AdamW.wait_params``)
        waits for the copy back; the bytes return to the pool once the handle resolves.

The reserve is the device memory the plan leaves free (a ``pool.Reserve``, shared with the
gradient backlog of grad_backlog.py); updates in flight never exceed it:
when the next one would not fit, the oldest ones are waited for (see update_sites.py for
why the runtime waits rather than changing the site). The host path is taken only where the
optimizer objects (``device_update_blocker``: clipping, the non-finite check, a micro-batch
other than the last, an optimizer that is not plain megatrain.AdamW), the parameters have
no single owning optimizer, or one of them gets gradients from several graphs (a weight tied
across a graph break, handoff_graphs.py: its contributions are summed on the host).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from ..optim import device_update
from ..optim.registry import sole_owner
from . import handoff_graphs
from ..memory.layout import FlatLayout
from ..memory.pool import DevicePool, Reserve


@dataclass
class _Gathering:
    """One region's gradients of this backward, gathered on the device (``views`` None:
    this backward takes the host path for the region)."""

    opt: object = None
    views: list | None = None
    nbytes: int = 0
    seen: int = 0


class DeviceUpdates:
    """Per streamer: the device-site regions, their gathering this backward, the updates
    in flight with the pool bytes they hold."""

    def __init__(self, device: torch.device, pool: DevicePool, params: list, copy_streams,
                 regions: dict[int, list[int]], reserve: int | Reserve):
        self.device = device
        self.pool = pool
        self.params = params
        self.copy_streams = copy_streams  # (h2d, d2h) CUDA streams; None on the CPU
        self.regions = {r: list(pids) for r, pids in regions.items()}
        self.reserve = reserve if isinstance(reserve, Reserve) else Reserve(pool, reserve)
        self.launched = 0  # device updates submitted, for tests and benchmarks
        self._index = {r: {p: i for i, p in enumerate(pids)} for r, pids in self.regions.items()}
        self._gathering: dict[int, _Gathering] = {}
        self._inflight: collections.deque = collections.deque()  # (handle, bytes)

    def take(self, grad: torch.Tensor, region: int, param_id: int) -> bool:
        """Keep ``grad`` for the region's device update (True), or leave it to the host
        path (False). Launches the update with the region's last gradient."""
        pids = self.regions.get(region)
        if pids is None:
            return False
        g = self._gathering.get(region)
        if g is None:
            g = self._gathering[region] = self._begin(region, pids)
        g.seen += 1
        if g.views is not None:
            g.views[self._index[region][param_id]].copy_(grad)
        if g.seen == len(pids):
            del self._gathering[region]
            if g.views is not None:
                self._launch(g, pids)
        return g.views is not None

    def forget(self, regions) -> None:
        """Leave ``regions`` to another path from the next backward on (resident state)."""
        for r in regions:
            self.regions.pop(r, None)
            self._index.pop(r, None)

    def retire(self) -> None:
        """Return the pool bytes of updates whose copy back has completed (their errors
        surface from the optimizer: wait_params, step)."""
        while self._inflight and self._inflight[0][0].done():
            self._release(self._inflight.popleft()[1])

    def prepare(self) -> None:
        """Create and page-lock the AdamW state of every device region whose optimizer
        would take it now (CUDA: locking takes seconds per 4 GiB), not inside the first
        backward."""
        for pids in self.regions.values():
            params = [self.params[p] for p in pids]
            opt = _willing_owner(params)
            if opt is not None:
                opt.prepare_device_update(params, self.device)

    def abandon(self) -> None:
        """Forget gatherings a failed backward left unfinished (a new step begins)."""
        for g in self._gathering.values():
            if g.views is not None:
                self._release(g.nbytes)
        self._gathering.clear()

    def _begin(self, region: int, pids: list[int]) -> _Gathering:
        """The first gradient of a region this backward: the device path if its optimizer
        allows it now, with its bytes acquired and its fp32 buffer allocated."""
        params = [self.params[p] for p in pids]
        opt = _willing_owner(params)
        if opt is None or any(map(handoff_graphs.several, params)):
            return _Gathering()  # several graphs' gradients of one weight: summed on the host
        nbytes = device_update.held_bytes([p.shape for p in params])
        what = f"device update of region {region}"
        if not self._make_room(nbytes) or not self.reserve.try_acquire(nbytes, what):
            return _Gathering()
        layout = FlatLayout.of([p.shape for p in params])
        flat = torch.empty(layout.numel, dtype=torch.float32, device=self.device)
        return _Gathering(opt, layout.views(flat), nbytes)

    def _make_room(self, nbytes: int) -> bool:
        """Wait for the oldest updates until ``nbytes`` more fit both the reserve and the
        pool; False only if they cannot fit even with nothing in flight (the pool holds
        more than the plan accounts for, e.g. a fetch started early for the next graph)."""
        self.retire()
        while self._inflight and not self.reserve.fits(nbytes):
            handle, held = self._inflight.popleft()
            handle.exception()  # waits; an error surfaces from the optimizer
            self._release(held)
        return self.reserve.fits(nbytes)

    def _launch(self, g: _Gathering, pids: list[int]) -> None:
        """Submit the gathered region; its bytes stay held until the handle resolves
        (copied back), or return at once if the optimizer refuses the call."""
        params = [self.params[p] for p in pids]
        try:
            handle = g.opt.submit_on_device(params, g.views, self.device, self.copy_streams)
        except BaseException:
            self._release(g.nbytes)
            raise
        self._inflight.append((handle, g.nbytes))
        self.launched += 1

    def _release(self, nbytes: int) -> None:
        self.reserve.release(nbytes)


def _willing_owner(params: list):
    """The one optimizer owning all of ``params`` if it would update them on the device
    now (``device_update_blocker``), else None: several owners, none left, one that
    objects or one without device updates."""
    opt = sole_owner(params)
    if opt is None or opt.device_update_blocker(params) is not None:
        return None
    return opt
