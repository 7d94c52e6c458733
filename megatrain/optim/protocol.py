"""What the runtime may ask of the optimizer that owns a parameter, declared once.

The backend finds a parameter's owner through `registry.owner_of`; every owner is a
`GradientConsumer` (checked when it registers), so the runtime calls these methods without
probing for them. `megatrain.AdamW` and `megatrain.ShardedAdamW` implement it;
`tests/optim/test_protocol.py` holds them to the signatures below.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class Declined:
    """Why the optimizer did not take a resident update: the gradients must wait on the
    device and no buffer is lent yet (``needs_buffers``: lend them with
    give_resident_buffers and hand the gradients in again), or a reason to take the host
    path instead."""

    reason: str
    needs_buffers: bool = False


@runtime_checkable
class GradientConsumer(Protocol):
    # -- gradients in (the fast path: no p.grad) -----------------------------------------
    def submit(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> Future:
        """Take one region's final host gradients and update it (asynchronously)."""

    def submit_pieces(self, pieces: Sequence[tuple[Tensor, int, Tensor]]) -> Future:
        """Take (param, offset, flat piece) gradients as a ring chunk fills."""

    def defer(self, params: Sequence[Tensor]) -> Any:
        """Promise these regions' updates for later (the backlog), or None to decline."""

    def wait_params(self, params: Iterable[Tensor]) -> None:
        """Block until every pending update of these parameters is done."""

    def prefer_threads(self, threads: int) -> None:
        """Use this many host threads unless the user chose a number."""

    def updates_at_once(self) -> bool:
        """Whether a final gradient handed in now is applied as it arrives: not summed for a
        later micro-batch, not held for ``step()``. Only such updates' rate is comparable
        with the cost model's (runtime/host_rate.py)."""

    def waits_for_norm(self) -> bool:
        """Whether a final gradient's update waits for ``step()`` (clipping or a non-finite
        check needs every gradient first): the planner then times the host's updates after
        the backward, in the next forward's order, instead of beside it."""

    # -- updates on the compute device -------------------------------------------------
    def device_update_blocker(self, params: Iterable[Tensor] = ()) -> str | None:
        """Why these parameters cannot be updated on the device (None: they can)."""

    def submit_on_device(self, params: Sequence[Tensor], device_grads: Sequence[Tensor],
                         device: torch.device | str, copy_streams: Sequence[Any] | None = None, *,
                         ready: Any = None) -> Any:
        """Update one region on the device from gradients already there."""

    # -- state resident on the compute device ------------------------------------------
    def make_resident(self, params: Sequence[Tensor], device: torch.device | str) -> str | None:
        """Move these parameters' master and moments to the device (a reason if not)."""

    def is_resident(self, p: Tensor) -> bool: ...

    def resident_master(self, p: Tensor) -> Tensor | None: ...

    def resident_ready(self, p: Tensor) -> Any: ...

    def update_resident(self, params: Sequence[Tensor], grads: Sequence[Tensor],
                        scratch: Tensor | None = None, last_piece: bool = True) -> Declined | None:
        """Update resident parameters on the device (None), or say why not; a piece that is
        not the last of its gradient this backward waits in the lent buffers."""

    def give_resident_buffers(self, params: Sequence[Tensor], buffers: Sequence[Tensor]) -> None: ...

    def flush_resident(self, params: Iterable[Tensor]) -> None:
        """Bring these parameters' newest values home (they stay resident)."""

    def drop_resident(self, params: Iterable[Tensor] | None = None) -> None:
        """Bring these parameters' state home for good."""

    # -- the bf16 weight shadow --------------------------------------------------------
    def keep_shadows(self, params: Sequence[Tensor], shadows: Sequence[Tensor]) -> None: ...

    def has_shadow(self, p: Tensor) -> bool: ...

    def shadow_sources(self, params: Sequence[Tensor]) -> list[Tensor] | None: ...
