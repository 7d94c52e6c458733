"""Gradient norms of held 16-bit gradients, reduced beside the host worker.

The clip needs each final gradient's 2-norm exactly as ``clip_grad_norm_(foreach=False)``
computes it: ``vector_norm`` of the fp32 values (functional.grad_norm). torch reduces a
CPU tensor to a scalar on one core (the bits are the same at any thread count), while
every other kernel the worker runs (copies, upcasts, AdamW) uses all of its threads, so
on a many-core host the single-core reductions are the largest serial part of the clipped
path (bench/bench_adamw.py's "mt clipped"). So the worker upcasts a held gradient with all of
its threads into one of a few fp32 scratch buffers and hands the reduction to norm
threads that run beside it, one core each, while it goes on with the next gradient. Each
norm is the same op on the same values as before, so it has the same bits; only when it
runs changes. A buffer returns to the free list once its reduction is done; the worker
waits for one when all are in use, which bounds the memory (``slots`` buffers, each as
large as the largest gradient it held, at most ``functional.NORM_SCRATCH_MAX`` elements).
"""

from __future__ import annotations

import queue
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from . import functional

# Norm threads per worker thread count: each reduction takes one core at the host's
# memory bandwidth per core; a few beside the worker's copies leave it the rest.
MAX_NORM_THREADS = 4


def norm_threads_for(worker_threads: int) -> int:
    """How many norm threads go beside a worker of ``worker_threads`` intra-op threads."""
    return max(1, min(MAX_NORM_THREADS, worker_threads // 4))


class NormThreads:
    """``norm(grad)`` -> a Future of ``functional.grad_norm(grad)`` (see the module
    docstring). Called from one thread (the host worker)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="megatrain-norms")
        self._free: queue.SimpleQueue[Tensor | None] = queue.SimpleQueue()
        for _ in range(threads + 1):  # one more than the threads: the worker fills the next
            self._free.put(None)  # a slot whose buffer is made at its first use
        weakref.finalize(self, self._pool.shutdown, wait=False)

    def norm(self, grad: Tensor) -> Future:
        """The 2-norm of ``grad`` as functional.grad_norm computes it, reduced on a norm
        thread when ``grad`` is a contiguous 16-bit host tensor small enough for a scratch
        buffer; computed here otherwise (a completed Future)."""
        n = grad.numel()
        if (grad.dtype not in (torch.bfloat16, torch.float16) or grad.device.type != "cpu"
                or not grad.is_contiguous() or n > functional.NORM_SCRATCH_MAX):
            done: Future = Future()
            done.set_result(functional.grad_norm(grad))
            return done
        buf = self._free.get()  # blocks while every buffer's reduction is still running
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=torch.float32)
        values = buf[:n].view(grad.shape).copy_(grad)  # the upcast, with the caller's threads
        return self._pool.submit(self._reduce, values, buf)

    def _reduce(self, values: Tensor, buf: Tensor) -> Tensor:
        try:
            return torch.linalg.vector_norm(values, 2.0)
        finally:
            self._free.put(buf)


def resolved(norm: Tensor | Future) -> Tensor:
    """A norm as ``_norms`` holds it (a tensor, or a NormThreads Future), as a tensor."""
    return norm.result() if isinstance(norm, Future) else norm
