"""Host store: each region's own fp32 parameters in one contiguous (pinned) buffer.

The user's `nn.Parameter` objects stay the same objects (their optimizers keep working);
only their `.data` is moved into the region buffer, laid out as the device buffer will be,
so a region is one host-to-device copy. Pinned memory (CUDA only) is allocated once: it
is slow to allocate (~2-3 s per 4 GiB) and the only memory PCIe reads at full speed.
"""

from __future__ import annotations

import weakref

import torch

from .layout import FlatLayout

_homed: set[int] = set()


def _forget(pid: int) -> None:
    _homed.discard(pid)


def is_homed(p: torch.Tensor) -> bool:
    return id(p) in _homed


def home_parameters(params: list[torch.nn.Parameter], pin: bool) -> torch.Tensor | None:
    """Move the not-yet-homed `params` into one new contiguous buffer; return it."""
    todo = [p for p in params if id(p) not in _homed]
    if not todo:
        return None
    dtypes = {p.dtype for p in todo}
    if len(dtypes) != 1:
        # Mixed dtypes in one region: give each dtype its own buffer.
        for dt in dtypes:
            home_parameters([p for p in todo if p.dtype == dt], pin)
        return None
    layout = FlatLayout.of([p.shape for p in todo])
    buf = torch.zeros(layout.numel, dtype=todo[0].dtype, pin_memory=pin)
    with torch.no_grad():
        for p, view in zip(todo, layout.views(buf)):
            view.copy_(p.data)
            p.data = view
            _homed.add(id(p))
            weakref.finalize(p, _forget, id(p))
    return buf
