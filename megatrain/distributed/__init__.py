"""Data parallelism over torch.distributed, with the host optimizer sharded across ranks.

Launch one process per device with ``torchrun --nproc-per-node N script.py`` (or
``torchrun ... -m megatrain train``). Every rank builds the same model on the CPU, runs the
same ``torch.compile(model, backend="megatrain")`` on its own device and its own share of
the data, and steps one :class:`ShardedAdamW`; the optimizer averages each region's
gradients over the ranks as the runtime hands them in, updates only this rank's shard of
them (m and v for 1/N of the elements), and all-gathers the new weights before the next
step fetches them.

- :mod:`.launch`: torchrun environment -> process group (gloo on CPU, NCCL on CUDA).
- :mod:`.optimizer`: :class:`ShardedAdamW`.
- :mod:`.shards`: the per-parameter split and the packed form of a region.
- :mod:`.comm`: the collectives, device-agnostic (reduce-scatter with a gloo fallback),
  and :class:`RankFailureError`.
"""

from .comm import RankFailureError, reduce_scatter_sum
from .launch import DistInfo, env_ranks, init_from_env, shutdown
from .optimizer import ShardedAdamW

__all__ = [
    "DistInfo",
    "RankFailureError",
    "ShardedAdamW",
    "env_ranks",
    "init_from_env",
    "reduce_scatter_sum",
    "shutdown",
]
