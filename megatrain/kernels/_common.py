"""Shared launch helpers for megatrain's Triton kernels.

Triton decides at decoration time whether a kernel is compiled (GPU) or interpreted
(TRITON_INTERPRET=1, numpy on the host). Interpreted kernels run on CPU tensors, which is
how CI tests them; compiled kernels need CUDA tensors. The helpers below turn a wrong
pairing into a clear error instead of a crash inside the Triton launcher.
"""

from __future__ import annotations

import contextlib

import torch
import triton

try:  # present in every Triton 3.x; the import path is the stable one
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - very old triton
    InterpretedFunction = ()

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated while TRITON_INTERPRET=1 (runs on the host)."""
    return isinstance(kernel, InterpretedFunction)


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name} has dtype {t.dtype}; expected one of float32, bfloat16, float16"
        )


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"inputs must share one device, got {devices}")
    return first


def launch_context(kernel, device: torch.device):
    """Context for launching `kernel` on tensors of `device`.

    Raises when the pairing cannot work: a compiled kernel on CPU tensors needs
    TRITON_INTERPRET=1 set before megatrain.kernels is imported. On CUDA it makes the
    tensors' device current, since Triton launches on the current device.
    """
    if device.type == "cuda":
        return torch.cuda.device(device)
    if device.type == "cpu":
        if not is_interpreted(kernel):
            raise RuntimeError(
                f"{getattr(kernel, '__name__', kernel)} got CPU tensors but Triton compiles "
                "for the GPU; set TRITON_INTERPRET=1 before importing megatrain.kernels, or "
                "move the tensors to CUDA"
            )
        return contextlib.nullcontext()
    raise ValueError(f"megatrain kernels run on cuda (or cpu under TRITON_INTERPRET=1), "
                     f"got device {device}")


def row_block(n: int) -> int:
    """Power-of-two block covering `n` elements of one row (Triton blocks are pow2)."""
    return max(triton.next_power_of_2(n), 16)


def num_warps_for(block: int) -> int:
    """Warps for a one-row-per-program kernel: enough threads to cover the block."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4
