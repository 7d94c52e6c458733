"""Start-up under torchrun: read the launcher's environment, initialise the process group.

torchrun (``torch.distributed.run``) starts one process per rank with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. A plain
``python script.py`` has none of them: then everything here reports one rank and does
nothing, so the same script runs alone or under torchrun.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import as_timedelta


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: its rank, the world size, its compute device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    initialized_here: bool = False  # init_from_env created the default group

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, writes metrics and saves checkpoints."""
        return self.rank == 0


def env_ranks() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun's environment, or None outside it."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        world = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise ValueError(
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}, RANK={os.environ.get('RANK')!r}, "
            f"LOCAL_RANK={os.environ.get('LOCAL_RANK')!r}: must be whole numbers (set by "
            "torchrun; unset them to run one process)"
        ) from None
    if not (world >= 1 and 0 <= rank < world and local >= 0):
        raise ValueError(f"RANK={rank}, WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    return rank, world, local


def default_timeout() -> datetime.timedelta | None:
    """``$MEGATRAIN_DIST_TIMEOUT`` seconds, else None (torch's default)."""
    raw = os.environ.get("MEGATRAIN_DIST_TIMEOUT")
    if not raw:
        return None
    try:
        return as_timedelta(float(raw))
    except ValueError:
        raise ValueError(f"MEGATRAIN_DIST_TIMEOUT={raw!r}: must be a positive number of "
                         "seconds") from None


def resolve_device(device: str | torch.device | None, local_rank: int, world: int) -> torch.device:
    """The compute device of this rank: ``cuda`` means ``cuda:LOCAL_RANK``; ``None`` means
    CUDA when available, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank if world > 1 else torch.cuda.current_device())
    return dev


def init_from_env(device: str | torch.device | None = None,
                  timeout: float | datetime.timedelta | None = None) -> DistInfo:
    """Under torchrun, initialise the default process group (NCCL for a CUDA device, which
    becomes ``cuda:LOCAL_RANK``; gloo for the CPU) unless it exists; outside torchrun return
    a one-rank DistInfo. ``timeout`` (seconds) bounds how long a collective waits for a
    dead or stuck peer; default ``$MEGATRAIN_DIST_TIMEOUT`` or torch's default."""
    ranks = env_ranks()
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = ranks[2] if ranks else rank
        return DistInfo(rank, world, local, resolve_device(device, local, world),
                        str(dist.get_backend()), False)
    if ranks is None or ranks[1] == 1:
        return DistInfo(device=resolve_device(device, 0, 1))
    rank, world, local = ranks
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    dev = resolve_device(device, local, world)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    td = as_timedelta(timeout) if timeout is not None else default_timeout()
    dist.init_process_group(backend, timeout=td, rank=rank, world_size=world)
    return DistInfo(rank, world, local, dev, backend, True)


def shutdown(info: DistInfo) -> None:
    """Destroy the default group if :func:`init_from_env` created it."""
    if info.initialized_here and dist.is_initialized():
        dist.destroy_process_group()
