"""host_store.host_views: page-locked views whose lock lives as long as the views do.

The lock itself needs a CUDA device, so `page_locked` is swapped for a stand-in that hands
out a plain buffer and a lock recording its release; the views' lifetime logic is what is
under test (tests/gpu/test_streamer_cuda.py checks real page-locked shadows)."""

import gc

import torch

from megatrain.memory import host_store
from megatrain.memory.layout import FlatLayout


class _Lock:
    def __init__(self, users: int):
        self.users, self.dropped = users, False

    def drop(self) -> None:
        self.users -= 1
        self.dropped = self.users == 0


def test_views_stay_locked_until_the_last_view_is_collected(monkeypatch):
    locks = []

    def fake_page_locked(numel, dtype, users):
        # A slice of a larger buffer, as the real one returns: the views carved from it
        # have that buffer, not the returned tensor, as their base, so nothing keeps the
        # returned tensor's Python object alive (the real one's dtype view of raw bytes
        # behaves so on torch 2.11, where the shadows lost their lock).
        locks.append(_Lock(users))
        return torch.zeros(numel + 64, dtype=dtype)[:numel], locks[-1]

    monkeypatch.setattr(host_store, "page_locked", fake_page_locked)
    layout = FlatLayout.of([(3, 5), (7,), (2, 2, 2)])
    views = host_store.host_views(layout, torch.bfloat16, pin=True)
    gc.collect()
    # The flat buffer the views were carved from is gone; the pages must still be locked.
    assert [tuple(v.shape) for v in views] == [(3, 5), (7,), (2, 2, 2)]
    assert all(v.dtype == torch.bfloat16 for v in views)
    assert not locks[0].dropped
    first = views.pop(0)
    del first
    gc.collect()
    assert not locks[0].dropped  # two views still read the pages
    views.clear()
    gc.collect()
    assert locks[0].dropped


def test_unpinned_views_are_zeroed_host_memory():
    views = host_store.host_views(FlatLayout.of([(4, 4), (9,)]), torch.float32, pin=False)
    assert [tuple(v.shape) for v in views] == [(4, 4), (9,)]
    assert all(v.device.type == "cpu" and not v.any() for v in views)
