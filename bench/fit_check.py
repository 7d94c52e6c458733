"""Whether a system's state can fit before the model is built, and what it lacked when it
did not: a model that cannot fit is refused with numbers instead of OOM-killed minutes in,
and an allocation failure becomes one line for the row (where it ran out, what it asked
for, what it had and needed) instead of a traceback."""

from __future__ import annotations

import re

import child_phase
from host_memory import _mem_available, _status
from presets import _param_count

# Host RAM a system holds per parameter, checked against MemAvailable before the model is
# built, so a model that cannot fit is refused with numbers instead of OOM-killed minutes in.
# FSDP2: fp32 param + grad + m + v (16 B) plus the pinned allocator's power-of-two rounding:
# ~18 B/param at 1.3B (baseline row, RSS less the CUDA context). megatrain: fp32 master, m,
# v (12 B) plus gradient slabs: 12.5-13 predicted in NOTES.md (17.4 measured before the
# pinned-rounding fixes), so the check is a floor: passing it does not promise a fit.
# ZeRO-3 offload: fp32 master, m, v and gradients (16 B) plus the bf16 parameters it offloads.
HOST_STATE_BYTES_PER_PARAM = {"fsdp2-offload": 18, "zero3-offload": 18, "megatrain": 13}
GPU_STATE_BYTES_PER_PARAM = 16  # resident: fp32 weight, grad, AdamW m and v on the GPU


def _refuse_if_unfit(system: str, n_params: int, device) -> None:
    """SystemExit with the numbers when the system's state alone exceeds host RAM or, for
    the resident systems, the GPU: cheaper than building an 8B model to find out."""
    import torch

    g = 2**30
    if system in HOST_STATE_BYTES_PER_PARAM:
        need, have = HOST_STATE_BYTES_PER_PARAM[system] * n_params, _mem_available()
        if need > have:
            raise SystemExit(f"{system}: host state {HOST_STATE_BYTES_PER_PARAM[system]} B/param x "
                             f"{n_params / 1e9:.2f} G params = {need / g:.1f} GiB needed, "
                             f"{have / g:.1f} GiB host RAM available (MemAvailable)")
    if system in ("resident-compiled", "resident", "eager") and device.type == "cuda":
        need = GPU_STATE_BYTES_PER_PARAM * n_params
        have = torch.cuda.get_device_properties(device).total_memory
        if need > have:
            raise SystemExit(f"{system}: fp32 weights, grads and AdamW m, v alone are "
                             f"{GPU_STATE_BYTES_PER_PARAM} B/param x {n_params / 1e9:.2f} G params = "
                             f"{need / g:.1f} GiB, more than the GPU's {have / g:.1f} GiB")


def _out_of_memory(e: BaseException | None) -> tuple[str, BaseException] | None:
    """("gpu" or "host", the allocation failure) when `e` is one or wraps one (Dynamo wraps
    errors raised while compiling); else None."""
    import torch

    for _ in range(10):
        if e is None:
            return None
        if isinstance(e, torch.OutOfMemoryError) or "CUDA out of memory" in str(e):
            return "gpu", e
        if isinstance(e, MemoryError) or "can't allocate memory" in str(e):
            return "host", e
        e = e.__cause__ or e.__context__
    return None


def _oom_line(kind: str, e: BaseException, args, n_params: int | None = None) -> str:
    """One line for the row: where it ran out, what it asked for, what it had and needed.
    `n_params`: the model's parameters where the presets do not know it (bench/hf_train.py)."""
    import torch

    g = 2**30
    n = _param_count(args.model, args.layers) if n_params is None else n_params
    asked = re.search(r"(?:[Tt]ried to allocate|Unable to allocate) ([\d.]+ ?[KMGT]?i?B|\d+ bytes)", str(e))
    asked = f"asked for {asked.group(1)}, " if asked else ""
    if kind == "host":
        return (f"{args.system}: out of host memory in {child_phase.phase} ({asked}peak RSS "
                f"{_status('VmHWM') / g:.1f} GiB, MemAvailable now {_mem_available() / g:.1f} GiB; "
                f"{n / 1e9:.3g} G params)")
    device = torch.device(args.device)
    total = torch.cuda.get_device_properties(device).total_memory
    if args.system == "megatrain":
        need = f"gpu_memory={args.gpu_memory}"
    else:
        need = (f"weights, grads and AdamW m, v alone are {GPU_STATE_BYTES_PER_PARAM} B/param x "
                f"{n / 1e9:.3g} G params = {GPU_STATE_BYTES_PER_PARAM * n / g:.1f} GiB")
    return (f"{args.system}: out of GPU memory in {child_phase.phase} ({asked}peak allocated "
            f"{torch.cuda.max_memory_allocated(device) / g:.1f} GiB of {total / g:.1f} GiB; {need})")

