"""megatrain: train models far larger than GPU memory on one GPU.

    step = torch.compile(model, backend="megatrain", options={"device": "cuda", "gpu_memory": "16GiB"})

fp32 master weights live in host memory; each region's weights stream to the device just
before use; gradients stream back. See README.md.
"""

from .compiler import ops as _ops  # noqa: F401  (registers the megatrain:: custom ops)
from . import config
from .compiler.backend import megatrain_backend
from .compiler.explain import explain
from .optim import AdamW
from .distributed import ShardedAdamW

__all__ = ["AdamW", "ShardedAdamW", "config", "explain", "megatrain_backend"]
__version__ = "0.1.0"
