"""The order in which regions' gradients reach the host optimizer: earliest deadline first.

Why: where the host AdamW bounds the step it lags the backward (its updates can take
longer than the whole backward), and in arrival order (last layer first) region 0,
whose gradient comes last and whose weights the next forward needs first, is updated last:
the next forward starts only when every update is done, and the step is the updates plus
the forward. Served earliest
deadline first, the deadline being the region's first fetch in the forward, the updates
the host has not reached when backward ends are those the next forward needs last; the
forward runs beside them, each fetch waiting only for its own region's update
(Streamer.wait_updates), so the step tends to max(updates, GPU work).

Order only: every region's update still happens once per step, with the gradients and
hyperparameters it would have had, and an update always precedes the next fetch of its
parameters (the fetch waits for it), so results are bitwise those of arrival order.

``Deadlines`` learns the forward's fetch order; ``DeadlineQueue`` serves waiting items by
it (or, without deadlines, in arrival order), testable without a device.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
from collections.abc import Callable

SERVED_KEPT = 256  # DeadlineQueue.served keeps the last this many (tests, benchmarks)


class Deadlines:
    """A region's deadline: the position of its first fetch in the first forward seen
    (``learn`` is called at each forward fetch); regions never fetched in a forward come
    last, by id."""

    def __init__(self) -> None:
        self._rank: dict[int, int] = {}

    def learn(self, region: int) -> None:
        self._rank.setdefault(region, len(self._rank))

    def of(self, region: int) -> tuple[float, int]:
        return (self._rank.get(region, math.inf), region)


class DeadlineQueue:
    """Items waiting to be served, each for one region: earliest deadline first, and among
    items that say whether they are ready (``ready``: e.g. their gradients' copies are
    done), the earliest ready one before any that is not, so the server never waits on a
    copy while another region could be updated. ``deadlines=None``: arrival order, no
    preference. The same region may wait twice (a graph dynamo runs for several modules):
    then first come, first served. Thread-safe; ``bytes`` counts what the items hold."""

    def __init__(self, deadlines: Deadlines | None) -> None:
        self.deadlines = deadlines
        self.bytes = 0
        # Each region served, with the regions it left waiting (tests, benchmarks).
        self.served: collections.deque[tuple[int, tuple[int, ...]]] = collections.deque(maxlen=SERVED_KEPT)
        self._items: list[tuple[tuple, int, object, int, Callable[[], bool] | None]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def push(self, region: int, item: object, nbytes: int = 0,
             ready: Callable[[], bool] | None = None) -> None:
        seq = next(self._seq)
        key = (self.deadlines.of(region), seq) if self.deadlines is not None else (seq,)
        with self._lock:
            self._items.append((key, region, item, nbytes, ready))
            self._items.sort(key=lambda entry: entry[0])
            self.bytes += nbytes

    def peek(self) -> int | None:
        """The region served next if nothing changes (ignoring readiness)."""
        with self._lock:
            return self._items[0][1] if self._items else None

    def pop(self) -> tuple[int, object] | None:
        """The next (region, item), or None when nothing waits."""
        with self._lock:
            if not self._items:
                return None
            i = 0
            if self.deadlines is not None:
                i = next((k for k, entry in enumerate(self._items)
                          if entry[4] is None or entry[4]()), 0)
            _, region, item, nbytes, _ = self._items.pop(i)
            self.bytes -= nbytes
            self.served.append((region, tuple(entry[1] for entry in self._items)))
            return region, item

    def waiting(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(entry[1] for entry in self._items)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
