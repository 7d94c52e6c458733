"""megatrain.AdamW: the host optimizer, usable alone or fed region by region by the runtime.

Host memory per parameter is the fp32 master (the parameter itself) plus fp32 ``exp_avg``
and ``exp_avg_sq``: 12 bytes. A gradient buffer (4 more, or 2 for a bf16 gradient held as
it came) exists only for parameters whose update has to wait: gradient accumulation,
clipping or the non-finite check.

Numerics: the update is ``torch._fused_adamw_``, so results are bitwise those of
``torch.optim.AdamW(fused=True)`` on the CPU and within rounding (~1e-7 relative per step) of
the default ``torch.optim.AdamW``. Clipping is bitwise ``clip_grad_norm_(foreach=False)``
over all gradients in param-group order (see :mod:`megatrain.optim.functional`).

One public class, its parts in modules of one job each: this file holds what a user and
the runtime call on the host path (construction, ``submit``/``submit_pieces``/``defer``,
``step`` and the rest of ``torch.optim.Optimizer``, state_dicts and pickling) and the
per-step bookkeeping they share. The worker's tasks and step()'s update order are the
:class:`~megatrain.optim.host_updates.HostUpdates` mixin; updates run on, and state kept
on, the compute device are the :class:`~megatrain.optim.device_side.DeviceSide` mixin;
deferred updates (optim/deferral.py) and weight shadows (optim/shadows.py) are helper
objects the optimizer owns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from megatrain.memory.host_store import advise_huge_pages, is_homed
from megatrain.optim import checks, device_update, functional, registry
from megatrain.optim.deferral import Deferred, Promises
from megatrain.optim.device_side import DeviceSide
from megatrain.optim.engine import HostWorker
from megatrain.optim.host_updates import HostUpdates
from megatrain.optim.narrow_grads import NarrowGrads
from megatrain.optim.resident import ResidentState
from megatrain.optim.shadows import Shadows

# Deferred (what defer returns) is found here by type hints.
__all__ = ["AdamW", "Deferred"]

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


class AdamW(HostUpdates, DeviceSide, Optimizer):
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
      ``release_grad_buffers()`` stops the recycling) and ``step()`` applies it. A final
      gradient in a lower precision than its parameter (the runtime's bf16) with nothing
      to sum it with (no ``p.grad``, outside ``accumulate()``) is held by the optimizer in
      its own dtype instead, in a recycled buffer of half the bytes: ``p.grad`` stays None
      for it, ``step()`` consumes it (upcast exactly: the same bits as the fp32 buffer)
      and ``zero_grad()`` drops it.
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
        """Everything besides torch's groups and state: made at construction and again at
        unpickling (``__setstate__``), never pickled."""
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
        self._norms: dict[Tensor, tuple[Tensor, int, Tensor | Future]] = {}  # grad, version, norm
        self._norm_threads = None  # optim/norms.py, made at the first held gradient's norm
        self._grad_buffers: dict[Tensor, Tensor] = {}
        self._narrow = NarrowGrads()  # final low-precision gradients held for step()
        self._regions: list[list[Tensor]] = []  # deferred final submits, in arrival order
        self._device_updates: device_update.DeviceUpdater | None = None  # made on first use
        self._promises = Promises()  # defer()'s updates, not yet queued or waited for
        self._piece_seen: dict[Tensor, int] = {}  # param -> elements handed in so far (caller)
        self._piece_fresh: dict[Tensor, bool] = {}  # param -> p.grad started empty (worker)
        self._resident = ResidentState()  # params whose state lives on the device
        self._shadows = Shadows()  # params' low-precision copies (keep_shadows)

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
        if (self._hands_in_its_own_way() or self._accumulating
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
        if any(map(self._has_grad, params)):
            return None
        self._leave_device(params)
        groups = {self._where[p][0] for p in params}
        for p in params:
            self._final[p] = True
        hypers = {gi: self._hyper(self.param_groups[gi]) for gi in groups}
        return self._promises.promise(params, hypers, self._queue_deferred)

    def _queue_deferred(self, params: list[Tensor], grads: Sequence[Tensor],
                        hypers: dict[int, dict[str, float]]) -> Future:
        """``Deferred.submit`` (the runtime's hand-off thread): the promised update, queued
        like an immediate ``submit`` but with the hyperparameters read at ``defer``."""
        grads = list(grads)
        checks.check_region(params, grads, self._where.__contains__, self._describe)
        parts = self._split_by_group(params, grads)
        return self._worker.submit(self._apply_region, parts, hypers, touches=params)

    @property
    def _promised_to(self) -> dict[Tensor, Deferred]:
        """Per parameter its deferred update not queued yet (tests count them)."""
        return self._promises.by_param

    def _hands_in_its_own_way(self) -> bool:
        """A subclass that overrides ``submit`` (ShardedAdamW reduces gradients across
        ranks into shards) keeps state only its own ``submit`` knows how to update: the
        paths that bypass ``submit`` (``defer``, device updates, resident state) decline."""
        return type(self).submit is not AdamW.submit

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

    def wait_params(self, params: Iterable[Tensor]) -> None:
        """Block until every queued update or accumulation touching ``params`` is done,
        deferred ones included (first queued, then done)."""
        params = list(params)
        self._promises.wait_for(params)
        self._worker.wait(params)

    def _wait_everything(self) -> None:
        """Every deferred update queued, then the worker's queue empty."""
        self._promises.wait_all()
        self._worker.wait_all()

    def release_grad_buffers(self) -> None:
        """Stop recycling gradient buffers (their memory goes once ``p.grad`` is cleared, or
        a held gradient consumed)."""
        self._wait_everything()
        self._grad_buffers.clear()
        self._narrow.release()

    def grad_buffer_bytes(self) -> int:
        """Host bytes of the gradient buffers this optimizer keeps: fp32 ``p.grad`` buffers
        and gradients held in their own precision (waits for queued work first)."""
        self._wait_everything()
        fp32 = sum(b.numel() * b.element_size() for b in self._grad_buffers.values())
        return fp32 + self._narrow.nbytes()

    # ---- weight shadows (optim/shadows.py) -----------------------------------------

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
        self._shadows.keep(params, shadows, self.state, self._describe)

    def has_shadow(self, p: Tensor) -> bool:
        return p in self._shadows

    def shadow_sources(self, params: Sequence[Tensor]) -> list[Tensor] | None:
        """The current shadows of all of ``params`` (``keep_shadows``), or None where any
        is missing or stale (the caller then reads the masters). Call after the
        parameters' updates were waited for."""
        return self._shadows.sources(params, self.state)

    # ---- torch.optim.Optimizer ------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Wait for submitted work, then apply what remains: gradients in ``p.grad`` (or held
        in their own precision) not yet applied (deferred by accumulation, clipping or the
        finiteness check, or left there by autograd), with clipping and the non-finite skip
        over all of them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fresh = self._promises.fresh()
        try:
            self._wait_for_step(fresh)
            work = self._pending_grads()
            self._leave_device([p for ps, _ in work.values() for p in ps])
            on_device = self._resident.pending()  # final gradients waiting on the device
            coef = None
            if (work or on_device) and (self.max_grad_norm is not None or self.skip_nonfinite):
                params, grads = self._in_group_order(work, on_device)
                norms = functional.to_host(self._grad_norms(params, grads))  # device ones too
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
            self._narrow.consumed()
            self._regions.clear()
            self._promises.end_step(fresh)
        return loss

    def _wait_for_step(self, fresh: list[Deferred]) -> None:
        """What step() waits for: everything, except the deferred updates of this step
        (final and immediate: step() has nothing to do for them, and waiting would keep the
        next forward from overlapping them)."""
        if not fresh:
            self._wait_everything()
            return
        skip = {p for d in fresh for p in d.params}
        self._promises.collect_older()
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
        self._narrow.zero_grad(set_to_none)
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
        self._norm_threads = None  # made again beside the new worker
        self._threads_arg = self.threads = threads

    @property
    def host_busy_s(self) -> float:
        """Seconds the host worker has spent running updates (and accumulations) since
        it started (``set_threads`` starts a new one): the observed counterpart of the cost
        model's host stream."""
        return self._worker.busy_s

    def waits_for_norm(self) -> bool:
        return self.max_grad_norm is not None or self.skip_nonfinite

    def updates_at_once(self) -> bool:
        return self._accumulating == 0 and not self.waits_for_norm()

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
        state["megatrain_options"] = {
            "max_grad_norm": self.max_grad_norm,
            "skip_nonfinite": self.skip_nonfinite,
            "threads": self._threads_arg,
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Called by load_state_dict (state and groups only) and by unpickling/deepcopy
        # (no worker yet): rebuild the runtime only in the second case.
        state = dict(state)
        options = state.pop("megatrain_options", None)
        super().__setstate__(state)
        if "_worker" not in self.__dict__:
            self._setup(**(options or {"max_grad_norm": None, "skip_nonfinite": False,
                                       "threads": None}))
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

