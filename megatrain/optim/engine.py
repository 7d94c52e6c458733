"""The host worker: one thread that runs optimizer work while the caller keeps computing.

Thread choices, and why:

- One worker thread, not a pool. Every task here (AdamW update, gradient accumulation,
  norms) is memory-bound, so a second concurrent task would only compete for the same DRAM
  bandwidth. One FIFO thread also orders all work on a parameter (accumulate, then update)
  without locks, and never opens two OpenMP teams that oversubscribe the cores. The one
  exception is the reduction of a held gradient's norm, which torch runs on a single core:
  it goes to a few norm threads beside the worker (optim/norms.py).
- Parallelism comes from inside each ATen kernel: the worker runs with ``threads``
  intra-op (OpenMP) threads, by default the caller's ``torch.get_num_threads()``, i.e. the
  same count torch's own fused AdamW would use.
- ATen ops release the GIL, so the caller's Python (autograd, the runtime's copy engine)
  runs on while the worker computes.
- ``torch.set_num_threads`` is per thread for OpenMP but also sets the process default
  that new threads start from; the worker's setting is therefore undone for the process
  right after the worker starts, so it never leaks into other threads.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


def streaming_threads(device_type: str) -> int:
    """The intra-op threads a host optimizer gets beside a streamed step on `device_type`
    when its user left them unset: on a GPU the optimizer shares the cores and host memory
    bandwidth with the copies, the launch thread and autograd, and fewer threads than cores
    update faster there, so half the cores; on the CPU, where the "device" is the same
    cores, the caller's count. One rule for the backend, which hands the count to the
    optimizer, and for the probe, which measures the update rate the cost model charges."""
    threads = torch.get_num_threads()
    return max(1, threads // 2) if device_type == "cuda" else threads


def _set_worker_threads(threads: int) -> None:
    torch.set_num_threads(threads)


def _run_no_grad(fn: Callable[..., Any], args: tuple) -> Any:
    # Grad mode is thread-local and on by default in a new thread: in-place updates of
    # leaf parameters would be refused by autograd without this.
    with torch.no_grad():
        return fn(*args)


class HostWorker:
    """A single FIFO worker thread with ``threads`` intra-op threads, tracking per tensor
    the last task that touches it so callers can wait for exactly what they need."""

    def __init__(self, threads: int, name: str = "megatrain-host-optim") -> None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        self.threads = threads
        caller_threads = torch.get_num_threads()
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=name,
            initializer=_set_worker_threads,
            initargs=(threads,),
        )
        self._pool.submit(int).result()  # start the thread (and its setting) now
        if threads != caller_threads:
            torch.set_num_threads(caller_threads)  # restore the process default
        self._lock = threading.Lock()
        self._last: dict[torch.Tensor, Future] = {}
        self._outstanding: list[Future] = []
        self._tracked: set[Future] = set()  # pending futures of work done elsewhere
        self.busy_s = 0.0  # seconds spent running tasks, since creation (written by the thread)
        weakref.finalize(self, self._pool.shutdown, wait=False)

    def submit(
        self, fn: Callable[..., Any], *args: Any, touches: Iterable[torch.Tensor] = ()
    ) -> Future:
        """Queue ``fn(*args)`` (run under no_grad); ``touches`` are the tensors it reads
        or writes, for :meth:`wait`."""
        touches = list(touches)
        with self._lock:
            after = {id(f): f for t in touches if (f := self._last.get(t)) in self._tracked}
            future = self._pool.submit(self._run, fn, args, tuple(after.values()))
            self._outstanding = [f for f in self._outstanding if not f.done()]
            self._outstanding.append(future)
            for t in touches:
                self._last[t] = future
        return future

    def _run(self, fn: Callable[..., Any], args: tuple, after: tuple[Future, ...]) -> Any:
        """On the thread: wait for tracked work elsewhere on the same tensors (see
        `track`; not busy time), then run the task and add its time to `busy_s` (the
        cost model's host-stream seconds, as observed: `bench/train.py` compares the two)."""
        for f in after:
            f.result()
        t0 = time.perf_counter()
        try:
            return _run_no_grad(fn, args)
        finally:
            self.busy_s += time.perf_counter() - t0

    def track(self, future: Future, touches: Iterable[torch.Tensor]) -> None:
        """Count work running elsewhere (a device update) as the last task touching
        ``touches``: :meth:`wait` and :meth:`wait_all` wait for it (and re-raise its
        error), and a task submitted later that touches any of them starts after it.
        The caller starts that work only after :meth:`wait` on ``touches`` returned: it
        runs outside this FIFO, so nothing here orders it after earlier tasks. A later task
        that must wait holds up the FIFO meanwhile: a safety net, not a path to rely on."""
        with self._lock:
            self._outstanding = [f for f in self._outstanding if not f.done()]
            self._outstanding.append(future)
            self._tracked.add(future)
            for t in touches:
                self._last[t] = future
        future.add_done_callback(self._untrack)

    def _untrack(self, future: Future) -> None:
        with self._lock:
            self._tracked.discard(future)

    def wait(self, tensors: Iterable[torch.Tensor]) -> None:
        """Block until every queued task touching ``tensors`` has finished; re-raise its
        error. FIFO order makes the last such task the only one to wait for."""
        with self._lock:
            futures = {id(f): f for t in tensors if (f := self._last.get(t)) is not None}
        for f in futures.values():
            f.result()

    def wait_all(self) -> None:
        """Block until the queue is empty; re-raise the first task error."""
        with self._lock:
            futures, self._outstanding = self._outstanding, []
            self._last.clear()
        errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
