"""One gradient contribution on its way to the host, and when its device snapshot may go.

A `GradCopy` follows a gradient from the backward that made it to the hand-off that gives
it to its optimizer: where it lands on the host (`staged`, a view into `slab`), the event
that marks its copy done (CUDA), and the device snapshot the copy reads from. On the CPU
only `staged` and `slab` are set. A gradient the backlog holds on the device gets its
`staged`, `slab` and `done` when a slab takes its region (GradHandoff._copy_out_held).

`copy_to_host` starts one such copy from a device snapshot; `Snapshots` keeps the copies in
flight and lets their snapshots go as soon as the compute stream may reuse the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .stream_context import StreamContext

# Gradients are upcast to fp32 on the GPU (part of the snapshot copy, free) and cross the
# link in fp32: twice bf16's bytes, but the host optimizer then runs torch's fused AdamW
# directly instead of upcasting chunk by chunk, and the host is the bottleneck: with
# several optimizer threads the step is shorter in fp32 than in bf16
# (bench/train.py --optim-threads 8/bf16,8/fp32).
GRAD_TRANSFER_DTYPE = torch.float32


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
    the host noticed its copy: a launch thread running far ahead of the GPU so held many
    layers' gradient snapshots at the step's peak, where the plan counts each gradient
    until the next hand-off; the window is room the budget has beside the plan
    (compiler/decide.py)."""
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


def copy_to_host(ctx: StreamContext, staged: torch.Tensor, grad: torch.Tensor,
                 region: int | None = None) -> tuple[torch.cuda.Event, torch.Tensor]:
    """Device-to-host copy into pinned `staged` on the D2H stream, of a snapshot of
    `grad` taken on the compute stream. Why the snapshot: Inductor's generated code hands
    a gradient's memory to the next kernel right after the hand-off op (buffer reuse the
    allocator never sees, so holding `grad` does not protect it), and a copy on another
    stream that only waited for `grad`'s producer could read memory already overwritten.
    The device clone runs at HBM speed (~1 ms per GB) against PCIe's ~20 ms per GB;
    it is also where a gradient is upcast when `staged` is wider. Returns the event
    marking the host copy complete and the snapshot, which the caller keeps alive until
    then. With ``region`` the copy is timed and shows in the measured timeline."""
    stats, d2h = ctx.stats, ctx.d2h_stream
    stats.d2h_bytes += staged.numel() * staged.element_size()
    snapshot = grad.clone() if staged.dtype == grad.dtype else grad.to(staged.dtype)
    produced = torch.cuda.Event()
    produced.record(torch.cuda.current_stream(ctx.device))
    timed = region is not None  # timed copies show in the measured timeline
    started, done = torch.cuda.Event(enable_timing=timed), torch.cuda.Event(enable_timing=timed)
    with torch.cuda.stream(d2h):
        d2h.wait_event(produced)
        if timed:
            started.record(d2h)
        staged.copy_(snapshot, non_blocking=True)
        done.record(d2h)
    if timed:
        stats.grad_copies.append((region, started, done))
    return done, snapshot


class Snapshots:
    """The CUDA copies of one streamer whose device snapshots are still held (the slab
    and ring paths add theirs), settled after each addition (settle_snapshots).
    ``window``: bytes of older snapshots that may wait for their copies before the
    compute stream is made to; set beside the plan (compiler/backend.py)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.window = 0
        self._copies: list[GradCopy] = []

    def add(self, copy: GradCopy) -> None:
        self._copies.append(copy)
        self.settle()

    def settle(self, everything: bool = False) -> None:
        """Drop device gradient snapshots whose device-to-host copy has completed, and the
        oldest of the rest in stream order beyond `window` (settle_snapshots);
        ``everything``: all of them, the newest too, in stream order."""
        window = 0 if everything else self.window
        self._copies = settle_snapshots(self._copies, window,
                                        torch.cuda.current_stream(self.device).wait_event,
                                        keep_newest=not everything)

    def forget(self) -> None:
        """Every copy is known complete (the hand-offs waited for them): hold none."""
        self._copies = []

    def __bool__(self) -> bool:
        return bool(self._copies)


__all__ = ["GRAD_TRANSFER_DTYPE", "GradCopy", "Snapshots", "copy_to_host", "settle_snapshots"]
