"""Gradients for ``p.grad`` (runtime/host_grads.py) as the CUDA path hands them out: each
copy completes on the D2H stream later, so a returned tensor is filled only at the
backward's drain, except where the graph reads it first: the pieces of a tied weight, which
the backward graph adds as soon as the later one is returned.

The CPU has no D2H stream, so the copy is a stand-in whose completion (``synchronize``) is
when the staged buffer gets its values; until then it holds NaN."""

from __future__ import annotations

import torch

from megatrain.runtime import host_grads


class _Pool:
    def __init__(self):
        self.held = 0

    def acquire(self, nbytes, what):
        self.held += nbytes

    def release(self, nbytes):
        self.held -= nbytes


class _Ctx:
    def __init__(self):
        self.pool = _Pool()


class _Copy:
    """A copy in flight: `staged` gets `value` when it is waited for."""

    def __init__(self, staged, value):
        self.staged, self.value, self.finished = staged, value, False

    def query(self):
        return self.finished

    def synchronize(self):
        if not self.finished:
            self.staged.copy_(self.value)
            self.finished = True


def _device_grads(monkeypatch):
    """HostGrads whose device is a stand-in: gradients are meta tensors, their values kept
    aside, copied into NaN-filled 'pinned' buffers when each copy is waited for."""
    values = {}
    monkeypatch.setattr(host_grads, "_pinned", lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype))
    monkeypatch.setattr(host_grads, "copy_to_host",
                        lambda ctx, staged, grad: (_Copy(staged, values[id(grad)]), grad))

    def grad(value):
        g = torch.empty(value.shape, dtype=value.dtype, device="meta")
        values[id(g)] = value
        return g

    ctx = _Ctx()
    return host_grads.HostGrads(ctx), grad, ctx


def test_a_second_piece_of_one_slot_comes_back_complete_with_the_first(monkeypatch):
    sends, grad, ctx = _device_grads(monkeypatch)
    param = torch.zeros(5, 3)
    first, second, other = (torch.randn(5, 3, dtype=dtype) for dtype in (torch.float32, torch.bfloat16,
                                                                         torch.float32))
    a = sends.send(grad(first), param, 7)
    b = sends.send(grad(other), param, 8)
    c = sends.send(grad(second), param, 7)   # the graph now adds a and c
    assert torch.equal(a, first) and torch.equal(c, second.float()) and c.dtype == torch.float32
    assert torch.isnan(b).all(), "a single piece stays asynchronous until the drain"
    sends.finish()
    assert torch.equal(b, other) and ctx.pool.held == 0


def test_single_pieces_complete_at_the_drain_in_the_parameters_dtype(monkeypatch):
    sends, grad, ctx = _device_grads(monkeypatch)
    param = torch.zeros(4)
    values = [torch.randn(4, dtype=torch.bfloat16) for _ in range(3)]
    outs = [sends.send(grad(v), param, i) for i, v in enumerate(values)]
    sends.finish()
    assert all(torch.equal(o, v.float()) and o.dtype == torch.float32 for o, v in zip(outs, values))
    assert ctx.pool.held == 0
