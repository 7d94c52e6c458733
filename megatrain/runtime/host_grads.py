"""Gradients that go to ``p.grad``: the op ``grad_to_host``, for parameters whose gradient no
megatrain optimizer takes from the backward (compiler/ops.py).

Unlike the hand-off to an optimizer (grad_routes.py), the graph itself gets the host
gradient back as a tensor and autograd accumulates it, so nothing is packed or handed
over: each gradient gets its own pinned buffer, filled from a device snapshot on the D2H
stream (grad_copies.copy_to_host). The snapshot's bytes count in the pool until its copy
completes; `finish`, at the end of backward, waits for every copy and casts to the
parameter's dtype where the gradient crossed in another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .grad_copies import copy_to_host
from .stream_context import StreamContext


@dataclass
class _Pending:
    device_grad: torch.Tensor | None  # the snapshot, until its copy completes
    staged: torch.Tensor
    out: torch.Tensor
    nbytes: int
    done: object = None


class HostGrads:
    def __init__(self, ctx: StreamContext):
        self._ctx = ctx
        self._pending: list[_Pending] = []

    def send(self, grad: torch.Tensor, param: torch.Tensor, param_id: int) -> torch.Tensor:
        """The host gradient of `param` (graph slot `param_id`): complete, in the
        parameter's dtype, once `finish` has returned."""
        if grad.device.type == "cpu":
            return grad.to(param.dtype, copy=True)
        self._retire_done()
        nbytes = grad.numel() * grad.element_size()
        self._ctx.pool.acquire(nbytes, f"gradient of parameter {param_id}")
        staged = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        done, snapshot = copy_to_host(self._ctx, staged, grad)
        out = staged if grad.dtype == param.dtype else torch.empty(grad.shape, dtype=param.dtype)
        self._pending.append(_Pending(snapshot, staged, out, nbytes, done))
        return out

    def _retire_done(self) -> None:
        for p in self._pending:
            if p.device_grad is not None and p.done.query():
                p.device_grad = None
                self._ctx.pool.release(p.nbytes)

    def finish(self) -> None:
        """End of backward: every gradient sent is on the host, in its parameter's dtype,
        and the snapshots' bytes are back in the pool."""
        for p in self._pending:
            p.done.synchronize()
            if p.device_grad is not None:
                p.device_grad = None
                self._ctx.pool.release(p.nbytes)
            if p.out is not p.staged:
                p.out.copy_(p.staged)
        self._pending.clear()
