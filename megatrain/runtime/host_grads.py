"""Gradients that go to ``p.grad``: the op ``grad_to_host``, for parameters whose gradient no
megatrain optimizer takes from the backward (compiler/ops.py).

Unlike the hand-off to an optimizer (grad_routes.py), the graph itself gets the host
gradient back as a tensor and autograd accumulates it, so nothing is packed or handed
over: each gradient gets its own pinned buffer, filled from a device snapshot on the D2H
stream (grad_copies.copy_to_host). The snapshot's bytes count in the pool until its copy
completes; `finish`, at the end of backward (the graph's drain, before it returns its
gradients to autograd), waits for every copy and casts to the parameter's dtype where the
gradient crossed in another.

One exception to "complete at the end": a weight read by several regions of one graph (a
tied embedding) gets one gradient piece per region, and the graph adds the host pieces
itself, as soon as the later one is returned. So a second piece of the same slot completes
the copies of its earlier pieces and its own before it is returned: a synchronous copy, for
tied weights only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .grad_copies import copy_to_host
from .stream_context import StreamContext


@dataclass
class _Pending:
    param_id: int
    device_grad: torch.Tensor | None  # the snapshot, until its copy completes
    staged: torch.Tensor
    out: torch.Tensor
    nbytes: int
    done: object = None
    complete: bool = False  # copied and cast: `out` holds the gradient


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
        staged = _pinned(grad.shape, grad.dtype)
        done, snapshot = copy_to_host(self._ctx, staged, grad)
        out = staged if grad.dtype == param.dtype else torch.empty(grad.shape, dtype=param.dtype)
        earlier = [p for p in self._pending if p.param_id == param_id]
        self._pending.append(_Pending(param_id, snapshot, staged, out, nbytes, done))
        if earlier:  # the graph adds this piece to the earlier ones when it is returned
            for p in (*earlier, self._pending[-1]):
                self._complete(p)
        return out

    def _retire_done(self) -> None:
        for p in self._pending:
            if p.device_grad is not None and p.done.query():
                p.device_grad = None
                self._ctx.pool.release(p.nbytes)

    def _complete(self, p: _Pending) -> None:
        """Wait for `p`'s copy, give its snapshot's bytes back and cast into `out`."""
        if p.complete:
            return
        p.done.synchronize()
        if p.device_grad is not None:
            p.device_grad = None
            self._ctx.pool.release(p.nbytes)
        if p.out is not p.staged:
            p.out.copy_(p.staged)
        p.complete = True

    def finish(self) -> None:
        """End of backward: every gradient sent is on the host, in its parameter's dtype,
        and the snapshots' bytes are back in the pool."""
        for p in self._pending:
            self._complete(p)
        self._pending.clear()


def _pinned(shape, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host buffer the D2H stream copies into asynchronously."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)
