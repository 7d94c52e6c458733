"""Final gradients that wait for ``step()`` in the precision they were handed in.

With clipping or the non-finite check an update waits for the global norm, so its gradient
is kept until ``step()``. A caller may hand in bf16 gradients for fp32 parameters (the
runtime's gradient copies write fp32 by default, runtime/grad_copies.py); where such a
gradient is all the parameter gets this step (a final ``submit``/``submit_pieces``
outside ``accumulate()`` with no ``p.grad`` before it), keeping it in bf16 loses nothing:
its fp32 value is its exact upcast. So it waits here, 2 bytes a parameter instead of the
4 of an fp32 ``p.grad``, and ``step()`` upcasts it where it reads it: the norm
(``functional.grad_norm``) and the update (``functional.adamw_``, which multiplies by the
clip coefficient in fp32 after the upcast) see the bits the fp32 buffer would have held.

A gradient held here is not in ``p.grad`` (torch refuses a gradient of another dtype than
its parameter's): ``p.grad`` stays None, as on the path where the update runs at once.
``step()`` consumes it (applied, or dropped with a skipped step) and ``zero_grad()``
drops it (zeroes it in place with ``set_to_none=False``). Everything else (micro-batches
summed under ``accumulate()``, a gradient in the parameter's own dtype, a ``p.grad``
already present) keeps the fp32 ``p.grad`` path.

Buffers are the optimizer's, one per parameter, allocated on first use by the host
worker and recycled across steps like the fp32 ones, until ``release_grad_buffers()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatrain.memory.host_store import host_zeros_like


def narrower(g: Tensor, p: Tensor) -> bool:
    """Whether gradient ``g`` is in a lower floating-point precision than parameter ``p``."""
    return g.dtype.is_floating_point and g.dtype.itemsize < p.dtype.itemsize


class NarrowGrads:
    """Per parameter its held gradient of this step and its recycled buffer. Written by the
    host worker (``hold``/``start``/``forget``), read by the caller after waiting for it."""

    def __init__(self) -> None:
        self.held: dict[Tensor, Tensor] = {}  # param -> its gradient waiting for step()
        self.filling: dict[Tensor, Tensor] = {}  # param -> buffer its pieces are going into
        self._buffers: dict[Tensor, Tensor] = {}  # param -> recycled buffer

    def __contains__(self, p: Tensor) -> bool:
        return p in self.held

    def buffer(self, p: Tensor, dtype: torch.dtype) -> Tensor:
        """``p``'s recycled buffer in ``dtype``, laid out like ``p`` (so the update reads it
        without re-laying it), allocated on first use or when the dtype changed."""
        buf = self._buffers.get(p)
        if buf is None or buf.dtype != dtype:
            buf = self._buffers[p] = host_zeros_like(p, dtype)
        return buf

    def hold(self, p: Tensor, g: Tensor) -> Tensor:
        """Worker: keep a copy of ``g``, the whole final gradient of ``p``; returns it."""
        buf = self.held[p] = self.buffer(p, g.dtype).copy_(g)
        return buf

    def start(self, p: Tensor, dtype: torch.dtype) -> Tensor:
        """Worker: the buffer that ``p``'s pieces (in ``dtype``) are copied into, held from
        the first piece on (as ``p.grad`` is on the fp32 path)."""
        buf = self.held[p] = self.filling[p] = self.buffer(p, dtype)
        return buf

    def forget(self, p: Tensor) -> None:
        """Worker: ``p``'s gradient goes on in ``p.grad`` after all (a piece came in another
        dtype); what was copied so far was moved there by the caller."""
        self.held.pop(p, None)
        self.filling.pop(p, None)

    def take(self, p: Tensor) -> Tensor | None:
        """``p``'s held gradient, no longer held (summed into a ``p.grad`` set since)."""
        self.filling.pop(p, None)
        return self.held.pop(p, None)

    def zero_grad(self, set_to_none: bool) -> None:
        """``zero_grad()``: drop the held gradients, or zero them in place (then they stay
        pending, as a zeroed ``p.grad`` does)."""
        if set_to_none:
            self.held.clear()
            self.filling.clear()
        else:
            for buf in self.held.values():
                buf.zero_()

    def consumed(self) -> None:
        """``step()`` has queued (or skipped) the held gradients' updates."""
        self.held.clear()
        self.filling.clear()

    def release(self) -> None:
        """Stop recycling buffers (a held one goes once consumed)."""
        self._buffers.clear()

    def nbytes(self) -> int:
        """Host bytes of the buffers kept or held."""
        seen = {id(b): b for b in (*self._buffers.values(), *self.held.values())}
        return sum(b.numel() * b.element_size() for b in seen.values())
