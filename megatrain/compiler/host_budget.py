"""What a compiled graph adds to host memory, held to the ``host_memory`` option before
the first step runs.

The model's own fp32 parameters are the user's (they exist before megatrain sees them);
what megatrain adds for training is:

- the AdamW moments megatrain.AdamW creates on its first update of a parameter (8 bytes
  a parameter; state that already exists is already in RAM, so it is not counted again);
  with any other optimizer, the fp32 ``p.grad`` the runtime fills (4 bytes a parameter;
  that optimizer's own state is its business);
- the gradient slabs megatrain.AdamW's gradients land in (runtime/grad_slabs.py): at
  least two of the largest region's gradients; more grow only within what is left;
- boundary activations the plan parks in host memory between the passes (``offload``);
- the bf16 weight shadows, where the plan streams from them (2 bytes a parameter).

Refusing here, at compile time, beats the alternative: a host that starts swapping
minutes into the first step, or the kernel's OOM killer taking the process and its work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import MegatrainValueError, format_bytes
from ..optim.registry import owner_of
from ..runtime.grad_slabs import MIN_SLABS

MOMENT_BYTES = 8  # exp_avg and exp_avg_sq, fp32
GRAD_BYTES = 4  # fp32 p.grad for an optimizer megatrain does not feed directly
SHADOW_BYTES = 2  # bf16 weight shadow


SLABS = f"gradient slabs ({MIN_SLABS} of the largest region's)"


def host_needs(params: Sequence[torch.Tensor], region_params: Mapping[int, Sequence[int]],
               offloaded_bytes: int, grad_itemsize: int, weight_shadow: bool,
               training: bool = True) -> dict[str, int]:
    """Host bytes this graph adds, by what holds them (zero entries left out); a graph
    that computes no gradients (``training=False``) adds only its offloaded activations."""
    moments = grads = 0
    fed = set()  # parameters whose gradients go to megatrain.AdamW through slabs
    for i, p in enumerate(params if training else ()):
        opt = owner_of(p)
        if opt is None:
            grads += GRAD_BYTES * p.numel()
            continue
        fed.add(i)
        if not opt.state.get(p):
            moments += MOMENT_BYTES * p.numel()
    slab = max((sum(params[i].numel() for i in pids if i in fed) for pids in region_params.values()),
               default=0) * grad_itemsize
    needs = {
        "optimizer moments to create": moments,
        "fp32 gradients (p.grad)": grads,
        SLABS: MIN_SLABS * slab,
        "activations waiting in host memory": offloaded_bytes,
        "bf16 weight shadows": SHADOW_BYTES * sum(p.numel() for p in params) if weight_shadow and training else 0,
    }
    return {k: v for k, v in needs.items() if v}


def check_host_budget(needs: Mapping[str, int], host_memory: int | None) -> None:
    """Refuse a graph whose host needs exceed ``host_memory``, naming each part and the fix."""
    total = sum(needs.values())
    if host_memory is None or total <= host_memory:
        return
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(needs.items(), key=lambda kv: -kv[1]))
    raise MegatrainValueError(
        f"this graph needs {total} bytes ({format_bytes(total)}) of host memory beyond the model's "
        f"parameters ({parts}) but host_memory is {host_memory} bytes ({format_bytes(host_memory)}; "
        f"unset, it is the RAM available at compile time less a margin); give host_memory of at "
        f"least {total} bytes if the host has it, free host memory, or train a smaller model; a "
        f"larger gpu_memory lets the plan keep activations on the device")


def slab_room(needs: Mapping[str, int], host_memory: int | None) -> int | None:
    """The bytes all gradient slabs may hold together: host_memory less every other need
    (None: no budget)."""
    if host_memory is None:
        return None
    return host_memory - sum(v for k, v in needs.items() if k != SLABS)
