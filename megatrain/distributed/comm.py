"""The collectives the sharded optimizer needs, on host tensors, over any torch.distributed
backend, with every failure turned into one clear error.

The optimizer keeps everything in host memory; the backend decides where a collective's
tensors must live: gloo (and MPI) take CPU tensors directly; NCCL takes only CUDA tensors,
so there each collective is staged through the GPU in column blocks of bounded size (a
pinned host buffer, an H2D copy, the collective, a D2H copy, all on one side stream).

Reduce-scatter: NCCL has it natively (``reduce_scatter_tensor``, ``reduce_scatter_single``
in newer torch); gloo gained it only in recent torch. :func:`reduce_scatter_sum` uses the
native op when :func:`has_native_reduce_scatter` found it and otherwise an all-reduce of the
packed buffer followed by taking this rank's block: twice the traffic, same result.

Failure: a collective whose peer died (gloo: the connection closes, usually within
milliseconds) or that exceeds the process group's timeout raises inside torch. Every such
error is re-raised as :class:`RankFailureError` naming the operation, this rank, the world
size and the timeout; after the first one the :class:`Collectives` object refuses all further
work at once, so later regions fail fast instead of each waiting out the timeout.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.13 renamed the tensor forms; 2.11 has only the old names.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RankFailureError(RuntimeError):
    """A collective of megatrain's data-parallel optimizer failed or timed out: another rank
    died, hung, or stopped running the same steps. This rank cannot continue."""


def has_native_reduce_scatter(group, device: torch.device) -> bool:
    """Whether ``group``'s backend implements reduce-scatter. A collective: every rank of
    the group must call it. A backend without the op refuses it locally and identically on
    every rank ("... does not support _reduce_scatter_base") before any communication, so
    the ranks agree on the answer without talking."""
    world = dist.get_world_size(group)
    out = torch.zeros(1, device=device)
    try:
        _REDUCE_SCATTER(out, torch.ones(world, device=device), group=group)
    except (RuntimeError, NotImplementedError) as e:
        if "not support" in str(e) or isinstance(e, NotImplementedError):
            return False
        raise
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return True


def reduce_scatter_sum(output: Tensor, input: Tensor, group, native: bool) -> None:
    """``output`` = this rank's block of the element-wise sum over ranks of ``input``
    (``input`` holds world-size blocks of ``output.numel()`` elements, rank-major).

    With ``native`` False (a backend without reduce-scatter, e.g. gloo before torch 2.x),
    all-reduce ``input`` in place and copy this rank's block: ``input`` is clobbered."""
    if native:
        _REDUCE_SCATTER(output, input, group=group)
        return
    dist.all_reduce(input, group=group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    output.copy_(input.view(world, -1)[rank])


def all_gather(output: Tensor, input: Tensor, group) -> None:
    """``output`` (world x ``input.numel()`` elements, rank-major) = every rank's ``input``."""
    _ALL_GATHER(output, input, group=group)


def backend_takes_cpu_tensors(group) -> bool:
    """gloo and MPI take CPU tensors; so does a combined backend such as
    "cpu:gloo,cuda:nccl". NCCL alone takes only CUDA tensors."""
    name = str(dist.get_backend(group)).lower()
    return any(b in name for b in ("gloo", "mpi", "cpu:")) or name == "fake"


class Collectives:
    """Host-tensor collectives over ``group``; see the module docstring.

    Args:
        group: the process group (the sharded optimizer's own, so that its collectives,
            issued from the optimizer's worker thread, never interleave with the user's).
        device: where the backend needs tensors: CPU for gloo, a CUDA device for NCCL.
        timeout_s: the group's timeout, for messages only.
        block_numel: for a CUDA device, the most elements per rank a staged collective
            moves at once (device staging memory is ``(world + 1) * block_numel * 4`` B).
    """

    def __init__(self, group, device: torch.device, timeout_s: float | None,
                 block_numel: int = 1 << 24) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = torch.device(device)
        self.staged = self.device.type != "cpu"
        self.timeout_s = timeout_s
        self.block_numel = int(block_numel)
        self.backend = str(dist.get_backend(group))
        self.failed: str | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.native_reduce_scatter = self._guard(
            "the reduce-scatter capability probe",
            lambda: self._on_device(lambda: has_native_reduce_scatter(group, self.device)),
        )

    # ---- the operations (host tensors in, host tensors out) ---------------------------

    def reduce_scatter_sum(self, output: Tensor, input: Tensor, what: str) -> None:
        """``output`` (K) = this rank's block of the sum over ranks of ``input`` (world x K,
        contiguous; clobbered)."""
        if not self.staged:
            self._guard(what, lambda: reduce_scatter_sum(output, input, self.group,
                                                         self.native_reduce_scatter))
            return
        rows = input.view(self.world, -1)

        def block(c0: int, c1: int) -> None:
            dev_in = rows[:, c0:c1].to(self.device, non_blocking=True)
            dev_out = torch.empty(c1 - c0, device=self.device)
            reduce_scatter_sum(dev_out, dev_in, self.group, self.native_reduce_scatter)
            output[c0:c1].copy_(dev_out, non_blocking=True)

        self._guard(what, lambda: self._blocks(output.numel(), block))

    def all_gather(self, output: Tensor, input: Tensor, what: str) -> None:
        """``output`` (world x K) = every rank's ``input`` (K)."""
        if not self.staged:
            self._guard(what, lambda: all_gather(output, input, self.group))
            return
        rows = output.view(self.world, -1)

        def block(c0: int, c1: int) -> None:
            dev_in = input[c0:c1].to(self.device, non_blocking=True)
            dev_out = torch.empty(self.world, c1 - c0, device=self.device)
            all_gather(dev_out, dev_in, self.group)
            rows[:, c0:c1].copy_(dev_out, non_blocking=True)

        self._guard(what, lambda: self._blocks(input.numel(), block))

    def all_reduce_sum(self, tensor: Tensor, what: str) -> None:
        """In place, for small tensors (norms, flags)."""
        if not self.staged:
            self._guard(what, lambda: dist.all_reduce(tensor, group=self.group))
            return

        def run() -> None:
            dev = tensor.to(self.device)
            dist.all_reduce(dev, group=self.group)
            tensor.copy_(dev)

        self._guard(what, lambda: self._on_device(run))

    def broadcast(self, tensor: Tensor, src: int, what: str) -> None:
        """In place, from group rank ``src``."""
        if not self.staged:
            self._guard(what, lambda: dist.broadcast(tensor, group_src(self.group, src),
                                                     group=self.group))
            return
        flat = tensor.view(-1)

        def block(c0: int, c1: int) -> None:
            dev = flat[c0:c1].to(self.device, non_blocking=True)
            dist.broadcast(dev, group_src(self.group, src), group=self.group)
            flat[c0:c1].copy_(dev, non_blocking=True)

        self._guard(what, lambda: self._blocks(flat.numel(), block))

    # ---- internals -------------------------------------------------------------------

    def _on_device(self, fn: Callable[[], object]) -> object:
        if self._stream is None:
            return fn()
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            out = fn()
            self._stream.synchronize()  # host results complete before anyone reads them
        return out

    def _blocks(self, n: int, block: Callable[[int, int], None]) -> None:
        def run() -> None:
            for c0 in range(0, max(n, 1), self.block_numel):
                block(c0, min(n, c0 + self.block_numel))

        self._on_device(run)

    def _guard(self, what: str, fn: Callable[[], object]) -> object:
        if self.failed is not None:
            raise RankFailureError(
                f"megatrain data parallel: {what} not attempted on rank {self.rank} of "
                f"{self.world}: an earlier collective failed ({self.failed})"
            )
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every failure here ends the run the same way
            timeout = "the process group's" if self.timeout_s is None else f"{self.timeout_s:g} s"
            self.failed = f"{what}: {type(e).__name__}: {_first_line(e)}"
            raise RankFailureError(
                f"megatrain data parallel: {what} failed on rank {self.rank} of {self.world} "
                f"({self.backend}, timeout {timeout}): {type(e).__name__}: {_first_line(e)}. "
                "Another rank most likely died (see its log), hung, or ran a different step "
                "or model; this rank cannot continue. Restart all ranks, e.g. from the last "
                "checkpoint."
            ) from e


def group_src(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (broadcast takes global ranks)."""
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def as_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return datetime.timedelta(seconds=float(timeout))
