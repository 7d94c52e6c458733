"""One gradient contribution on its way to the host, and when its device snapshot may go.

A `GradCopy` follows a gradient from the backward that made it to the hand-off that gives
it to its optimizer: where it lands on the host (`staged`, a view into `slab`), the event
that marks its copy done (CUDA), and the device snapshot the copy reads from. On the CPU
only `staged` and `slab` are set. A gradient the backlog holds on the device gets its
`staged`, `slab` and `done` when a slab takes its region (Streamer._copy_out_held).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, eq=False)  # identity: a copy is one gradient's, never equal to another
class GradCopy:
    staged: torch.Tensor | None = None  # the host view it is copied into
    done: object = None  # torch.cuda.Event recorded after the copy; None: already on the host
    snapshot: torch.Tensor | None = None  # the device tensor the copy reads, until let go
    slab: object = None  # the grad_slabs slab `staged` lies in; None once moved out of it


def settle_snapshots(in_flight: list[GradCopy], window: int, wait, keep_newest: bool = True) -> list[GradCopy]:
    """Let go of the device snapshots of gradient copies in flight (``snapshot`` set to
    None) and return the copies still holding one: first those whose copy has completed;
    then, oldest first, as many more as keep the rest (the newest excepted where
    ``keep_newest``) within ``window`` bytes, each after ``wait(done)`` has ordered the
    compute stream after its copy, so the allocator hands its memory out again only to
    kernels that run after the copy read it.

    Why not only those whose event says done: the launch thread runs ahead of the GPU, so
    the events it queries are often not reached yet, and each snapshot was held until
    the host noticed its copy. H200, 3B at 16k tokens: 6.3 GiB of snapshots (15 layers'
    gradients) were allocated at the step's peak, where the plan counts each gradient
    until the next hand-off; the window is room the budget has beside the plan
    (compiler/backend.py, _place_updates)."""
    held = []
    for copy in in_flight:
        if copy.snapshot is not None and not copy.done.query():
            held.append(copy)
        else:
            copy.snapshot = None
    newest = held[-1:] if keep_newest else []
    older = held[:len(held) - len(newest)]
    nbytes = sum(c.snapshot.nbytes for c in older)
    while older and nbytes > window:
        copy = older.pop(0)
        wait(copy.done)
        nbytes -= copy.snapshot.nbytes
        copy.snapshot = None
    return older + newest


__all__ = ["GradCopy", "settle_snapshots"]
