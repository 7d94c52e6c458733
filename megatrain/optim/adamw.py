"""megatrain.AdamW: the host optimizer, usable alone or fed region by region by the runtime.

Host memory per parameter is the fp32 master (the parameter itself) plus fp32 ``exp_avg``
and ``exp_avg_sq``: 12 bytes. A gradient buffer (4 more) exists only for parameters whose
update has to wait: gradient accumulation, clipping or the non-finite check.

Numerics: the update is ``torch._fused_adamw_``, so results are bitwise those of
``torch.optim.AdamW(fused=True)`` on the CPU and within rounding (~1e-7 relative per step) of
the default ``torch.optim.AdamW``. Clipping is bitwise ``clip_grad_norm_(foreach=False)``
over all gradients in param-group order (see :mod:`megatrain.optim.functional`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from megatrain.optim import checks, device_update, functional, registry
from megatrain.optim.resident import ResidentState
from megatrain.optim.engine import HostWorker
from megatrain.memory.host_store import advise_huge_pages, host_zeros_like, is_homed

# The group keys torch.optim.AdamW keeps, with the values that describe this optimizer's
# math, so a state_dict moves between torch.optim.AdamW and megatrain.AdamW both ways.
_TORCH_KEYS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}
_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")
# update_resident's answer when the gradients must wait on the device and have no buffer yet.
RESIDENT_NEEDS_BUFFERS = "resident gradients must wait on the device: lend them buffers"


class AdamW(Optimizer):
    """AdamW with fp32 master weights and moments in host memory.

    Without the megatrain backend it is a drop-in ``torch.optim.AdamW``: gradients in
    ``p.grad``, ``step()``, ``zero_grad()``, param groups, LR schedulers, state_dicts.

    With the backend, the runtime hands in gradients region by region during backward:

    - ``submit(params, grads)`` behaves like autograd's gradient accumulation into
      ``p.grad`` followed, when the gradient is final, by that region's AdamW update on the
      host worker thread. The returned future resolves once ``grads`` have been consumed,
      so the caller may then reuse their (staging) memory.
    - The update runs at once (no gradient buffer) unless it must wait: inside
      ``with opt.accumulate():`` (a micro-batch other than the last), or when
      ``max_grad_norm`` or ``skip_nonfinite`` need every gradient first. Then the gradient
      is summed into ``p.grad`` (an optimizer-owned buffer, allocated on first use and
      recycled across steps: clone ``p.grad`` to keep it past ``zero_grad()``;
      ``release_grad_buffers()`` stops the recycling) and ``step()`` applies it.
    - Hyperparameters are read when a gradient is submitted: change ``lr`` before backward,
      as an LR scheduler stepped after ``opt.step()`` does.
    - ``wait_params(params)`` blocks until queued work on ``params`` is done (before the
      runtime re-fetches their weights).
    - With clipping or the non-finite check, updates can only start once ``step()`` knows
      the global norm. For parameters the megatrain backend streams, ``step()`` then
      queues the updates region by region in the order the next forward fetches them and
      returns without waiting: the updates run while the next forward streams, each
      region's fetch waiting only for its own update. ``synchronize()``, ``state_dict()``
      and the next ``step()`` wait for all of them; read those parameters directly
      (outside the compiled model) only after ``synchronize()``. Otherwise ``step()`` is
      synchronous like torch's.
    - ``defer(params)`` (the runtime's gradient backlog, megatrain.runtime.deadlines):
      the final gradients of ``params`` exist but are handed in only after backward has
      returned. The update is recorded as final now, with the hyperparameters of now, and
      queued when the runtime hands the gradients in (``Deferred.submit``). ``step()``
      returns without waiting for it (the next fetch of those parameters waits, through
      ``wait_params``); ``synchronize()``, ``state_dict()`` and the next ``step()`` wait.
    - ``submit_on_device(params, device_grads, device)`` runs a region's update on the
      compute device instead (a planner choice, see :mod:`megatrain.optim.device_update`):
      master, m and v cross the link, the same kernel updates them there and they come
      back; the returned handle is waited for like a host update.
    - ``make_resident(params, device)`` / ``update_resident(params, device_grads)`` (compile
      option ``updates="resident"``, megatrain.optim.resident): master, m and v of
      ``params`` live on the device between steps and are updated there; ``step()`` applies
      gradients that had to wait (micro-batches, clipping, the non-finite check) there too.

    Reading parameters (the rule, whatever the plan put where): ``model.state_dict()``
    (every module the backend streams has a hook, optim/module_reads.py), ``state_dict()``,
    checkpoints and the compiled model itself always see the newest values, and leave
    resident state on the device. Read or write ``p.data`` / ``model.parameters()``
    directly only after ``synchronize()``, which also sends resident state home (the
    runtime adopts it again, with any host writes, at the next fetch).

    Args:
        max_grad_norm: clip the global gradient 2-norm to this, inside ``step()``; the
            norm is then in ``last_grad_norm``.
        skip_nonfinite: if any gradient has a NaN/Inf element, skip the whole step (params,
            moments and step counts untouched), warn, and count it in ``skipped_steps``.
        threads: intra-op threads of the host worker; default ``torch.get_num_threads()``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = False,
        threads: int | None = None,
    ) -> None:
        betas = tuple(betas) if isinstance(betas, (list, tuple)) else betas
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **_TORCH_KEYS)
        checks.check_hyperparameters(defaults, "megatrain.AdamW")
        checks.check_options(max_grad_norm, skip_nonfinite, threads)
        self._setup(max_grad_norm, skip_nonfinite, threads)
        super().__init__(params, defaults)

    def _setup(
        self, max_grad_norm: float | None, skip_nonfinite: bool, threads: int | None
    ) -> None:
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.skip_nonfinite = skip_nonfinite
        self._threads_arg = threads
        self.threads = torch.get_num_threads() if threads is None else threads
        self.last_grad_norm: Tensor | None = None
        self.skipped_steps = 0
        self._worker = HostWorker(self.threads)
        self._accumulating = 0
        self._where: dict[Tensor, tuple[int, int]] = {}  # param -> (group, index)
        self._final: dict[Tensor, bool] = {}  # final grad submitted this step -> applied?
        self._norms: dict[Tensor, tuple[Tensor, int, Tensor]] = {}  # grad, version, norm
        self._grad_buffers: dict[Tensor, Tensor] = {}
        self._regions: list[list[Tensor]] = []  # deferred final submits, in arrival order
        self._device_updates: device_update.DeviceUpdater | None = None  # made on first use
        self._promised_to: dict[Tensor, Deferred] = {}  # param -> its update, not queued yet
        self._promise_list: list[Deferred] = []  # not yet waited for by _wait_everything
        self._promise_lock = threading.Lock()
        self._piece_seen: dict[Tensor, int] = {}  # param -> elements handed in so far (caller)
        self._piece_fresh: dict[Tensor, bool] = {}  # param -> p.grad started empty (worker)
        self._resident = ResidentState()  # params whose state lives on the device
        self._shadows: dict[Tensor, Tensor] = {}  # param -> its low-precision copy (keep_shadows)
        self._shadow_marks: dict[Tensor, tuple[int, float]] = {}  # param -> (version, step) written at

    # ---- the region API (called by the runtime) -------------------------------------

    def submit(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> Future:
        """Hand in the gradients of one region; see the class docstring. Raises at once on
        bad input; errors on the worker surface from the future, ``wait_params`` and
        ``step``."""
        params, grads = list(params), list(grads)
        checks.check_region(params, grads, self._where.__contains__, self._describe)
        self._leave_device(params)
        for p in params:
            if p in self._final:
                raise ValueError(
                    f"submit(): {self._describe(p)} already received its last gradient for "
                    "this step; call opt.step() between steps, and run every micro-batch's "
                    "backward but the last inside `with opt.accumulate():`"
                )
        final = self._accumulating == 0
        immediate = final and self.max_grad_norm is None and not self.skip_nonfinite
        for p in params if final else ():
            self._final[p] = immediate
        if final and not immediate and all(map(is_homed, params)):
            self._regions.append(params)  # streamed by the backend: its fetch waits
        if immediate:
            parts = self._split_by_group(params, grads)
            hypers = {gi: self._hyper(self.param_groups[gi]) for gi in parts}
            return self._worker.submit(self._apply_region, parts, hypers, touches=params)
        return self._worker.submit(self._accumulate_region, params, grads, final, touches=params)

    def submit_pieces(self, pieces: Sequence[tuple[Tensor, int, Tensor]]) -> Future:
        """``submit`` for parts of gradients: ``(param, start, values)``, ``values`` the 1-D
        gradient of the contiguous ``param``'s flat elements ``start:start + len``. Why: the
        runtime's gradient ring (megatrain.runtime.grad_ring) hands gradients to the host in
        fixed-size chunks, so the host holds a few chunks rather than a few regions (a whole
        embedding's gradient at least). A parameter's pieces come in order, without gaps,
        over any number of calls; ``start`` is a multiple of ``functional.PIECE_ALIGN``, so
        each piece rounds exactly as the whole gradient would (AdamW is elementwise). The
        step count moves with the first piece; a parameter's gradient counts as submitted
        (final, accumulated, normed) once its last element is in."""
        final = self._accumulating == 0
        immediate = final and self.max_grad_norm is None and not self.skip_nonfinite
        work: dict[int, list[tuple[Tensor, int, Tensor, bool, bool]]] = {}
        for p, start, g in pieces:
            checks.check_piece(p, start, g, self._where.__contains__, self._describe)
            self._leave_device([p])
            seen = self._piece_seen.get(p, 0)
            if start != seen:
                raise ValueError(
                    f"submit_pieces(): {self._describe(p)} got elements from {start} after "
                    f"{seen} of {p.numel()}: hand in each parameter's pieces in order")
            if seen == 0 and final and p in self._final:
                raise ValueError(
                    f"submit_pieces(): {self._describe(p)} already received its last gradient "
                    "for this step; call opt.step() between steps")
            seen += g.numel()
            last = seen == p.numel()
            if last:
                self._piece_seen.pop(p, None)
                if final:
                    self._final[p] = immediate
                    if not immediate and is_homed(p):
                        self._regions.append([p])
            else:
                self._piece_seen[p] = seen
            work.setdefault(self._where[p][0], []).append((p, start, g, start == 0, last))
        touches = [p for items in work.values() for p, *_ in items]
        if immediate:
            hypers = {gi: self._hyper(self.param_groups[gi]) for gi in work}
            return self._worker.submit(self._apply_pieces, work, hypers, touches=touches)
        return self._worker.submit(self._accumulate_pieces, work, final, touches=touches)

    def defer(self, params: Sequence[Tensor]) -> Deferred | None:
        """Promise the final gradients of ``params`` for later (see the class docstring):
        the runtime's backlog hands them in after the end of backward, and ``step()``
        should not wait for them. Returns the ``Deferred`` to hand them in with,
        or None where their update would not be immediate: inside ``accumulate()``, with
        ``max_grad_norm`` or ``skip_nonfinite`` (``step()`` needs every gradient), in a
        subclass that hands gradients in its own way, or where ``p.grad`` holds earlier
        micro-batches (a ``zero_grad()`` before the late update would drop them). Then
        the caller must ``submit()`` before ``step()``.

        Why the hyperparameters are read now: ``submit()`` reads them when the gradient
        arrives, during backward; a late update must not see an LR scheduler stepped after
        ``opt.step()``, or results would differ from the non-deferred path."""
        params = list(params)
        if (type(self).submit is not AdamW.submit or self._accumulating
                or self.max_grad_norm is not None or self.skip_nonfinite):
            return None
        for p in params:
            if p not in self._where:
                raise ValueError("defer(): a parameter is not managed by this optimizer")
            if p in self._final:
                raise ValueError(
                    f"defer(): {self._describe(p)} already received its last gradient for "
                    "this step; call opt.step() between steps"
                )
        self.wait_params(params)
        if any(p.grad is not None for p in params):
            return None
        self._leave_device(params)
        groups = {self._where[p][0] for p in params}
        d = Deferred(self, params, {gi: self._hyper(self.param_groups[gi]) for gi in groups})
        with self._promise_lock:
            for p in params:
                self._final[p] = True
                self._promised_to[p] = d
            self._promise_list.append(d)
        return d

    def _submit_deferred(self, d: Deferred, grads: Sequence[Tensor]) -> Future:
        """Queue a deferred update (from the runtime's hand-off thread), then let waiters of
        its parameters through: they find the queued task in the worker's tracking."""
        try:
            grads = list(grads)
            checks.check_region(d.params, grads, self._where.__contains__, self._describe)
            parts = self._split_by_group(d.params, grads)
            future = self._worker.submit(self._apply_region, parts, d.hypers, touches=d.params)
        except BaseException as e:
            self._settle(d, e)
            raise
        self._settle(d, None)
        return future

    def _settle(self, d: Deferred, error: BaseException | None) -> None:
        """Queued: waiters find the task in the worker. Failed: the error stays where
        wait_params finds it until step(), synchronize() or the like collected it."""
        if error is None:
            self._forget([d])
            d.queued.set_result(None)
        else:
            d.queued.set_exception(error)

    def _forget(self, deferreds: Iterable[Deferred]) -> None:
        with self._promise_lock:
            for d in deferreds:
                for p in d.params:
                    if self._promised_to.get(p) is d:
                        del self._promised_to[p]

    def _wait_deferred(self, deferreds: Iterable[Deferred], collect: bool = False) -> None:
        deferreds = list(deferreds)
        errors = [d.queued.exception() for d in deferreds]
        if collect:
            self._forget(deferreds)
        for e in errors:
            if e is not None:
                raise e

    def _wait_everything(self) -> None:
        """Every deferred update queued, then the worker's queue empty."""
        with self._promise_lock:
            deferreds, self._promise_list = self._promise_list, []
        self._wait_deferred(deferreds, collect=True)
        self._worker.wait_all()

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Gradients submitted inside are summed into ``p.grad`` and not applied: wrap the
        backward of every micro-batch but the last (like DDP's ``no_sync``). A flag on the
        optimizer, not thread-local, because backward may submit from autograd's threads.
        Without the backend (gradients in ``p.grad``) autograd accumulates and this is a
        no-op."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    # ---- updates on the compute device (megatrain.optim.device_update) --

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
        if type(self).submit is not AdamW.submit:
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
            if p.grad is not None:
                return (
                    f"{self._describe(p)} has a gradient in p.grad (micro-batches summed "
                    "under accumulate(), or autograd's) that lives on the host and that the "
                    "device update would ignore; use submit(), or zero_grad() first"
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
                        scratch: Tensor | None = None) -> str | None:
        """Hand in gradients of resident ``params`` (on their device, the params' shapes),
        like :meth:`submit`: applied on the device now, in stream order, with the group's
        hyperparameters read now; or, where the update must wait (inside ``accumulate()``,
        with clipping or the non-finite check), summed into the device buffers the caller
        lent (:meth:`give_resident_buffers`) and applied by ``step()``. A gradient not in
        fp32 and contiguous (the runtime's bf16) is upcast piece by piece into ``scratch``
        (fp32, on the device, reused in stream order; required for such a gradient), so
        the scratch need not be as large as the parameter (optim/resident.py).
        Returns why not (None: taken): ``RESIDENT_NEEDS_BUFFERS`` (lend buffers, call
        again) or a reason to take the host path instead (the caller drops the residency)."""
        params, grads = list(params), list(grads)
        if not all(p in self._resident for p in params):
            return "a parameter is not resident"
        reason = self._resident_blocker(params, final=self._accumulating == 0)
        if reason is not None:
            return reason
        final = self._accumulating == 0
        immediate = final and self.max_grad_norm is None and not self.skip_nonfinite
        if not immediate or self._resident.has_grads(params):
            if self._resident.needs_buffers(params):
                return RESIDENT_NEEDS_BUFFERS
            grads = [self._resident.accumulate(p, g, scratch) for p, g in zip(params, grads)]
        if immediate:
            self._apply_resident(params, grads, scratch)
        elif final:
            self._resident.mark_pending(params)
        for p in params if final else ():
            self._final[p] = immediate
        return None

    def give_resident_buffers(self, params: Sequence[Tensor], buffers: Sequence[Tensor]) -> None:
        """Lend device fp32 buffers (one per parameter, its shape, contiguous) in which
        gradients of resident ``params`` wait; kept until the parameters leave the device."""
        self._resident.give_buffers(list(params), list(buffers))

    def _resident_blocker(self, params: list[Tensor], final: bool = False) -> str | None:
        """Why ``params`` cannot live (or be updated) on the device now, or None."""
        if type(self).submit is not AdamW.submit:
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

    def keep_shadows(self, params: Sequence[Tensor], shadows: Sequence[Tensor]) -> None:
        """Keep a low-precision copy of each of ``params`` in ``shadows`` (contiguous, its
        shape; the runtime's page-locked bf16 weight source, option ``weight_shadow``):
        written now, then by every host update right after it updates each chunk.

        A shadow is current (``shadow_sources``) only while its parameter has neither been
        written by anything else (its version counter moved: load_state_dict, a
        device-site update's copy back, a resident region coming home, a user's in-place
        write under no_grad) nor been updated without it (its AdamW step moved). A write
        through ``p.data`` moves neither and is not seen."""
        params = list(params)
        self.wait_params(params)
        with torch.no_grad():
            for p, sh in zip(params, shadows):
                if sh.shape != p.shape or not sh.is_contiguous():
                    raise ValueError(f"keep_shadows(): the shadow of {self._describe(p)} must be "
                                     f"contiguous and shaped {tuple(p.shape)}, not {tuple(sh.shape)}")
                sh.copy_(p)
                self._shadows[p] = sh
        self._mark_shadows(params)

    def has_shadow(self, p: Tensor) -> bool:
        return p in self._shadows

    def shadow_sources(self, params: Sequence[Tensor]) -> list[Tensor] | None:
        """The current shadows of all of ``params`` (``keep_shadows``), or None where any
        is missing or stale (the caller then reads the masters). Call after the
        parameters' updates were waited for."""
        out = []
        for p in params:
            sh = self._shadows.get(p)
            if sh is None or self._shadow_marks.get(p) != self._shadow_mark(p):
                return None
            out.append(sh)
        return out

    def _shadow_mark(self, p: Tensor) -> tuple[int, float]:
        st = self.state.get(p)
        return p._version, float(st["step"]) if st and "step" in st else 0.0

    def _mark_shadows(self, params: Iterable[Tensor]) -> None:
        """The shadows of ``params`` were just written from them (worker, or caller)."""
        for p in params:
            if p in self._shadows:
                self._shadow_marks[p] = self._shadow_mark(p)

    def _leave_device(self, params: Sequence[Tensor]) -> None:
        """A host path is about to touch ``params``: resident ones come home first."""
        if len(self._resident):
            self.drop_resident(params)

    def wait_params(self, params: Iterable[Tensor]) -> None:
        """Block until every queued update or accumulation touching ``params`` is done,
        deferred ones included (first queued, then done)."""
        params = list(params)
        with self._promise_lock:
            deferreds = {id(d): d for p in params if (d := self._promised_to.get(p)) is not None}
        self._wait_deferred(deferreds.values())
        self._worker.wait(params)

    def release_grad_buffers(self) -> None:
        """Stop recycling gradient buffers (their memory goes once ``p.grad`` is cleared)."""
        self._wait_everything()
        self._grad_buffers.clear()

    # ---- torch.optim.Optimizer ------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Wait for submitted work, then apply what remains: gradients in ``p.grad`` not yet
        applied (deferred by accumulation, clipping or the finiteness check, or left there
        by autograd), with clipping and the non-finite skip over all of them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fresh = [d for d in self._promise_list if d.fresh]
        try:
            self._wait_for_step(fresh)
            work = self._pending_grads()
            self._leave_device([p for ps, _ in work.values() for p in ps])
            on_device = self._resident.pending()  # final gradients waiting on the device
            coef = None
            if (work or on_device) and (self.max_grad_norm is not None or self.skip_nonfinite):
                params, grads = self._in_group_order(work, on_device)
                norms = [n.cpu() for n in self._grad_norms(params, grads)]  # device ones too
                total = None
                if self.max_grad_norm is not None:
                    total = functional.total_norm(norms)
                    self.last_grad_norm = total
                if self.skip_nonfinite and self._skip(params, grads, norms):
                    return loss
                if total is not None:
                    coef = functional.clip_coefficient(total, self.max_grad_norm)
                    if coef.item() == 1.0:
                        coef = None  # g * 1.0 == g: skip a pass over every gradient
            futures = [
                self._worker.submit(
                    self._update, ps, gs, self._hyper(self.param_groups[gi]), coef, touches=ps
                )
                for gi, ps, gs in self._update_order(work)
            ]
            if on_device:
                self._apply_on_device(on_device, coef)
            if not self._regions:
                for f in futures:
                    f.result()
        finally:
            self._final.clear()
            self._norms.clear()
            self._regions.clear()
            for d in fresh:
                d.fresh = False
        return loss

    def _in_group_order(self, work: dict[int, tuple[list[Tensor], list[Tensor]]],
                        on_device: dict[Tensor, Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """Every pending (param, gradient), host ones from ``work`` and device ones, in
        param-group order: the order clip_grad_norm_ stacks the norms in (bits)."""
        host = {p: g for ps, gs in work.values() for p, g in zip(ps, gs)}
        params, grads = [], []
        for group in self.param_groups:
            for p in group["params"]:
                g = host.get(p)
                if g is None:
                    g = on_device.get(p)
                if g is not None:
                    params.append(p)
                    grads.append(g)
        return params, grads

    @torch.no_grad()
    def _apply_on_device(self, on_device: dict[Tensor, Tensor], coef: Tensor | None) -> None:
        """step(): the final gradients that waited on the device, clipped like the host's,
        applied there (stream order); the buffers are free for the next step."""
        params = list(on_device)
        grads = [on_device[p] for p in params]
        if coef is not None:
            for g in grads:
                g.mul_(coef.to(g.device))
        self._apply_resident(params, grads)

    def _apply_resident(self, params: list[Tensor], grads: list[Tensor],
                        scratch: Tensor | None = None) -> None:
        """Update resident ``params`` on their device with ``grads``, each group's
        hyperparameters read now; their waiting-gradient buffers are free again."""
        for gi, (ps, gs) in self._split_by_group(params, grads).items():
            self._resident.update(ps, gs, self._hyper(self.param_groups[gi]), scratch)
        self._resident.clear_grads(params)

    def _wait_for_step(self, fresh: list[Deferred]) -> None:
        """What step() waits for: everything, except the deferred updates of this step
        (final and immediate: step() has nothing to do for them, and waiting would keep the
        next forward from overlapping them)."""
        if not fresh:
            self._wait_everything()
            return
        skip = {p for d in fresh for p in d.params}
        with self._promise_lock:
            older = [d for d in self._promise_list if not d.fresh]
            self._promise_list = [d for d in self._promise_list if d.fresh]
        self._wait_deferred(older, collect=True)
        self._worker.wait([p for p in self._where if p not in skip])

    def synchronize(self) -> None:
        """Block until every queued update has been applied. ``step()`` returns before its
        updates finish when the gradients came region by region from the runtime (see the
        class docstring), and resident state (``updates="resident"``) comes home only here
        (the runtime adopts it afresh at the next fetch, with any host writes made since);
        read or write parameters directly only after this."""
        self._wait_everything()
        self._resident.drop(self.state, None, self._describe)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Queued updates hold their own references to the gradients, so dropping p.grad
        # need not wait for them; zeroing in place must.
        if not set_to_none:
            self._wait_everything()
        super().zero_grad(set_to_none)
        self._resident.clear_grads()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and "params" in param_group:
            raw = param_group["params"]
            if not isinstance(raw, (Tensor, set)):
                raw = param_group["params"] = list(raw)
                seen = {id(p) for g in self.param_groups for p in g["params"]}
                checks.check_no_duplicates(raw, seen, f"param_groups[{len(self.param_groups)}]")
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        try:
            checks.check_hyperparameters(group, f"param_groups[{gi}]")
            for i, p in enumerate(group["params"]):
                checks.check_param(p, self._label(group, gi, i, p))
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        self._reindex()

    def set_threads(self, threads: int) -> None:
        """Run later updates with ``threads`` intra-op threads: the knob to tune against
        the other threads of a training process (compute launch, copies, autograd) sharing
        the cores. Waits for queued work first."""
        checks.check_options(self.max_grad_norm, self.skip_nonfinite, threads)
        self._wait_everything()
        self._worker.shutdown()
        self._worker = HostWorker(threads)
        self._threads_arg = self.threads = threads

    @property
    def host_busy_s(self) -> float:
        """Seconds the host worker has spent running updates (and accumulations) since
        it started (``set_threads`` starts a new one): the measured side of the cost
        model's host stream."""
        return self._worker.busy_s

    def prefer_threads(self, threads: int) -> None:
        """A runtime's suggestion, applied only when the user left ``threads`` unset: the
        streaming runtime asks for fewer threads than cores because the host update shares
        them (and host memory bandwidth) with copies, the launch thread and autograd."""
        if self._threads_arg is None and threads != self.threads:
            self.set_threads(threads)
            self._threads_arg = None

    def state_dict(self) -> dict[str, Any]:
        # Current values, read: resident state is copied home and stays on the device (a
        # write to what this returns is not seen; load_state_dict is how state changes).
        self._wait_everything()
        self._resident.flush(self.state, None, self._describe)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._wait_everything()
        # The loaded state replaces the device copies: the runtime adopts it afresh.
        self._resident.drop_for_load()
        super().load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        self.synchronize()
        state = dict(super().__getstate__())
        state["megatrain_options"] = dict(
            max_grad_norm=self.max_grad_norm,
            skip_nonfinite=self.skip_nonfinite,
            threads=self._threads_arg,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Called by load_state_dict (state and groups only) and by unpickling/deepcopy
        # (no worker yet): rebuild the runtime only in the second case.
        state = dict(state)
        options = state.pop("megatrain_options", None)
        super().__setstate__(state)
        if "_worker" not in self.__dict__:
            self._setup(**(options or dict(max_grad_norm=None, skip_nonfinite=False, threads=None)))
        self._adopt_loaded_state()

    # ---- internals ------------------------------------------------------------------

    def _reindex(self) -> None:
        self._where = {
            p: (gi, i) for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])
        }
        registry.register(self._where, self)

    @staticmethod
    def _label(group: dict[str, Any], gi: int, i: int, p: Tensor) -> str:
        names = group.get("param_names")
        label = f"parameter '{names[i]}'" if names else f"param_groups[{gi}]['params'][{i}]"
        return f"{label} (shape {tuple(p.shape)})"

    def _describe(self, p: Tensor) -> str:
        gi, i = self._where[p]
        return self._label(self.param_groups[gi], gi, i, p)

    @staticmethod
    def _hyper(group: dict[str, Any]) -> dict[str, float]:
        beta1, beta2 = group["betas"]
        return dict(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
        )

    def _split_by_group(
        self, params: list[Tensor], grads: list[Tensor]
    ) -> dict[int, tuple[list[Tensor], list[Tensor]]]:
        parts: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        for p, g in zip(params, grads):
            ps, gs = parts.setdefault(self._where[p][0], ([], []))
            ps.append(p)
            gs.append(g)
        return parts

    def _pending_grads(self) -> dict[int, tuple[list[Tensor], list[Tensor]]]:
        """Per group, the params whose ``p.grad`` is still to be applied, in group order."""
        work: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        for gi, group in enumerate(self.param_groups):
            ps, gs = [], []
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None or self._final.get(p, False):
                    continue
                if not (p.dtype == torch.float32 and p.is_cpu and checks.grad_ok(g, p)):
                    name = self._label(group, gi, i, p)
                    checks.check_param(p, name)
                    checks.check_grad(g, p, name)
                ps.append(p)
                gs.append(g)
            if ps:
                work[gi] = (ps, gs)
        return work

    def _update_order(
        self, work: dict[int, tuple[list[Tensor], list[Tensor]]]
    ) -> list[tuple[int, list[Tensor], list[Tensor]]]:
        """(group, params, grads) tasks. Gradients that came from the runtime are updated a
        region at a time, last-submitted region first: that is the order in which the next
        forward fetches them, so each fetch waits only for its own region's update."""
        grad_of = {p: (gi, g) for gi, (ps, gs) in work.items() for p, g in zip(ps, gs)}
        tasks = []
        for region in reversed(self._regions):
            by_group: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
            for p in region:
                if p in grad_of:
                    gi, g = grad_of.pop(p)
                    ps, gs = by_group.setdefault(gi, ([], []))
                    ps.append(p)
                    gs.append(g)
            tasks += [(gi, ps, gs) for gi, (ps, gs) in by_group.items()]
        rest: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        for p, (gi, g) in grad_of.items():  # p.grad left by autograd: one task per group
            ps, gs = rest.setdefault(gi, ([], []))
            ps.append(p)
            gs.append(g)
        return tasks + [(gi, ps, gs) for gi, (ps, gs) in sorted(rest.items())]

    def _grad_norms(self, params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        """Per-tensor 2-norms, reusing those the worker computed when a final gradient
        arrived through submit() (valid while p.grad is that same, unmodified tensor)."""
        norms: list[Tensor | None] = []
        missing: list[int] = []
        for k, (p, g) in enumerate(zip(params, grads)):
            cached = self._norms.get(p)
            if cached is not None and cached[0] is g and cached[1] == g._version:
                norms.append(cached[2])
            else:
                norms.append(None)
                missing.append(k)
        if missing:
            todo = [grads[k] for k in missing]
            computed = self._worker.submit(
                lambda gs: [functional.grad_norm(g) for g in gs], todo
            ).result()
            for k, n in zip(missing, computed):
                norms[k] = n
        return norms  # type: ignore[return-value]

    def _skip(self, params: list[Tensor], grads: list[Tensor], norms: list[Tensor]) -> bool:
        if bool(torch.isfinite(torch.stack(norms)).all()):
            return False
        for p, g, n in zip(params, grads, norms):
            if not functional.is_finite(g, n):
                warnings.warn(
                    f"megatrain.AdamW: non-finite gradient in {self._describe(p)}; step "
                    "skipped, parameters and moments unchanged (lower the learning rate "
                    "or check the loss scale if this repeats)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self.skipped_steps += 1
                return True
        return False  # only the norms overflowed; the elements are finite

    def _state_of(self, params: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Moments and step counts, created on first use (on the worker, so the first
        touch of their pages happens off the caller's thread)."""
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = host_zeros_like(p)
                st["exp_avg_sq"] = host_zeros_like(p)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        return exp_avgs, exp_avg_sqs, steps

    def _update(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        hyper: dict[str, float],
        coef: Tensor | None,
    ) -> None:
        """Worker: clip (in place, like clip_grad_norm_) and apply one AdamW step."""
        if coef is not None:
            for g in grads:
                g.mul_(coef)
        grads = [functional.like_param(g, p) for p, g in zip(params, grads)]
        exp_avgs, exp_avg_sqs, steps = self._state_of(params)
        shadows = [self._shadows.get(p) for p in params] if self._shadows else None
        functional.adamw_(params, grads, exp_avgs, exp_avg_sqs, steps, shadows, **hyper)
        if shadows:
            self._mark_shadows(params)

    def _apply_region(
        self,
        parts: dict[int, tuple[list[Tensor], list[Tensor]]],
        hypers: dict[int, dict[str, float]],
    ) -> None:
        """Worker: a final gradient, applied now; earlier micro-batches sit in p.grad."""
        for gi, (ps, gs) in parts.items():
            total = []
            for p, g in zip(ps, gs):
                if p.grad is not None:
                    g = p.grad.add_(g)
                total.append(g)
            self._update(ps, total, hypers[gi], None)

    def _apply_pieces(self, work: dict[int, list[tuple]], hypers: dict[int, dict[str, float]]) -> None:
        """Worker: final pieces, applied now (earlier micro-batches sit in p.grad)."""
        for gi, items in work.items():
            ps, gs, ms, vs, steps, shadows = [], [], [], [], [], []
            for p, start, g, first, _ in items:
                end = start + g.numel()
                if p.grad is not None:
                    g = p.grad.view(-1)[start:end].add_(g)
                (m,), (v,), (step,) = self._state_of([p])
                if first:
                    step.add_(1)
                ps.append(p.detach().view(-1)[start:end])
                gs.append(g)
                ms.append(m.view(-1)[start:end])
                vs.append(v.view(-1)[start:end])
                steps.append(step)
                sh = self._shadows.get(p)
                shadows.append(None if sh is None else sh.view(-1)[start:end])
            functional.adamw_at_step_(ps, gs, ms, vs, steps, shadows, **hypers[gi])
            self._mark_shadows(p for p, *_ in items)

    def _accumulate_pieces(self, work: dict[int, list[tuple]], final: bool) -> None:
        """Worker: pieces summed into p.grad like ``_accumulate_region`` (a parameter whose
        p.grad was empty at its first piece gets its pieces copied, not added)."""
        for items in work.values():
            for p, start, g, first, last in items:
                if first:
                    self._piece_fresh[p] = p.grad is None
                    if p.grad is None:
                        buf = self._grad_buffers.get(p)
                        if buf is None:
                            buf = self._grad_buffers[p] = host_zeros_like(p)
                        p.grad = buf
                dst = p.grad.view(-1)[start:start + g.numel()]
                dst.copy_(g) if self._piece_fresh[p] else dst.add_(g)
                if last:
                    del self._piece_fresh[p]
                    if final:
                        self._norms[p] = (p.grad, p.grad._version, functional.grad_norm(p.grad))

    def _accumulate_region(self, params: list[Tensor], grads: list[Tensor], final: bool) -> None:
        """Worker: sum into p.grad like autograd (copy when empty, else add: the same bits
        as eager accumulation); for a final gradient also take its norm now, overlapped
        with the caller's compute, for clipping or the finiteness check in step()."""
        for p, g in zip(params, grads):
            if p.grad is None:
                buf = self._grad_buffers.get(p)
                if buf is None:
                    buf = self._grad_buffers[p] = host_zeros_like(p)
                p.grad = buf.copy_(g)
            else:
                p.grad.add_(g)
            if final:
                self._norms[p] = (p.grad, p.grad._version, functional.grad_norm(p.grad))

    def _adopt_loaded_state(self) -> None:
        """Validate groups and state after load_state_dict/unpickling, and bring the state
        to the form the kernel needs (fp32 0-dim step, moments as _adopt_moments says)."""
        for gi, group in enumerate(self.param_groups):
            checks.check_hyperparameters(group, f"loaded param_groups[{gi}]")
            group.update(fused=True, foreach=None, capturable=False, decoupled_weight_decay=True)
        self._reindex()
        for p, st in self.state.items():
            if not isinstance(p, Tensor) or not st or p not in self._where:
                continue
            missing = [k for k in _STATE_KEYS if k not in st]
            if missing:
                raise ValueError(
                    f"loaded state for {self._describe(p)} lacks {missing}: load a state_dict "
                    f"saved by megatrain.{type(self).__name__} or torch.optim.AdamW/Adam"
                )
            step = st["step"]
            kernel_ready = (
                isinstance(step, Tensor) and step.dtype == torch.float32 and not step.dim()
            )
            if not (kernel_ready and step.is_cpu):
                st["step"] = torch.tensor(float(step), dtype=torch.float32)
            self._adopt_moments(p, st)

    def _adopt_moments(self, p: Tensor, st: dict[str, Any]) -> None:
        """Loaded moments laid out like their parameter."""
        for k in ("exp_avg", "exp_avg_sq"):
            if st[k].shape != p.shape:
                raise ValueError(
                    f"loaded {k} for {self._describe(p)} has shape {tuple(st[k].shape)}; "
                    "the state_dict belongs to a different model"
                )
            st[k] = functional.like_param(st[k], p)
            advise_huge_pages(st[k])  # streamed every step, like the moments host_zeros makes


class Deferred:
    """One region's update promised by ``AdamW.defer``: ``submit(grads)`` queues it (once),
    with the hyperparameters read at ``defer``; ``queued`` resolves then (or carries the
    error). ``fail(error)``: the gradients will never come (the runtime failed); waiters of
    the parameters re-raise it."""

    def __init__(self, opt: AdamW, params: list[Tensor], hypers: dict[int, dict[str, float]]):
        self.params = params
        self.hypers = hypers
        self.queued: Future = Future()
        self.fresh = True  # made since the last step(), which does not wait for it
        self._opt = opt

    def submit(self, grads: Sequence[Tensor]) -> Future:
        return self._opt._submit_deferred(self, grads)

    def fail(self, error: BaseException) -> None:
        if not self.queued.done():
            self._opt._settle(self, error)
