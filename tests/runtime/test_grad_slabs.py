"""GradSlabs: gradients of a region packed into one reused slab, backpressure when every
slab is waiting for the optimizer, and no deadlock when every slab is still filling."""

from __future__ import annotations

import threading
import time

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
