"""The device side of megatrain.AdamW: updates run on the compute device, and state kept
there between steps.

Two planner choices put a region's AdamW work on the device instead of the host worker;
both are asked for by the runtime per region, and both are refused (with a reason, so the
runtime takes the host path) where the region's update cannot run when its gradient
arrives or the state is not AdamW's own (``_params_blocker``):

- Device-site update (``submit_on_device``, optim/device_update.py): master, m and v
  cross the link, the same kernel updates them there, and they come back; the handle is
  tracked by the host worker, so waiting for it is waiting for a host update.
- Resident state (``make_resident`` ... ``drop_resident``, compile option
  ``updates="resident"``, optim/resident.py): master, m and v stay on the device and are
  updated there in stream order. The optimizer's :class:`ResidentState` keeps the device
  copies; this mixin decides when an update may run there, when its gradient must wait in
  a lent device buffer for ``step()`` (``_apply_on_device``), and brings state home
  whenever a host path is about to touch it (``_leave_device``).

Why a mixin: these are AdamW's public methods (the GradientConsumer protocol,
optim/protocol.py), and they read the same flags (``accumulate()``, clipping, the
non-finite check) and per-step bookkeeping as ``submit`` does, set in ``AdamW._setup``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from megatrain.optim import device_update, functional
from megatrain.optim.engine import HostWorker
from megatrain.optim.protocol import Declined
from megatrain.optim.resident import ResidentState

# update_resident's answer when the gradients must wait on the device and have no buffer yet.
NEEDS_BUFFERS = Declined("resident gradients must wait on the device: lend them buffers",
                         needs_buffers=True)


class DeviceSide:
    """Mixed into megatrain.AdamW (see the module docstring). Besides the attributes below
    it uses AdamW's ``wait_params``, ``_describe``, ``_hyper``, ``_split_by_group``,
    ``_has_grad`` and ``_hands_in_its_own_way``."""

    param_groups: list[dict[str, Any]]
    state: Any
    max_grad_norm: float | None
    skip_nonfinite: bool
    _accumulating: int
    _worker: HostWorker
    _where: dict[Tensor, tuple[int, int]]
    _final: dict[Tensor, bool]
    _device_updates: device_update.DeviceUpdater | None
    _resident: ResidentState

    # ---- updates on the compute device (optim/device_update.py) ----------------------

    def submit_on_device(
        self,
        params: Sequence[Tensor],
        device_grads: Sequence[Tensor],
        device: torch.device | str,
        copy_streams: Sequence[Any] | None = None,
        *,
        ready: Any = None,
    ) -> device_update.DeviceUpdateHandle:
        """Apply one region's final gradients, which are on ``device``, by running its AdamW
        step there: master, m and v are copied in (``copy_streams`` = (H2D, D2H) CUDA
        streams, default the optimizer's own), updated by the same fused kernel with the
        group's hyperparameters read now, and copied back. ``ready``: a CUDA event after
        which the gradients are complete (default: recorded now on the current stream).

        Returns a handle (a Future) resolved once master, m and v are back in host memory;
        until then they must not be read or written, and ``wait_params``, ``step()``,
        ``synchronize()`` and ``state_dict()`` wait for it. The gradients are kept alive
        by the handle until the kernel has read them; do not write them meanwhile.
        Refused (ValueError, saying why) where :meth:`device_update_blocker` says so."""
        params, grads = list(params), list(device_grads)
        dev = device_update.resolve_device(device)
        device_update.check_region(params, grads, dev, self._where.__contains__, self._describe)
        reason = self.device_update_blocker(params)
        if reason is not None:
            raise ValueError(f"submit_on_device(): {reason}")
        self._leave_device(params)
        by_group: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            by_group.setdefault(self._where[p][0], []).append(i)
        groups = [(idx, self._hyper(self.param_groups[gi])) for gi, idx in by_group.items()]
        if self._device_updates is None:
            self._device_updates = device_update.DeviceUpdater()
        handle = self._device_updates.launch(
            self.state, params, grads, groups, dev, copy_streams, ready
        )
        for p in params:
            self._final[p] = True
        self._worker.track(handle, params)
        return handle

    def device_update_blocker(self, params: Iterable[Tensor] = ()) -> str | None:
        """Why ``submit_on_device(params, ...)`` would be refused now, or None. Waits for
        queued host work on ``params`` first (their ``p.grad`` may still be filling). The
        runtime asks before it leaves a region's gradients on the device; when refused it
        takes the host path (copy them out, ``submit``)."""
        if self._hands_in_its_own_way():
            return (
                f"{type(self).__name__} hands gradients to its state its own way (e.g. "
                "ShardedAdamW reduces them across ranks into shards); the device update "
                "knows megatrain.AdamW's state only: use submit()"
            )
        if self._accumulating:
            return (
                "inside accumulate() a gradient is not the last micro-batch's: it is summed "
                "into p.grad on the host and applied by step(); use submit()"
            )
        if self.max_grad_norm is not None:
            return (
                "max_grad_norm is set: the update needs the global gradient norm, known only "
                "after the whole backward, so it cannot run when this region's gradient "
                "arrives (the gradients would have to stay on the device until step()); "
                "use submit()"
            )
        if self.skip_nonfinite:
            return (
                "skip_nonfinite is set: whether this step runs at all is known only after "
                "every gradient was checked, so the update cannot run when this region's "
                "gradient arrives; use submit()"
            )
        return self._params_blocker(list(params), final=True)

    def _params_blocker(self, params: list[Tensor], final: bool) -> str | None:
        """Why ``params`` cannot take a device-side path (device update, resident state)
        now, or None; waits for queued host work on them first (``p.grad`` may be filling).
        ``final``: their last gradient of this step is what comes next."""
        self.wait_params(params)
        for p in params:
            if p not in self._where:
                what = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
                return f"a parameter ({what}) is not managed by this optimizer"
            if final and p in self._final:
                return (
                    f"{self._describe(p)} already received its last gradient for this step; "
                    "call opt.step() between steps"
                )
            if self._has_grad(p):
                return (
                    f"{self._describe(p)} has a gradient on the host (in p.grad: micro-"
                    "batches summed under accumulate(), or autograd's; or held for step()) "
                    "that the device update would ignore; use submit(), or zero_grad() first"
                )
        return None

    def prepare_device_update(self, params: Iterable[Tensor], device: torch.device | str) -> None:
        """Create the AdamW state of ``params`` (zeros, step 0) and, for CUDA, page-lock it
        now rather than at their first ``submit_on_device`` (locking takes ~2-3 s per 4 GiB;
        call this while planning)."""
        dev = device_update.resolve_device(device)
        params = list(params)
        for p in params:
            if not isinstance(p, Tensor) or p not in self._where:
                raise ValueError(
                    "prepare_device_update(): a parameter is not managed by this optimizer"
                )
        self.wait_params(params)
        device_update.ensure_state(self.state, params, pin=dev.type == "cuda")

    # ---- state kept on the compute device (updates="resident"; optim/resident.py) ----

    def make_resident(self, params: Sequence[Tensor], device: torch.device | str) -> str | None:
        """Keep the master, m and v of ``params`` on ``device`` from now on: their updates
        (:meth:`update_resident`) and the runtime's weight fetches (:meth:`resident_master`)
        touch no host memory. Returns why not (None: done)."""
        params = list(params)
        reason = self._resident_blocker(params)
        if reason is not None:
            return reason
        dev = device_update.resolve_device(device)
        for p in params:
            if p not in self._resident:
                self._resident.adopt(self.state, p, dev)
        return None

    def resident_master(self, p: Tensor) -> Tensor | None:
        """The device fp32 master of ``p`` for a weight fetch (None: not resident). A host
        write since the last :meth:`synchronize` is uploaded first."""
        if p not in self._resident:
            return None
        return self._resident.master(p, self._describe)

    def resident_ready(self, p: Tensor) -> Any:
        """The CUDA event after which ``p``'s device master holds its latest update (None:
        no update yet, or the CPU)."""
        return self._resident.ready_event(p)

    def update_resident(self, params: Sequence[Tensor], grads: Sequence[Tensor],
                        scratch: Tensor | None = None, last_piece: bool = True) -> Declined | None:
        """Hand in gradients of resident ``params`` (on their device, the params' shapes),
        like :meth:`submit`: applied on the device now, in stream order, with the group's
        hyperparameters read now; or, where the update must wait (inside ``accumulate()``,
        with clipping or the non-finite check), summed into the device buffers the caller
        lent (:meth:`give_resident_buffers`) and applied by ``step()``. A gradient not in
        fp32 and contiguous (the runtime's bf16) is upcast piece by piece into ``scratch``
        (fp32, on the device, reused in stream order; required for such a gradient), so
        the scratch need not be as large as the parameter (optim/resident.py).
        ``last_piece`` False: more of these gradients come in this backward (a tied weight
        read by two regions sends one piece from each); the piece is summed into the lent
        buffers, as the host path sums it into ``p.grad``, and the last piece completes it.
        Returns None (taken) or why not (protocol.Declined): lend buffers and call again
        (``needs_buffers``), or take the host path instead (the caller drops the residency)."""
        params, grads = list(params), list(grads)
        if not all(p in self._resident for p in params):
            return Declined("a parameter is not resident")
        final = self._accumulating == 0 and last_piece
        reason = self._resident_blocker(params, final=final)
        if reason is not None:
            return Declined(reason)
        if not last_piece:
            if self._accumulating:
                # the host path sums one backward's pieces in its slab, then adds that into
                # p.grad; the lent buffer alone cannot keep those two sums apart
                return Declined("a tied weight's gradient pieces under accumulate() are summed "
                                "on the host, per backward")
            if self._resident.needs_buffers(params):
                return NEEDS_BUFFERS
            for p, g in zip(params, grads):
                self._resident.accumulate(p, g, scratch)
            return None
        immediate = final and self.max_grad_norm is None and not self.skip_nonfinite
        if not immediate or self._resident.has_grads(params):
            if self._resident.needs_buffers(params):
                return NEEDS_BUFFERS
            grads = [self._resident.accumulate(p, g, scratch) for p, g in zip(params, grads)]
        if immediate:
            self._apply_resident(params, grads, scratch)
        elif final:
            self._resident.mark_pending(params)
            if self.max_grad_norm is not None or self.skip_nonfinite:
                # Each norm in stream order now, while the backward runs: step() then
                # only gathers them (one copy per device), instead of launching a norm
                # per tensor and waiting on each after the backward has drained.
                for p, g in zip(params, grads):
                    self._norms[p] = (g, g._version, functional.grad_norm(g))
        for p in params if final else ():
            self._final[p] = immediate
        return None

    def give_resident_buffers(self, params: Sequence[Tensor], buffers: Sequence[Tensor]) -> None:
        """Lend device fp32 buffers (one per parameter, its shape, contiguous) in which
        gradients of resident ``params`` wait; kept until the parameters leave the device."""
        self._resident.give_buffers(list(params), list(buffers))

    def _resident_blocker(self, params: list[Tensor], final: bool = False) -> str | None:
        """Why ``params`` cannot live (or be updated) on the device now, or None."""
        if self._hands_in_its_own_way():
            return (f"{type(self).__name__} hands gradients to its state its own way: the "
                    "resident state knows megatrain.AdamW's only")
        return self._params_blocker(params, final)

    def flush_resident(self, params: Iterable[Tensor]) -> None:
        """Make the host copies of resident ``params`` current (they stay resident): the
        runtime calls it before any other fetch of them from the host (another graph's)."""
        if len(self._resident):
            self._resident.flush(self.state, list(params), self._describe)

    def drop_resident(self, params: Iterable[Tensor] | None = None) -> None:
        """Keep ``params`` (default: all) in host memory again, newest values included."""
        self._resident.drop(self.state, None if params is None else list(params), self._describe)

    def is_resident(self, p: Tensor) -> bool:
        return p in self._resident

    def _leave_device(self, params: Sequence[Tensor]) -> None:
        """A host path is about to touch ``params``: resident ones come home first."""
        if len(self._resident):
            self.drop_resident(params)

    @torch.no_grad()
    def _apply_on_device(self, on_device: dict[Tensor, Tensor], coef: Tensor | None) -> None:
        """step(): the final gradients that waited on the device, clipped like the host's,
        applied there (stream order); the buffers are free for the next step."""
        by_device: dict[torch.device, list[Tensor]] = {}
        for p in on_device:
            by_device.setdefault(on_device[p].device, []).append(p)
        for device, params in by_device.items():
            grads = [on_device[p] for p in params]
            if coef is not None:   # fp32 times a scalar is exactly rounded: g.mul_(coef)'s bits
                torch._foreach_mul_(grads, coef.to(device))
            self._apply_resident(params, grads)

    def _apply_resident(self, params: list[Tensor], grads: list[Tensor],
                        scratch: Tensor | None = None) -> None:
        """Update resident ``params`` on their device with ``grads``, each group's
        hyperparameters read now; their waiting-gradient buffers are free again."""
        for gi, (ps, gs) in self._split_by_group(params, grads).items():
            self._resident.update(ps, gs, self._hyper(self.param_groups[gi]), scratch)
        self._resident.clear_grads(params)
