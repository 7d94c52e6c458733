"""Boundary activations parked in host memory between the forward and the backward.

The planner may offload a region's saved outputs (what its backward, or a later region's,
reads) so that long sequences fit: the forward starts a device-to-host copy right after
the region computes and, later, drops the device bytes; the backward brings them back
ahead of their first reader. The tensor keeps its identity, shape and device throughout:
only its storage is emptied (`resize_(0)`) and refilled, so AOTAutograd and Inductor see
the graphs they traced (no CPU tensor where a CUDA one was), and nothing between the two
passes reads the bytes.

Copies run on the streamer's side streams, ordered by events (no `record_stream`):
    offload      compute event -> D2H into this tensor's host buffer     (d2h stream)
    offload_wait compute stream waits for that copy; the storage is emptied
    reload       storage refilled (allocated on the compute stream), H2D  (h2d stream)
    reload_wait  compute stream waits for that copy
The host buffers (page-locked on CUDA) are kept per key and reused every step. On the CPU
device the copies are plain copies, so the same path runs in CI.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..memory.host_store import host_buffer


@dataclass
class _Parked:
    key: int
    host: torch.Tensor  # bytes of the tensor while its storage is empty
    nbytes: int = 0  # of the storage, to refill it
    done: object = None  # CUDA event of the copy in flight (either direction)
    tensor: torch.Tensor | None = None  # kept alive until the offload copy has read it
    emptied: bool = False
    collected: weakref.finalize | None = None  # fires when the storage dies parked


class ActivationStore:
    """The offloaded activations of one compiled graph pair. `key` (an index the pass
    assigns to each offloaded saved tensor) picks a host buffer; the parked bytes belong to
    the tensor's storage, so two forwards before one backward (gradient accumulation
    through one graph) each keep their own bytes. A forward whose backward never runs
    gives its buffers back when its saved tensors are collected."""

    def __init__(self, device: torch.device, h2d_stream=None, d2h_stream=None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.h2d_stream, self.d2h_stream = h2d_stream, d2h_stream
        self._parked: dict[int, _Parked] = {}  # storage identity -> its parked bytes
        self._free: dict[int, list[torch.Tensor]] = {}  # key -> host buffers not in use
        self._lock = threading.Lock()  # finalizers may run on any thread
        # Bytes whose device storage was emptied and later refilled, since construction.
        self.emptied_bytes = 0
        self.reloaded_bytes = 0
        self._warned = False

    def _host(self, key: int, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.setdefault(key, [])
            for i, buf in enumerate(free):
                if buf.numel() >= nbytes:
                    return free.pop(i)
        return host_buffer(nbytes, torch.uint8, self.cuda)

    def _give_back(self, p: _Parked) -> None:
        with self._lock:
            self._free.setdefault(p.key, []).append(p.host)

    def _collected(self, sid: int, p: _Parked) -> None:
        """The storage died parked (no backward ran): its host buffer is free again. Only
        `p` itself is dropped: a later storage at the same address has its own entry."""
        with self._lock:
            if self._parked.get(sid) is not p:
                return
            del self._parked[sid]
        self._give_back(p)

    def offload(self, key: int, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        p = _Parked(key, self._host(key, nbytes), nbytes, tensor=t)
        sid = _identity(t)
        with self._lock:
            self._parked[sid] = p
        # The parked bytes live as long as the storage, not as the tensor object handed
        # here: autograd may keep the saved activation through another tensor object on
        # the same storage while this one is collected after the forward. A storage's
        # Python object lives exactly as long as the storage (PyObject preservation).
        p.collected = weakref.finalize(storage, self._collected, sid, p)
        p.done = self._copy(self.d2h_stream, p.host[:nbytes], _bytes(storage, t.device))

    def offload_wait(self, key: int, t: torch.Tensor) -> None:
        p = self._parked[_identity(t)]
        self._wait(p)
        p.tensor = None
        if _sole_owner(t):
            t.untyped_storage().resize_(0)  # freed in the compute stream's order
            p.emptied = True
            self.emptied_bytes += p.nbytes
        elif not self._warned:
            self._warned = True
            warnings.warn("megatrain: an offloaded activation shares its storage with other "
                          "tensors, so its device bytes stay (the plan assumed them freed)",
                          stacklevel=2)

    def reload(self, key: int, t: torch.Tensor) -> None:
        p = self._parked[_identity(t)]
        if not p.emptied:
            return  # never emptied (shared storage): the bytes are still there
        storage = t.untyped_storage()
        # Allocated on the compute stream, which waits for the copy (reload_wait) before
        # anything reads it: no record_stream needed.
        storage.resize_(p.nbytes)
        p.emptied = False
        self.reloaded_bytes += p.nbytes
        p.done = self._copy(self.h2d_stream, _bytes(storage, t.device), p.host[:p.nbytes])

    def reload_wait(self, key: int, t: torch.Tensor) -> None:
        with self._lock:
            p = self._parked.pop(_identity(t))
        p.collected.detach()
        self._wait(p)
        # Reused only by a later offload, whose copy is ordered after this wait.
        self._give_back(p)

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor):
        """`dst.copy_(src)` on `stream` after the compute stream's work so far (the source
        was just written there, or the destination's block just freed there); its done
        event (None on the CPU, where the copy is done on return)."""
        if not self.cuda:
            dst.copy_(src)
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            done.record(stream)
        return done

    def _wait(self, p: _Parked) -> None:
        """The compute stream waits for `p`'s copy in flight, if any."""
        if p.done is not None:
            torch.cuda.current_stream(self.device).wait_event(p.done)
            p.done = None


def _bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """All of `storage`'s bytes as a uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _identity(t: torch.Tensor) -> int:
    """The storage's identity (its StorageImpl), the same for every tensor object that
    autograd hands back for it, and stable while its bytes are emptied."""
    return t.untyped_storage()._cdata


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether emptying `t`'s storage frees nothing another tensor still needs: `t` covers
    the whole storage, each byte once, in any dimension order (attention kernels return
    their output as a permuted view of a dense buffer; the parked bytes are the storage's,
    so the strides come back as they were). The graph's other outputs are never views of a
    saved activation's buffer, but check rather than assume."""
    return t.storage_offset() == 0 and _dense(t) and \
        t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements tile a block of memory without gaps or overlaps: its strides,
    smallest first, are the running products of the sizes."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True
