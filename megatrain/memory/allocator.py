"""The CUDA caching allocator's expandable segments: whether they are on, and turning them on.

Why it matters: with regions resident, megatrain fills the device to ``gpu_memory`` less a
margin (runtime/update_room.py) with state that lives for good, allocated between the
step's transient tensors. With the allocator's default fixed-size segments those
long-lived blocks pin segments that the step's large transients (a [tokens, vocab]
logits block of several GiB) then cannot reuse, so a device short of nothing in total can
refuse one contiguous block. Expandable segments map physical pages into one growing
virtual range per stream and give the pages of free holes back when an allocation would
fail, so the bytes counted are the bytes that can be had.

The main job owns its process and turns them on (train/loop.py) unless the user set the
allocator's configuration; a torch.compile user's process is theirs, so the backend only
reads the setting and, where segments are fixed, sizes resident growth by the allocator's
reserved bytes, fragmentation included, rather than its allocated bytes."""

from __future__ import annotations

import os

import torch

_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _settings() -> str:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    set_now = getter() if getter is not None else ""
    return ",".join([os.environ.get(k, "") for k in _ENV] + [set_now or ""])


def user_configured() -> bool:
    """Whether the process was given an allocator configuration (either environment
    variable), which megatrain then leaves as it is."""
    return any(os.environ.get(k) for k in _ENV)


def expandable_segments() -> bool:
    """Whether new CUDA segments are expandable: the last ``expandable_segments`` setting
    in the environment or set at run time wins."""
    on = False
    for item in _settings().replace(";", ",").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip().lower() == "true"
    return on


def enable_expandable_segments() -> bool:
    """Turn expandable segments on for new segments (and for child processes, through the
    environment), unless the user configured the allocator. Returns whether they are on."""
    if user_configured():
        return expandable_segments()
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter("expandable_segments:True")
    elif hasattr(torch.cuda.memory, "_set_allocator_settings"):
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return True
