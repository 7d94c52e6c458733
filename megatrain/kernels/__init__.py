"""megatrain's Triton kernels, each a `megatrain::<op>` custom op with a pure-torch reference.

Importing this package registers the ops. Kernels run on CUDA tensors, or on CPU tensors
when TRITON_INTERPRET=1 was set before the import (how CI tests them).
"""

from megatrain.kernels.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from megatrain.kernels.rmsnorm import rms_norm, rms_norm_reference
from megatrain.kernels.rope import apply_rotary, apply_rotary_reference
from megatrain.kernels.swiglu import swiglu, swiglu_reference

__all__ = [
    "apply_rotary",
    "apply_rotary_reference",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_reference",
    "rms_norm",
    "rms_norm_reference",
    "swiglu",
    "swiglu_reference",
]
