"""GradSlabs: gradients of a region packed into one reused slab, backpressure when every
slab is waiting for the optimizer, and no deadlock when every slab is still filling."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatrain.runtime.grad_slabs import GradSlabs


def test_views_are_packed_aligned_and_disjoint():
    slabs = GradSlabs(pin=False)
    slabs.reserve(4 * (37 + 5 + 64) + 3 * 64)
    shapes = [torch.Size([37]), torch.Size([5]), torch.Size([8, 8])]
    views = [slabs.carve(0, s, torch.float32) for s in shapes]
    assert all(slab is views[0][1] for _, slab in views)
    for (v, _), s in zip(views, shapes):
        assert v.shape == s and v.data_ptr() % 64 == 0
        v.copy_(torch.randn(s))
    expect = [v.clone() for v, _ in views]
    for (v, _), e in zip(views, expect):  # writing one never touched another
        assert torch.equal(v, e)
    assert slabs.seal(0) is views[0][1]


def test_a_gradient_larger_than_reserved_gets_its_own_buffer():
    slabs = GradSlabs(pin=False)
    slabs.reserve(64)
    view, slab = slabs.carve(0, torch.Size([1000]), torch.float32)
    assert slab is None and view.shape == (1000,)


def test_released_slabs_are_reused_and_their_number_is_bounded():
    slabs = GradSlabs(pin=False, max_slabs=2)
    slabs.reserve(1024)
    handed = []
    for region in range(2):
        slabs.carve(region, torch.Size([16]), torch.float32)
        handed.append(slabs.seal(region))
    # Both slabs are with the hand-off: the third region waits until one comes back.
    got = []
    t = threading.Thread(target=lambda: got.append(slabs.carve(2, torch.Size([16]), torch.float32)))
    t.start()
    time.sleep(0.2)
    assert not got and slabs.allocated == 2
    slabs.release(handed[0])
    t.join(timeout=10)
    assert got and got[0][1] is handed[0] and slabs.allocated == 2


def test_every_slab_filling_allocates_instead_of_deadlocking():
    slabs = GradSlabs(pin=False, max_slabs=1)
    slabs.reserve(1024)
    a = slabs.carve(0, torch.Size([4]), torch.float32)[1]
    b = slabs.carve(1, torch.Size([4]), torch.float32)[1]  # region 0 has not been sealed
    assert a is not b and slabs.allocated == 2


def _lagging_backward(slabs: GradSlabs, regions: int) -> list:
    """Fill and seal ``regions`` regions' slabs with none released (the optimizer behind)
    on a thread; returns the slabs it got (the thread may still be blocked)."""
    got = []

    def backward():
        for region in range(regions):
            got.append(slabs.carve(region, torch.Size([16]), torch.float32)[1])
            slabs.seal(region)

    threading.Thread(target=backward, daemon=True).start()
    time.sleep(0.3)
    return got


def test_by_default_slabs_grow_beside_overlapping_work_while_host_memory_has_room(monkeypatch):
    from megatrain.memory import host_store

    total = 64 << 30
    free = {"bytes": 40 << 30}
    monkeypatch.setattr(host_store, "host_memory", lambda: (free["bytes"], total))
    slabs = GradSlabs(pin=False, overlap=lambda: True)
    slabs.reserve(1024)
    got = _lagging_backward(slabs, 5)
    assert len(got) == 5 and slabs.allocated == 5, "a lagging optimizer did not get more slabs"

    # Nothing for the GPU to do without the host: two.
    slabs = GradSlabs(pin=False, overlap=lambda: False)
    slabs.reserve(1024)
    assert len(_lagging_backward(slabs, 5)) == 2

    # Available memory at the floor (1/8 of the RAM): two, then the backward waits.
    free["bytes"] = total // 8
    slabs = GradSlabs(pin=False, overlap=lambda: True)
    slabs.reserve(1024)
    got = _lagging_backward(slabs, 5)
    assert len(got) == 2 and slabs.allocated == 2
    slabs.release(got[0])
    time.sleep(0.2)
    assert len(got) == 3 and slabs.allocated == 2, "a released slab did not unblock the backward"


def test_slabs_grow_only_within_the_bytes_host_memory_leaves_them(monkeypatch):
    from megatrain.memory import host_store

    monkeypatch.setattr(host_store, "host_memory", lambda: (40 << 30, 64 << 30))
    slabs = GradSlabs(pin=False, overlap=lambda: True, host_bytes=3 * 1024 + 1023)
    slabs.reserve(1024)
    got = _lagging_backward(slabs, 6)
    assert len(got) == 3 and slabs.allocated == 3, "slabs grew past host_bytes"
    # the first two are the plan's and always allowed, whatever the bound
    slabs = GradSlabs(pin=False, overlap=lambda: True, host_bytes=0)
    slabs.reserve(1024)
    assert len(_lagging_backward(slabs, 4)) == 2


def test_unknown_host_memory_keeps_two_slabs(monkeypatch):
    from megatrain.memory import host_store

    monkeypatch.setattr(host_store, "host_memory", lambda: None)
    slabs = GradSlabs(pin=False, overlap=lambda: True)
    slabs.reserve(1024)
    assert len(_lagging_backward(slabs, 4)) == 2


def test_a_lowered_bound_lets_slabs_go():
    slabs = GradSlabs(pin=False, max_slabs=6)
    slabs.reserve(1024)
    got = _lagging_backward(slabs, 6)
    assert slabs.allocated == 6
    for slab in got[:3]:
        slabs.release(slab)
    slabs.set_max_slabs(2)
    assert slabs.allocated == 3 and not slabs._free, "free slabs beyond the lowered bound were kept"
    slabs.release(got[3])  # in use when the bound fell: let go as it comes back
    assert slabs.allocated == 2 and not slabs._free
    slabs.release(got[4])  # within the bound: kept
    assert slabs.allocated == 2 and len(slabs._free) == 1
    with pytest.raises(ValueError, match="max_slabs=0"):
        slabs.set_max_slabs(0)
