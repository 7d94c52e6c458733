"""Deferred updates: the promises ``AdamW.defer`` makes, and the bookkeeping of them.

A deferred update crosses three threads: the caller promises it during backward
(``AdamW.defer``), the runtime's hand-off thread queues it after backward returned
(``Deferred.submit``), and whoever needs the parameters waits on it (the next fetch
through ``wait_params``, ``step()``, ``synchronize()``, ``state_dict()``). Why a module of
its own: that hand-over is all lock and futures and no math, so it sits here behind one
lock, apart from the update path it feeds (optim/host_updates.py), and the optimizer owns
one :class:`Promises`.

Life of a promise: made (its parameters now wait on ``Deferred.queued``), then queued or
failed (``settle``). Queued: the promise is forgotten at once, and waiters find the queued
task in the host worker's tracking instead. Failed: the error stays where ``wait_params``
finds it until ``step()``, ``synchronize()`` or the like collected it (``wait``,
``collect=True``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

from torch import Tensor

# How a Deferred has its update queued: (params, grads, hypers) -> the worker's future.
Queue = Callable[[list[Tensor], Sequence[Tensor], dict[int, dict[str, float]]], Future]


class Deferred:
    """One region's update promised by ``AdamW.defer``: ``submit(grads)`` queues it (once),
    with the hyperparameters read at ``defer``; ``queued`` resolves then (or carries the
    error). ``fail(error)``: the gradients will never come (the runtime failed); waiters of
    the parameters re-raise it."""

    def __init__(
        self,
        promises: Promises,
        params: list[Tensor],
        hypers: dict[int, dict[str, float]],
        queue: Queue,
    ) -> None:
        self.params = params
        self.hypers = hypers
        self.queued: Future = Future()
        self.fresh = True  # made since the last step(), which does not wait for it
        self._promises = promises
        self._queue = queue

    def submit(self, grads: Sequence[Tensor]) -> Future:
        """Queue the update (from the runtime's hand-off thread), then let waiters of its
        parameters through: they find the queued task in the worker's tracking."""
        try:
            future = self._queue(self.params, grads, self.hypers)
        except BaseException as e:
            self._promises.settle(self, e)
            raise
        self._promises.settle(self, None)
        return future

    def fail(self, error: BaseException) -> None:
        if not self.queued.done():
            self._promises.settle(self, error)


class Promises:
    """The deferred updates an optimizer promised: per parameter the one not queued yet
    (what ``wait_params`` must wait on besides the worker), and in promise order those no
    ``wait_all``/``collect_older`` has waited for yet (what ``step()`` and ``synchronize()``
    wait on). One lock guards both: the hand-off thread settles promises while the
    caller's thread waits on them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_param: dict[Tensor, Deferred] = {}  # param -> its update, not queued yet
        self._unwaited: list[Deferred] = []  # not yet waited for by wait_all

    def promise(
        self, params: list[Tensor], hypers: dict[int, dict[str, float]], queue: Queue
    ) -> Deferred:
        """A new promise for ``params``; ``queue`` queues its update when the gradients
        come."""
        d = Deferred(self, params, hypers, queue)
        with self.lock:
            for p in params:
                self.by_param[p] = d
            self._unwaited.append(d)
        return d

    def settle(self, d: Deferred, error: BaseException | None) -> None:
        """Queued: waiters find the task in the worker. Failed: the error stays where
        wait_params finds it until step(), synchronize() or the like collected it."""
        if error is None:
            self._forget([d])
            d.queued.set_result(None)
        else:
            d.queued.set_exception(error)

    def _forget(self, deferreds: Iterable[Deferred]) -> None:
        with self.lock:
            for d in deferreds:
                for p in d.params:
                    if self.by_param.get(p) is d:
                        del self.by_param[p]

    def wait(self, deferreds: Iterable[Deferred], collect: bool = False) -> None:
        """Block until each of ``deferreds`` is queued (or failed), then raise the first
        failure; ``collect``: the caller takes the failures, so forget those promises."""
        deferreds = list(deferreds)
        errors = [d.queued.exception() for d in deferreds]
        if collect:
            self._forget(deferreds)
        for e in errors:
            if e is not None:
                raise e

    def wait_for(self, params: Iterable[Tensor]) -> None:
        """Block until the promised updates of ``params`` are queued (``wait_params``)."""
        with self.lock:
            deferreds = {id(d): d for p in params if (d := self.by_param.get(p)) is not None}
        self.wait(deferreds.values())

    def wait_all(self) -> None:
        """Block until every promise made so far is queued; collect their failures."""
        with self.lock:
            deferreds, self._unwaited = self._unwaited, []
        self.wait(deferreds, collect=True)

    def fresh(self) -> list[Deferred]:
        """The promises made since the last step() (``end_step``)."""
        with self.lock:
            return [d for d in self._unwaited if d.fresh]

    def collect_older(self) -> None:
        """``wait_all`` for the promises of earlier steps only: step() does not wait for
        its own step's (final and immediate: it has nothing to do for them, and waiting
        would keep the next forward from overlapping them)."""
        with self.lock:
            older = [d for d in self._unwaited if not d.fresh]
            self._unwaited = [d for d in self._unwaited if d.fresh]
        self.wait(older, collect=True)

    @staticmethod
    def end_step(fresh: Iterable[Deferred]) -> None:
        """step() is over: ``fresh`` belong to an earlier step from now on."""
        for d in fresh:
            d.fresh = False
