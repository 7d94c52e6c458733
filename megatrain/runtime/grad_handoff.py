"""The host end of the gradient fast path: each backward's gradients counted in per region,
and whole regions handed to their optimizer on one thread.

The ways a gradient leaves the device (grad_routes.py) report here: every gradient counts
in with `count_in`, and one bound for a host slab or the device backlog is also `add`ed as
a contribution. A region is sealed with its last gradient. Its slab then waits for the
hand-off thread, which serves one sealed region per task: in arrival order, or with the
backlog (``backlog="host"`` or ``"device"``) earliest deadline first (deadlines.py),
preferring a region whose copies are done. With ``"device"`` a region that found no free
slab waits on the device (grad_backlog.py) until `pump` gives it one.

At the end of backward, `wait_handoffs` waits until every region has been consumed; with
the backlog, `defer_rest` instead promises the regions not handed over yet
(``AdamW.defer``) so that backward can return, where every optimizer concerned agrees.

A tied weight sends one contribution per region that fetched it; they are summed on the
host (in fp32) when its last region is handed over, so its earlier contributions leave
their slab before the slab is reused.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable

import torch

from ..optim.registry import owner_of
from . import handoff_graphs
from .deadlines import DeadlineQueue, Deadlines
from .grad_backlog import GradBacklog, Held
from .grad_copies import GradCopy, Snapshots
from .grad_slabs import GradSlabs
from .stream_context import StreamContext

# The slab key under which the backlog's pump fills a slab (one region at a time).
_PUMP = ("backlog",)


class GradHandoff:
    """Per streamer. ``on_region_out`` is called as each region's last gradient counts in,
    on the runtime thread (the streamer gives back what autotuning left pinned)."""

    def __init__(self, ctx: StreamContext, slabs: GradSlabs, snapshots: Snapshots,
                 on_region_out: Callable[[], None]):
        self._ctx = ctx
        self.slabs = slabs
        self.snapshots = snapshots
        self._on_region_out = on_region_out
        self.backlog: GradBacklog | None = None  # backlog="device" (use_backlog)
        # Per-backward counters: the contributions expected per parameter and per region
        # (expect), those in so far, and the parameter each one is for this backward.
        self.expect_param: dict[int, int] = {}
        self.expect_region: dict[int, int] = {}
        self._contrib: dict[int, list[GradCopy]] = collections.defaultdict(list)
        self._bound: dict[int, torch.Tensor] = {}  # param_id -> the parameter this backward
        self._region_seen: dict[int, int] = collections.defaultdict(int)
        self._ready: dict[int, list[int]] = collections.defaultdict(list)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._futures: list[concurrent.futures.Future] = []
        # Sealed regions waiting for the hand-off thread, which serves one per task.
        self.sealed = DeadlineQueue(None)
        self.grad_bytes: dict[int, int] = {}  # region -> its gradients' slab reservation
        # Regions sealed but not yet handed to their optimizer, and the AdamW.defer promises
        # made for them when backward ended; the hand-off list. Guarded by _lock (the
        # backlog's pump runs on the hand-off thread).
        self._unsubmitted: dict[int, list[torch.Tensor]] = {}  # ticket -> params
        self._tickets = itertools.count()
        self._promised: dict[int, dict[int, object]] = {}
        self._lock = threading.Lock()
        self._pump_lock = threading.Lock()
        self.defer_declined = False  # the last backward's optimizers would not defer

    # -- set-up --------------------------------------------------------------------------
    def expect(self, per_param: dict[int, int], per_region: dict[int, int]) -> None:
        """How many gradient contributions one backward sends, per parameter and per region
        (a tied weight sends one per region that fetched it)."""
        self.expect_param = dict(per_param)
        self.expect_region = dict(per_region)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megatrain-grads")

    def use_backlog(self, deadlines: Deadlines, backlog: GradBacklog | None) -> None:
        """Serve sealed regions earliest deadline first; ``backlog``: the device backlog
        (backlog="device"), or None."""
        self.sealed = DeadlineQueue(deadlines)
        self.backlog = backlog

    def reserve(self, region: int, nbytes: int) -> None:
        """``region``'s gradients take ``nbytes`` in a slab (known when it is fetched)."""
        self.grad_bytes[region] = nbytes
        self.slabs.reserve(nbytes)

    # -- gradients in (runtime thread) ---------------------------------------------------
    def seen(self, region: int) -> int:
        """Gradients of ``region`` counted in so far this backward."""
        return self._region_seen.get(region, 0)

    def add(self, param_id: int, param: torch.Tensor, region: int, entry: GradCopy) -> None:
        """A contribution bound for a slab or the device backlog, then `count_in`."""
        self._contrib[param_id].append(entry)
        self._bound[param_id] = param
        if len(self._contrib[param_id]) == self.expect_param[param_id]:
            self._ready[region].append(param_id)
        self.count_in(region)

    def count_in(self, region: int) -> None:
        """One more gradient of ``region`` is out; with its last, the region's slab (if its
        gradients used one) goes to the hand-off."""
        backlog = self.backlog
        self._region_seen[region] += 1
        if self._region_seen[region] == self.expect_region[region]:
            del self._region_seen[region]  # the next backward counts afresh
            self._on_region_out()
            pids = self._ready.pop(region, [])
            if not pids and not self.slabs.is_open(region) and (backlog is None or not backlog.holds(region)):
                return  # all of the region's gradients went through the ring
            parts = [self._contrib.pop(i) for i in pids]
            params = [self._bound.pop(i) for i in pids]
            # A ticket, not the region id: a graph dynamo runs for several modules seals
            # the same region once per module.
            ticket = next(self._tickets)
            with self._lock:
                self._unsubmitted[ticket] = params
            if backlog is not None and backlog.holds(region):
                backlog.seal(region, (ticket, params, parts))
                self.pump()
                return
            slab = self.slabs.seal(region)
            # Contributions of tied weights still waiting for another region sit in this
            # slab too: the hand-off moves them out before it frees the slab.
            waiting = [e for c in self._contrib.values() for e in c if slab is not None and e.slab is slab]
            self._queue_handoff(region, (ticket, params, parts, slab, waiting, None))

    def run(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the hand-off thread; `wait_handoffs` waits for it."""
        future = self._executor.submit(fn, *args)
        with self._lock:
            self._futures.append(future)

    def track(self, futures: list) -> None:
        """`wait_handoffs` waits for these too (and re-raises their errors)."""
        with self._lock:
            self._futures.extend(futures)

    # -- the backlog's pump --------------------------------------------------------------
    def pump(self) -> None:
        """Send backlogged regions to the host while slabs are free, earliest deadline
        first (grad_backlog.py); a backward waiting for a slab gets it first. Called when a
        region joins the backlog, when a slab is released, and when backward ends."""
        with self._pump_lock:
            while self.backlog.peek() is not None and self.slabs.try_open(_PUMP, yield_to_waiters=True):
                held = self.backlog.take()
                self._copy_out_held(held)
                slab = self.slabs.seal(_PUMP)
                ticket, params, parts = held.payload
                self._queue_handoff(held.region, (ticket, params, parts, slab, [], held))

    def _copy_out_held(self, held: Held) -> None:
        """Carve the region's gradients in the slab opened for the pump and copy them
        there (CUDA: on the D2H stream after the backlog's copies on the compute stream)."""
        for view, entry in held.views:
            entry.staged, entry.slab = self.slabs.carve(_PUMP, view.shape, view.dtype)
        if not self._ctx.cuda:
            for view, entry in held.views:
                entry.staged.copy_(view)
            return
        d2h = self._ctx.d2h_stream
        started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self._ctx.device), torch.cuda.stream(d2h):
            d2h.wait_event(held.ready)
            started.record(d2h)
            for view, entry in held.views:
                entry.staged.copy_(view, non_blocking=True)
            done.record(d2h)
        self._ctx.stats.grad_copies.append((held.region, started, done))
        for _, entry in held.views:
            entry.done = done

    # -- the hand-off thread -------------------------------------------------------------
    def _queue_handoff(self, region: int, args: tuple) -> None:
        """A sealed region waits for the hand-off thread, which takes the next one by
        deadline (in arrival order without the backlog) each time it is free."""
        parts = args[2]

        def copied() -> bool:
            return all(e.done is None or e.done.query() for c in parts for e in c)

        self.sealed.push(region, args, ready=copied)
        self.run(self._hand_over_next)

    def _hand_over_next(self) -> None:
        region, args = self.sealed.pop()  # one task per push: never empty
        self._hand_over(region, *args)

    def _hand_over(self, region: int, ticket: int, params: list[torch.Tensor], parts: list[list[GradCopy]],
                   slab, waiting: list[GradCopy], held: Held | None) -> None:
        """On the hand-off thread: hand one region's gradients to their optimizer, then
        free its slab (after moving out contributions that wait for another region) and
        let the backlog's next region have it. On error, fail the region's promises."""
        try:
            self._submit_gradients(region, ticket, params, parts, held)
            for entry in waiting:
                if entry.done is not None:
                    entry.done.synchronize()
                entry.staged, entry.slab = entry.staged.clone(), None
        except BaseException as e:
            with self._lock:
                self._unsubmitted.pop(ticket, None)
                promised = self._promised.pop(ticket, {})
            for d in promised.values():
                d.fail(e)
            raise
        finally:
            if held is not None:
                self.backlog.release(held)
            if slab is not None:
                self.slabs.release(slab)
            if self.backlog is not None:
                self.pump()

    def _submit_gradients(self, region: int, ticket: int, params: list[torch.Tensor],
                          parts: list[list[GradCopy]], held: Held | None) -> None:
        """Wait for the copies, sum tied contributions (in fp32), submit and wait until the
        optimizer has consumed them. A single contribution goes as it crossed the link (a
        narrower dtype is upcast by the optimizer in cache-sized chunks, by a p.grad fallback
        at once).
        Submits under the lock, with the region's promise if backward's end made one."""
        grads = []
        for contributions in parts:
            total = None
            for c in contributions:
                if c.done is not None:
                    c.done.synchronize()
                if len(contributions) == 1:
                    total = c.staged
                else:
                    total = c.staged.to(torch.float32, copy=True) if total is None else total.add_(c.staged)
            grads.append(total)
        if held is not None:
            self.backlog.release(held)  # on the host now: the device bytes go back
        futures, started, at_once = [], time.perf_counter(), True
        with self._lock:
            self._unsubmitted.pop(ticket, None)
            promised = self._promised.pop(ticket, {})
            for key, (opt, ps, gs) in _by_owner(params, grads).items():
                if opt is None:
                    # The optimizer this graph was compiled for is gone, or another graph
                    # hands in a gradient of `p` too: keep the gradient where any torch
                    # optimizer finds it, summed like autograd would; step() applies it.
                    for p, g in zip(ps, gs):
                        g = g.to(p.dtype, copy=True)  # its own memory: the slab is reused
                        p.grad = g if p.grad is None else p.grad.add_(g)
                    continue
                d = promised.get(key)
                at_once = at_once and d is None and opt.updates_at_once()
                futures.append(d.submit(gs) if d is not None else opt.submit(ps, gs))
        for f in futures:
            f.result()
        if futures:  # the worker's work on this region (one hand-off at a time)
            self._ctx.stats.host_updates.append((region, started, time.perf_counter(),
                                                 sum(p.numel() for p in params), at_once))

    # -- end of backward -----------------------------------------------------------------
    def wait_handoffs(self) -> None:
        """Until every region of this backward has been handed over and consumed (the
        backlog's included: each hand-off pumps the next before it completes)."""
        while True:
            if self.backlog is not None:
                self.pump()
            with self._lock:
                futures, self._futures = self._futures, []
            if not futures:
                assert self.backlog is None or not len(self.backlog), "backlog left without a slab"
                break
            for f in futures:
                f.result()
        self.snapshots.forget()
        leftover = [i for i, c in self._contrib.items() if c]
        assert not leftover, f"gradients of parameters {leftover} never completed"

    def defer_rest(self) -> bool:
        """End of backward with the backlog: promise every region not yet handed to its
        optimizer (AdamW.defer) so that backward can return now. False where an optimizer
        declines (its update is not immediate): then the caller waits for all hand-offs.
        Errors of hand-offs finished since the last backward surface here."""
        if self.backlog is not None:
            self.pump()
        with self._lock:
            self.defer_declined = False
            for ticket, params in self._unsubmitted.items():
                promised = self._promised.setdefault(ticket, {})
                for key, (opt, ps, _) in _by_owner(params, params).items():
                    if key not in promised:
                        d = opt.defer(ps) if opt is not None else None
                        if d is None:
                            self.defer_declined = True
                            return False
                        promised[key] = d
            self._ctx.stats.deferred_regions = len(self._unsubmitted)
            done = [f for f in self._futures if f.done()]
            self._futures = [f for f in self._futures if not f.done()]
        for f in done:
            f.result()
        # Slab-path copies still in flight: their device snapshots must not outlive
        # this backward (the plan does not count them in the next forward); released in
        # stream order, so the host need not wait for the copies.
        if self.snapshots:
            self.snapshots.settle(everything=True)
        leftover = [i for i, c in self._contrib.items() if c]
        assert not leftover, f"gradients of parameters {leftover} never completed"
        return True


def _by_owner(params: list, values: list) -> dict[int, tuple]:
    """(optimizer, params, values) per owning optimizer, keyed by its id; None for the
    parameters whose gradients go to p.grad (no optimizer, or several graphs hand them in)."""
    owners: dict[int, tuple] = {}
    for p, v in zip(params, values):
        opt = None if handoff_graphs.several(p) else owner_of(p)
        entry = owners.setdefault(id(opt), (opt, [], []))
        entry[1].append(p)
        entry[2].append(v)
    return owners
