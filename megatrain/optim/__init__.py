"""Host-side optimizers: fp32 master weights and moments stay in host memory."""

from megatrain.optim.adamw import AdamW

__all__ = ["AdamW"]
