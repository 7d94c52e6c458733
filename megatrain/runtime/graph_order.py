"""The order in which compiled graphs run, learned as they run, for prefetch across graphs.

A model with graph breaks becomes several graph pairs, each with its own Streamer, and
each graph fetches its first region only when it starts: every boundary would cost one
unhidden transfer. Each graph ends its schedule with `prefetch_next(phase)`; here the
runtime remembers which (streamer, phase) ran after which, and on the next step starts the
successor's first fetch while the current graph still computes.

Nothing crosses a step: after a backward, the next forward's first region is the last one
the optimizer updates, so there is nothing to gain and a stale copy to risk. A successor
that did not run last time, or a fetch whose weights changed before use, is simply not
used (see Streamer.prefetch_next and Streamer.prefetch).
"""

from __future__ import annotations

import threading

Phase = tuple[int, str]  # (streamer index, "forward" | "backward")

_lock = threading.Lock()
_last: Phase | None = None
_next_of: dict[Phase, Phase] = {}


def finished(phase: Phase) -> Phase | None:
    """`phase` reached its prefetch_next: record it after the previous one; return the
    phase that followed it last time, if it is worth fetching for (not across a step)."""
    global _last
    with _lock:
        if _last is not None and _last != phase:
            _next_of[_last] = phase
        _last = phase
        nxt = _next_of.get(phase)
    if nxt is None or (phase[1] == "backward" and nxt[1] == "forward"):
        return None
    return nxt


def forget() -> None:
    """Drop everything learned (tests; a new model)."""
    global _last
    with _lock:
        _last = None
        _next_of.clear()
