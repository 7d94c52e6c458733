"""`megatrain train` under torchrun: one process per device, data parallel.

    torchrun --nproc-per-node 2 -m megatrain train --model 1b ...

What changes with WORLD_SIZE > 1 (torchrun's environment; without it nothing here acts):

- the default process group is created (NCCL on CUDA, each rank on ``cuda:LOCAL_RANK``;
  gloo on the CPU), with ``$MEGATRAIN_DIST_TIMEOUT`` seconds as its timeout if set;
- ``--batch-tokens`` stays the global batch: every micro-batch's sequences are split evenly
  over the ranks (the data position is the global one, so a checkpoint resumes with any
  number of ranks);
- the optimizer is :class:`megatrain.ShardedAdamW` (state split across ranks);
- the logged loss is the mean over ranks; only rank 0 prints, writes metrics, plots and
  saves checkpoints (the optimizer state is gathered to it for that); every rank resumes
  from the same checkpoint;
- a refusal on any rank before training starts (e.g. host memory) stops every rank with
  that rank's message, printed once.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import RefusedError


def start(cfg):
    """Initialise data parallelism for `cfg` (resolved) if torchrun asked for it; adjust
    ``cfg.device`` to this rank's device. Returns a DistInfo (one rank outside torchrun)."""
    from megatrain.distributed import DistInfo, env_ranks, init_from_env

    try:
        ranks = env_ranks()
    except ValueError as e:
        raise RefusedError(str(e)) from None
    if ranks is None or ranks[1] == 1:
        return DistInfo(device=torch.device(cfg.device))
    rank, world, local = ranks
    if cfg.compile != "megatrain":
        raise RefusedError(
            f"--compile {cfg.compile} under torchrun (WORLD_SIZE={world}): data parallelism in "
            "`megatrain train` is megatrain's (--compile megatrain, the host optimizer sharded "
            "across ranks); for plain torch use torch DDP in your own script"
        )
    dev = torch.device(cfg.device)
    if dev.type == "cuda":
        if dev.index not in (None, local):
            raise RefusedError(
                f"--device {cfg.device} under torchrun: each rank uses cuda:LOCAL_RANK (this "
                f"is rank {rank}, LOCAL_RANK {local}); pass --device cuda"
            )
        if local >= torch.cuda.device_count():
            raise RefusedError(
                f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s) are visible; "
                "start at most that many processes per node (--nproc-per-node)"
            )
        cfg.device = f"cuda:{local}"
    return init_from_env(cfg.device)


def check_batch(micro_batch: int, cfg, info) -> None:
    if micro_batch % info.world_size:
        per = cfg.seq * cfg.grad_accum * info.world_size
        raise RefusedError(
            f"--batch-tokens {cfg.batch_tokens}: each micro-batch of {micro_batch} sequences "
            f"must split evenly over {info.world_size} ranks; use a multiple of --seq x "
            f"--grad-accum x ranks = {per}, e.g. --batch-tokens "
            f"{max(1, round(cfg.batch_tokens / per)) * per}"
        )


class Agreement:
    """Ranks refuse together: each rank either reaches :meth:`agree` (ready to start work)
    or calls :meth:`refuse` with its message; if any refused, every rank raises
    RefusedError with the first refusing rank's message."""

    def __init__(self, info) -> None:
        self.info = info
        self.done = not info.distributed

    def _exchange(self, message: str | None) -> None:
        self.done = True
        messages: list = [None] * self.info.world_size
        dist.all_gather_object(messages, message)
        for rank, msg in enumerate(messages):
            if msg is not None:
                raise RefusedError(msg if rank == self.info.rank else f"rank {rank}: {msg}")

    def agree(self) -> None:
        if not self.done:
            self._exchange(None)

    def refuse(self, error: RefusedError) -> None:
        """Called with this rank's refusal; raises the agreed refusal (maybe another rank's)."""
        if self.done:
            raise error
        self._exchange(str(error))


def mean_over_ranks(value: float, info) -> float:
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / info.world_size


class NullWriter:
    """The metrics writer of ranks other than 0."""

    def write(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


class SavedState:
    """An optimizer stand-in for checkpoint.save_checkpoint: the gathered state."""

    def __init__(self, state: dict) -> None:
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def quiet_rank() -> bool:
    """True on ranks other than 0 under torchrun (they print nothing but errors)."""
    return os.environ.get("RANK", "0") != "0" and int(os.environ.get("WORLD_SIZE", "1")) > 1
