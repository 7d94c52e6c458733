"""A ring of fixed-size host chunks that gradients cross into on their way to the optimizer.

Why not region slabs (grad_slabs.py) everywhere: a slab holds one whole region's gradients,
and two of them are sized for the largest region, the embedding: 2 x 262 MB at 1.3B
(0.39 B/param of the 12.5 B/param host budget), 2 x 2.1 GB at Llama-3-8B's 128k vocab.
Here gradients are packed back to back into chunks in the order backward produces them; a
chunk goes to the optimizer as soon as it is full (``megatrain.AdamW.submit_pieces``) and
comes back once its pieces are consumed, so host memory for gradients is
``chunks x chunk_bytes`` whatever the model. A gradient that does not fit the rest of a
chunk is cut, at a multiple of ``PIECE_ALIGN`` elements, so every piece rounds in the
optimizer exactly as the whole gradient would (AdamW is elementwise).

Used when the runtime's backlog is off (the backlog holds and sends whole regions) and for
parameters with one gradient per backward (a tied weight's contributions are summed in a
region slab first).
"""

from __future__ import annotations

import threading
import time

import torch

from ..optim.functional import PIECE_ALIGN
from ..memory.host_store import host_buffer

# Bytes every piece starts on within a chunk: PIECE_ALIGN fp32 elements, so a cut at the
# chunk's end falls on a multiple of PIECE_ALIGN elements of any gradient dtype up to fp32.
_ALIGN = PIECE_ALIGN * 4


class Chunk:
    """One chunk's bytes and the pieces carved from it since it was last handed back:
    ``[param, start, host view, done event or None]``."""

    def __init__(self, nbytes: int, pin: bool):
        self.buf = host_buffer(nbytes, torch.uint8, pin)
        self.used = 0
        self.pieces: list[list] = []


class GradRing:
    """At most ``chunks`` chunks of ``chunk_bytes``, allocated on first use. ``carve`` fills
    the current chunk on the runtime's thread; ``release`` (from the hand-off thread) gives
    a chunk back. A caller that needs a chunk while all are out waits (backpressure)."""

    def __init__(self, chunk_bytes: int, chunks: int, pin: bool):
        if chunk_bytes < _ALIGN or chunks < 2:
            raise ValueError(f"GradRing({chunk_bytes}, {chunks}): need chunks of at least "
                             f"{_ALIGN} bytes and at least 2 chunks")
        self.chunk_bytes = chunk_bytes // _ALIGN * _ALIGN
        self.chunks = chunks
        self.pin = pin
        self.allocated = 0
        self.wait_s = 0.0  # time carve() waited for a free chunk
        self._free: list[Chunk] = []
        self._current: Chunk | None = None
        self._cv = threading.Condition()

    def carve(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Chunk]:
        """A 1-D host view for the next ``k <= numel`` elements of a gradient (all of them
        if the current chunk has room; else as many as fill it, a multiple of PIECE_ALIGN),
        and the chunk it lies in. Call ``seal_if_full`` right after: the current chunk
        always has room for an aligned piece."""
        chunk = self._current or self._take()
        self._current = chunk
        start = self._next_start(chunk)
        room = (self.chunk_bytes - start) // dtype.itemsize
        k = numel if numel <= room else room // PIECE_ALIGN * PIECE_ALIGN
        assert k > 0, (numel, room)
        chunk.used = start + k * dtype.itemsize
        return chunk.buf[start:chunk.used].view(dtype), chunk

    def seal_if_full(self) -> Chunk | None:
        """The current chunk if no aligned piece fits any more: the caller hands it off."""
        chunk = self._current
        if chunk is not None and self.chunk_bytes - self._next_start(chunk) < _ALIGN:
            self._current = None
            return chunk
        return None

    @staticmethod
    def _next_start(chunk: Chunk) -> int:
        return -(-chunk.used // _ALIGN) * _ALIGN

    def seal(self) -> Chunk | None:
        """The current chunk, full or not (end of backward), if it holds any piece."""
        chunk, self._current = self._current, None
        if chunk is not None and not chunk.pieces:
            self._give_back(chunk)
            return None
        return chunk

    def release(self, chunk: Chunk) -> None:
        """The optimizer consumed the chunk's pieces: it may be refilled."""
        self._give_back(chunk)

    def _give_back(self, chunk: Chunk) -> None:
        with self._cv:
            chunk.used = 0
            chunk.pieces = []
            self._free.append(chunk)
            self._cv.notify()

    def _take(self) -> Chunk:
        with self._cv:
            if not self._free and self.allocated < self.chunks:
                self.allocated += 1
                return Chunk(self.chunk_bytes, self.pin)
            t0 = time.perf_counter()
            while not self._free:
                self._cv.wait()
            self.wait_s += time.perf_counter() - t0
            return self._free.pop()
