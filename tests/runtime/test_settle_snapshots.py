"""grad_copies.settle_snapshots: gradient snapshots are let go in stream order within the plan's
window, whatever the host has seen of the copies (the launch thread runs ahead of the GPU).

Events are stand-ins whose query() says whether the copy completed; `wait` records the
events the compute stream was ordered after."""

import torch

from megatrain.runtime.grad_copies import GradCopy, settle_snapshots


class _Event:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def _entries(sizes, done):
    return [GradCopy(done=_Event(d), snapshot=torch.empty(n, dtype=torch.float32)) for n, d in zip(sizes, done)]


def test_completed_copies_go_without_waiting():
    entries = _entries([10, 20, 30], [True, False, True])
    waited = []
    kept = settle_snapshots(entries, window=1 << 20, wait=waited.append)
    assert kept == [entries[1]] and waited == []
    assert entries[0].snapshot is None and entries[2].snapshot is None and entries[1].snapshot is not None


def test_older_snapshots_beyond_the_window_go_oldest_first_after_a_stream_wait():
    # None of the copies is seen done: the host ran ahead. Four of 400 bytes each, the
    # newest excepted; a window of 500 bytes keeps one older snapshot.
    entries = _entries([100, 100, 100, 100], [False] * 4)
    waited = []
    kept = settle_snapshots(entries, window=500, wait=waited.append)
    assert kept == entries[2:]
    assert waited == [entries[0].done, entries[1].done]
    assert entries[0].snapshot is None and entries[1].snapshot is None
    assert all(e.snapshot is not None for e in kept)


def test_the_newest_is_kept_even_with_no_window_unless_asked():
    entries = _entries([100, 100], [False, False])
    waited = []
    assert settle_snapshots(entries, window=0, wait=waited.append) == [entries[1]]
    assert waited == [entries[0].done]
    assert settle_snapshots(entries[1:], window=0, wait=waited.append, keep_newest=False) == []
    assert waited == [entries[0].done, entries[1].done] and entries[1].snapshot is None


def test_released_entries_are_not_waited_on_again():
    entries = _entries([100, 100, 100], [False] * 3)
    waited = []
    kept = settle_snapshots(entries, window=0, wait=waited.append)
    kept = settle_snapshots(entries, window=0, wait=waited.append)  # all again, as a caller might
    assert kept == [entries[2]] and waited == [entries[0].done, entries[1].done]
