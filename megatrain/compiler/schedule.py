"""When each region's weights move: a simple prefetch-k-ahead schedule.

Input: for one graph (forward or backward), each region's first and last use, in node order.
Output: a list of `Transfer` events anchored to positions in that order. At most `slots`
regions are resident (prefetched and not yet evicted); a region is prefetched as soon as a
slot frees, in first-use order. If a region's first use comes while every slot is taken
(regions used in interleaved spans), it is fetched late, right before its use, and the
plan records the overshoot, so the memory model stays truthful.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RegionUse:
    region: int
    first: int  # position of the first node that uses the region's weights
    last: int  # position of the last such node
    nbytes: int


@dataclass(frozen=True)
class Transfer:
    kind: str  # "prefetch" | "wait" | "evict"
    region: int
    anchor: int  # node position; prefetch at -1 means "at graph start"
    after: bool  # insert after the anchor (True) or before it (False)


def prefetch_schedule(uses: list[RegionUse], slots: int) -> list[Transfer]:
    if slots < 1:
        raise ValueError(f"slots={slots}: need at least one device slot")
    order = sorted(uses, key=lambda u: u.first)
    events: list[Transfer] = []
    issued = 0
    resident = 0

    def issue(anchor: int, after: bool) -> None:
        nonlocal issued, resident
        events.append(Transfer("prefetch", order[issued].region, anchor, after))
        issued += 1
        resident += 1

    while issued < len(order) and resident < slots:
        issue(-1, True)
    timeline = sorted([(u.first, 0, u) for u in order] + [(u.last, 1, u) for u in order],
                      key=lambda t: (t[0], t[1]))
    index = {u.region: i for i, u in enumerate(order)}
    for pos, is_evict, use in timeline:
        if not is_evict:
            while issued <= index[use.region]:
                issue(pos, False)  # late: every slot was taken
            events.append(Transfer("wait", use.region, pos, False))
        else:
            events.append(Transfer("evict", use.region, pos, True))
            resident -= 1
            while issued < len(order) and resident < slots:
                issue(pos, True)
    return events
