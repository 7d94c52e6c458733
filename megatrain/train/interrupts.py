"""Stopping a run without losing it: SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption)
ask the training loop to stop at the next step boundary, where it saves a complete
checkpoint; a second signal stops at once, keeping what the last checkpoint holds.

Why at a step boundary: mid-step the optimizer may still be applying updates and the
gradients of the step are half handed off, so the only consistent state to save is the one
between two steps. The handlers are installed only in the main thread of a single-process
run: under torchrun every rank would have to agree on the step first.
"""

from __future__ import annotations

import signal
import threading
from typing import Self

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(Exception):
    """The run stopped on a signal; the message says which step --resume continues from."""


class StopOnSignal:
    """Context manager: `requested` holds the first signal's name once one arrived; the
    previous handlers come back on exit, and a second signal meanwhile raises
    KeyboardInterrupt at once."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> Self:
        if self.enabled:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._first)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _first(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        for sig in SIGNALS:
            signal.signal(sig, self._again)

    @staticmethod
    def _again(signum, frame) -> None:
        raise KeyboardInterrupt
