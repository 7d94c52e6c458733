"""Prefetch across graphs: the runtime learns which graph runs after which and fetches the
next one's first region early; a fetch whose weights changed before use is not used, and
nothing is fetched early without room in the budget or across the step boundary."""

from __future__ import annotations

import pytest
import torch

from megatrain.runtime import graph_order, streamer as streamer_mod
from megatrain.memory.layout import FlatLayout


@pytest.fixture(autouse=True)
def _fresh_order():
    graph_order.forget()
    yield
    graph_order.forget()


def _graph(budget: int):
    params = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(3))]
    s = streamer_mod.Streamer(torch.device("cpu"), torch.float32, budget, params)
    streamer_mod.register(s)
    return s, params


def _run(s, params, phase: str) -> torch.Tensor:
    """One graph's schedule with a single region: fetch, use, evict, prefetch_next."""
    if phase == "forward":
        s.begin_step()
    s.prefetch(0, params)
    numel = FlatLayout.of([p.shape for p in params]).numel
    flat = s.wait(0, numel)
    got = flat.clone()
    s.evict(0, flat)
    s.prefetch_next(phase)
    return got


def _step(a, b):
    """Forward A, forward B, backward B, backward A: B's fetched regions, per phase."""
    _run(*a, "forward")
    fb = _run(*b, "forward")
    bb = _run(*b, "backward")
    _run(*a, "backward")
    return fb, bb


def _same(flat, params) -> bool:
    views = FlatLayout.of([p.shape for p in params]).views(flat)
    return all(torch.equal(v, p.detach()) for v, p in zip(views, params))


def test_second_step_fetches_the_next_graphs_first_region_early():
    a, b = _graph(1 << 20), _graph(1 << 20)
    _step(a, b)
    assert b[0].stats.early_hits == 0  # the first step only learns the order
    fb, bb = _step(a, b)
    assert b[0].stats.early_hits == 2 and a[0].stats.early_hits == 1
    assert _same(fb, b[1]) and _same(bb, b[1])


def test_an_early_fetch_of_weights_changed_since_is_not_used():
    a, b = _graph(1 << 20), _graph(1 << 20)
    _step(a, b)
    _run(*a, "forward")  # fetches B's first region early
    with torch.no_grad():
        b[1][0].add_(1.0)  # an update lands before B runs
    fb = _run(*b, "forward")
    assert b[0].stats.early_hits == 0 and _same(fb, b[1])
    # The stale fetch's bytes went back; what is live is B's backward's early fetch.
    assert b[0].pool.live == FlatLayout.of([p.shape for p in b[1]]).numel * 4 and list(b[0]._early) == [0]


def test_no_early_fetch_without_room_or_across_the_step_boundary():
    numel = FlatLayout.of([(5, 7), (3,)]).numel
    a, b = _graph(1 << 20), _graph(numel * 4)  # B's budget holds one region only
    _step(a, b)
    b[0].pool.acquire(1, "something else live")
    _run(*a, "forward")
    assert not b[0]._early
    b[0].pool.release(1)
    _step(a, b)
    # After A's backward (end of step) nothing was fetched for A's next forward.
    assert not a[0]._early
