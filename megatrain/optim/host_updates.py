"""The host update path of megatrain.AdamW: what runs on the host worker, and what step()
queues there in which order.

Two halves, one concern (gradients meeting fp32 state in host memory):

- Worker tasks, run on the optimizer's one host thread (optim/engine.py): sum gradients
  into ``p.grad`` like autograd would (``_accumulate_region``/``_accumulate_pieces``; a
  final low-precision gradient with nothing to sum waits in its own dtype instead,
  optim/narrow_grads.py), or
  apply them at once (``_apply_region``/``_apply_pieces``), through ``_update``, the one
  place the fused kernel (optim/functional.py) is called with the moments and step counts
  (``_state_of``) and weight shadows (optim/shadows.py) of the host path.
- step()'s plan: which gradients still wait in ``p.grad`` or held in their own dtype
  (``_pending_grads``), their norms
  for clipping and the non-finite check (``_grad_norms``, ``_skip``, ``_in_group_order``),
  and the order the updates are queued in (``_update_order``: the next forward's fetch
  order).

Why a mixin and not a helper object: these are the optimizer's own methods to tests and
subclasses (ShardedAdamW calls ``_accumulate_region``, ``_pending_grads`` and ``_hyper``;
tests wrap ``_update`` on an instance and ``_apply_region`` on the class), and they read
the optimizer's param groups, state and per-step bookkeeping (set in ``AdamW._setup``)
on every call. :class:`HostUpdates` holds no state of its own.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from megatrain.memory.host_store import host_zeros_like
from megatrain.optim import checks, functional
from megatrain.optim.engine import HostWorker
from megatrain.optim.narrow_grads import NarrowGrads, narrower
from megatrain.optim.norms import NormThreads, norm_threads_for, resolved
from megatrain.optim.shadows import Shadows

# One group's tensors, as the fused kernel takes them: (params, grads).
Parts = dict[int, tuple[list[Tensor], list[Tensor]]]


class HostUpdates:
    """Mixed into megatrain.AdamW (see the module docstring); uses its ``param_groups``,
    ``state``, ``_where``, ``_describe``/``_label``, ``_hands_in_its_own_way`` and the
    bookkeeping below."""

    param_groups: list[dict[str, Any]]
    state: Any
    skipped_steps: int
    _worker: HostWorker
    _where: dict[Tensor, tuple[int, int]]  # param -> (group, index)
    _final: dict[Tensor, bool]  # final grad submitted this step -> applied?
    _norms: dict[Tensor, tuple[Tensor, int, Tensor | Future]]  # grad, version, norm
    _norm_threads: NormThreads | None  # made at the first held gradient's norm
    _grad_buffers: dict[Tensor, Tensor]
    _regions: list[list[Tensor]]  # streamed final submits waiting for step(), in order
    _piece_fresh: dict[Tensor, bool]  # param -> p.grad started empty (worker)
    _narrow: NarrowGrads  # final gradients waiting for step() in their own dtype
    _shadows: Shadows

    # ---- gradients, grouped for the kernel ----------------------------------------

    @staticmethod
    def _hyper(group: dict[str, Any]) -> dict[str, float]:
        beta1, beta2 = group["betas"]
        return {
            "lr": float(group["lr"]),
            "beta1": float(beta1),
            "beta2": float(beta2),
            "weight_decay": float(group["weight_decay"]),
            "eps": float(group["eps"]),
        }

    def _split_by_group(self, params: list[Tensor], grads: list[Tensor]) -> Parts:
        parts: Parts = {}
        for p, g in zip(params, grads):
            ps, gs = parts.setdefault(self._where[p][0], ([], []))
            ps.append(p)
            gs.append(g)
        return parts

    # ---- step()'s plan --------------------------------------------------------------

    def _pending_grads(self) -> Parts:
        """Per group, the params whose ``p.grad`` (or held gradient, optim/narrow_grads.py)
        is still to be applied, in group order. A ``p.grad`` set after a gradient was held
        (autograd's) is summed with it, as autograd would have summed into the fp32 buffer."""
        work: Parts = {}
        held = self._narrow.held
        for gi, group in enumerate(self.param_groups):
            ps, gs = [], []
            for i, p in enumerate(group["params"]):
                g = p.grad
                if self._final.get(p, False):
                    continue
                if p in held:
                    g = held[p] if g is None else g.add_(self._narrow.take(p))
                if g is None:
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

    def _update_order(self, work: Parts) -> list[tuple[int, list[Tensor], list[Tensor]]]:
        """(group, params, grads) tasks. Gradients that came from the runtime are updated a
        region at a time, last-submitted region first: that is the order in which the next
        forward fetches them, so each fetch waits only for its own region's update."""
        grad_of = {p: (gi, g) for gi, (ps, gs) in work.items() for p, g in zip(ps, gs)}
        tasks = []
        for region in reversed(self._regions):
            by_group: Parts = {}
            for p in region:
                if p in grad_of:
                    gi, g = grad_of.pop(p)
                    ps, gs = by_group.setdefault(gi, ([], []))
                    ps.append(p)
                    gs.append(g)
            tasks += [(gi, ps, gs) for gi, (ps, gs) in by_group.items()]
        rest: Parts = {}
        for p, (gi, g) in grad_of.items():  # p.grad left by autograd: one task per group
            ps, gs = rest.setdefault(gi, ([], []))
            ps.append(p)
            gs.append(g)
        return tasks + [(gi, ps, gs) for gi, (ps, gs) in sorted(rest.items())]

    def _in_group_order(self, work: Parts,
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

    def _grad_norms(self, params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        """Per-tensor 2-norms, reusing those the worker computed when a final gradient
        arrived through submit() (valid while p.grad is that same, unmodified tensor)."""
        norms: list[Tensor | None] = []
        missing: list[int] = []
        for k, (p, g) in enumerate(zip(params, grads)):
            cached = self._norms.get(p)
            if cached is not None and cached[0] is g and cached[1] == g._version:
                norms.append(resolved(cached[2]))
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

    # ---- worker tasks ---------------------------------------------------------------

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
        """Worker: clip (in place, like clip_grad_norm_) and apply one AdamW step. A
        gradient in a lower precision than its parameter (held, optim/narrow_grads.py) is
        clipped in the parameter's precision after its upcast, inside the update."""
        laid = []
        for p, g in zip(params, grads):
            if g.dtype != p.dtype and not functional.same_layout(g, p):
                g = functional.like_param(g, p)  # an upcast copy: clipped below, like fp32
            if coef is not None and g.dtype == p.dtype:
                g.mul_(coef)
            laid.append(functional.like_param(g, p))
        exp_avgs, exp_avg_sqs, steps = self._state_of(params)
        shadows = [self._shadows.get(p) for p in params] if self._shadows else None
        functional.adamw_(params, laid, exp_avgs, exp_avg_sqs, steps, shadows, coef, **hyper)
        if shadows:
            self._shadows.mark(params, self.state)

    def _apply_region(self, parts: Parts, hypers: dict[int, dict[str, float]]) -> None:
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
            self._shadows.mark((p for p, *_ in items), self.state)

    def _accumulate_pieces(self, work: dict[int, list[tuple]], final: bool) -> None:
        """Worker: pieces summed into p.grad like ``_accumulate_region`` (a parameter whose
        p.grad was empty at its first piece gets its pieces copied, not added; final
        low-precision ones into a held buffer of their dtype, as ``_holds_narrow`` says)."""
        narrow = self._narrow
        for items in work.values():
            for p, start, g, first, last in items:
                if first:
                    self._piece_fresh[p] = p.grad is None
                    if final and self._holds_narrow(p, g):
                        narrow.start(p, g.dtype)
                    elif p.grad is None:
                        p.grad = self._grad_buffer(p)
                end = start + g.numel()
                buf = narrow.filling.get(p)
                if buf is not None and g.dtype != buf.dtype:
                    # a piece in another dtype: go on in fp32 from the exact upcast so far
                    p.grad = self._grad_buffer(p)
                    p.grad.view(-1)[:start].copy_(buf.view(-1)[:start])
                    narrow.forget(p)
                    buf = None
                if buf is not None:
                    buf.view(-1)[start:end].copy_(g)
                else:
                    dst = p.grad.view(-1)[start:end]
                    dst.copy_(g) if self._piece_fresh[p] else dst.add_(g)
                if last:
                    del self._piece_fresh[p]
                    narrow.filling.pop(p, None)
                    if final:
                        grad = p.grad if buf is None else buf
                        norm = functional.grad_norm(grad) if buf is None else self._held_norm(buf)
                        self._norms[p] = (grad, grad._version, norm)

    def _accumulate_region(self, params: list[Tensor], grads: list[Tensor], final: bool) -> None:
        """Worker: sum into p.grad like autograd (copy when empty, else add: the same bits
        as eager accumulation); for a final gradient also take its norm now, overlapped
        with the caller's compute, for clipping or the finiteness check in step()."""
        for p, g in zip(params, grads):
            if final and self._holds_narrow(p, g):
                held = self._narrow.hold(p, g)
                self._norms[p] = (held, held._version, self._held_norm(held))
                continue
            if p.grad is None:
                p.grad = self._grad_buffer(p).copy_(g)
            else:
                p.grad.add_(g)
            if final:
                self._norms[p] = (p.grad, p.grad._version, functional.grad_norm(p.grad))

    def _held_norm(self, held: Tensor) -> Tensor | Future:
        """Worker: the norm of a held 16-bit gradient, reduced on a norm thread beside
        this one (optim/norms.py); ``_grad_norms`` resolves it."""
        if self._norm_threads is None:
            self._norm_threads = NormThreads(norm_threads_for(self._worker.threads))
        return self._norm_threads.norm(held)

    def _holds_narrow(self, p: Tensor, g: Tensor) -> bool:
        """Worker, for a final gradient: whether it waits for step() in its own, lower
        precision (optim/narrow_grads.py): nothing summed for ``p`` this step (no p.grad),
        and an optimizer whose step() reads held gradients (not a subclass's own way)."""
        return p.grad is None and narrower(g, p) and not self._hands_in_its_own_way()

    def _has_grad(self, p: Tensor) -> bool:
        """A gradient of ``p`` waits on the host: in p.grad, or held."""
        return p.grad is not None or p in self._narrow

    def _grad_buffer(self, p: Tensor) -> Tensor:
        """Worker: ``p``'s recycled gradient buffer, allocated on first use (the 4 bytes per
        parameter that exist only where an update has to wait)."""
        buf = self._grad_buffers.get(p)
        if buf is None:
            buf = self._grad_buffers[p] = host_zeros_like(p)
        return buf
