"""Which compiled graphs hand each parameter's gradient to an optimizer.

A parameter handed in by two graphs (a weight tied across a graph break) gets a gradient
from each backward, and neither graph knows whether its own is the step's last: such a
parameter's gradients go to p.grad, summed like autograd does, and step() applies them.
So no path that updates at the hand-off (a device-site update, resident state, the
gradient ring) may take it.
"""

from __future__ import annotations

import weakref

import torch

# id(parameter) -> the streamers (compiled graphs, by index) that hand its gradient in.
_GRAPHS: dict[int, set[int]] = {}


def note(param: torch.Tensor, streamer: int) -> None:
    graphs = _GRAPHS.get(id(param))
    if graphs is None:
        graphs = _GRAPHS[id(param)] = set()
        weakref.finalize(param, _GRAPHS.pop, id(param), None)
    graphs.add(streamer)


def several(param: torch.Tensor) -> bool:
    """Whether more than one compiled graph hands in ``param``'s gradient."""
    return len(_GRAPHS.get(id(param), ())) > 1
