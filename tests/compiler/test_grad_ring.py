"""The gradient ring (option grad_chunk, megatrain.runtime.grad_ring): gradients cross to
the host through a few fixed-size chunks, each handed to megatrain.AdamW as pieces.

The ring's cutting is tested directly; through the backend (device="cpu") with chunks far
smaller than a parameter, so that gradients are cut everywhere, results must equal the
region slabs' bitwise, with clipping, accumulation, tied weights and graph breaks.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import megatrain
from megatrain.errors import MegatrainValueError
from megatrain.models import Llama
from megatrain.optim.functional import PIECE_ALIGN
from megatrain.runtime.grad_ring import GradRing

from .helpers import compile_streamed, SMALL_VOCAB, breaking_llama, random_batches, small_llama_config, train_megatrain

VOCAB = SMALL_VOCAB


@pytest.fixture(autouse=True)
def no_cached_rates(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))


# ---- the ring alone ------------------------------------------------------------------


def test_ring_cuts_gradients_at_aligned_points_and_fills_chunks():
    ring = GradRing(chunk_bytes=1000 * 4, chunks=2, pin=False)  # rounded down to 3840 B
    assert ring.chunk_bytes == 3840
    sizes = [700, 1000, 3, 64]
    sealed, cuts = [], []
    for n in sizes:
        start = 0
        while start < n:
            view, chunk = ring.carve(n - start, torch.float32)
            assert view.numel() == n - start or view.numel() % PIECE_ALIGN == 0
            chunk.pieces.append((n, start, view, None))
            cuts.append((n, start, view.numel()))
            start += view.numel()
            full = ring.seal_if_full()
            if full is not None:
                sealed.append(full)
                ring.release(full)
    last = ring.seal()
    # 700 fits; 1000 does not fit the rest (960 - 704 = 256 elements): cut at 256
    assert cuts[:3] == [(700, 0, 700), (1000, 0, 256), (1000, 256, 744)]
    assert all(start % PIECE_ALIGN == 0 for _, start, _ in cuts)
    assert len(sealed) == 1 and last is not None and ring.allocated == 1  # the sealed one came back
    assert ring.seal() is None  # nothing carved since


def test_ring_waits_for_a_chunk_when_all_are_out():
    ring = GradRing(chunk_bytes=256, chunks=2, pin=False)
    out = []
    for _ in range(2):
        ring.carve(64, torch.float32)
        out.append(ring.seal_if_full())
    assert all(c is not None for c in out) and ring.allocated == 2
    got = []
    t = threading.Thread(target=lambda: got.append(ring.carve(64, torch.float32)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # backpressure: no third chunk
    ring.release(out[0])
    t.join(5)
    assert got and got[0][1] is out[0] and ring.allocated == 2


# ---- through the backend ---------------------------------------------------------------


def llama(tied=False, layers=3):
    return Llama(small_llama_config(layers, tied))


def train(model, batches, grad_chunk, **kw):
    out = train_megatrain(model, batches, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                           "grad_chunk": grad_chunk}, **kw)
    return dict(out, streamers=[g.streamer for g in megatrain.explain(out["step"]).graphs])


CHUNK = 64 << 10  # 64 KiB: the 160 x 64 embedding (40 KiB) and the MLPs are cut across chunks


@pytest.mark.parametrize("tied", [False, True])
def test_ring_trains_bitwise_like_region_slabs(tied):
    torch.manual_seed(0)
    model = llama(tied)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    ring = train(model, batches, CHUNK)
    slabs = train(model, batches, None)
    assert torch.equal(ring["params"], slabs["params"]) and ring["losses"] == slabs["losses"]
    (s,) = ring["streamers"]
    assert s._ring is not None and s._ring.allocated <= 4
    if tied:  # the tied weight's two contributions meet in a region slab
        assert s._slabs.allocated >= 1
    else:
        assert s._slabs.allocated == 0, "every gradient took the ring"
    assert slabs["streamers"][0]._ring is None


@pytest.mark.parametrize("case", ["clip", "accumulate"])
def test_ring_stays_exact_when_updates_wait_for_step(case):
    torch.manual_seed(1)
    model = llama(layers=2)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    kw = dict(max_grad_norm=0.5) if case == "clip" else dict(accumulate=True)
    ring = train(model, batches, CHUNK, **kw)
    slabs = train(model, batches, None, **kw)
    assert torch.equal(ring["params"], slabs["params"]) and ring["losses"] == slabs["losses"]


def test_ring_submits_the_next_chunk_while_the_optimizer_updates_one(monkeypatch):
    """The hand-off does not wait for a chunk's update before it submits the next, so the
    optimizer's FIFO never idles between chunks: the first update holds until a second
    submission arrives (the old serial hand-off would make it wait out the timeout); then
    every chunk still comes back and the results stay the slabs'."""
    torch.manual_seed(3)
    model = llama(layers=2)
    batches = random_batches(VOCAB, 2, batch=2, seq=16)
    slabs = train(model, batches, None)

    submitted, overlapped = [], []
    second = threading.Event()
    submit, apply = megatrain.AdamW.submit_pieces, megatrain.AdamW._apply_pieces

    def counting_submit(self, pieces):
        submitted.append(len(pieces))
        if len(submitted) == 2:
            second.set()
        return submit(self, pieces)

    def held_apply(self, work, hypers):
        if not overlapped:
            overlapped.append(second.wait(timeout=10))
        return apply(self, work, hypers)

    monkeypatch.setattr(megatrain.AdamW, "submit_pieces", counting_submit)
    monkeypatch.setattr(megatrain.AdamW, "_apply_pieces", held_apply)
    ring = train(model, batches, CHUNK)
    assert overlapped == [True], "the second chunk waited for the first chunk's update"
    assert len(submitted) > 2
    (s,) = ring["streamers"]
    assert len(s._ring._free) == s._ring.allocated, "a chunk never came back"
    assert torch.equal(ring["params"], slabs["params"]) and ring["losses"] == slabs["losses"]


def test_ring_with_a_graph_break_inside_the_layer_loop():
    """One layer graph run for every layer: each run's parameters travel with their
    pieces; the embedding and head, handed in by two graphs, take the p.grad path."""
    torch.manual_seed(2)
    model = breaking_llama("inside the layer loop", small_llama_config())
    batches = random_batches(VOCAB, 2, batch=2, seq=16)
    with pytest.warns(UserWarning, match="graph break"):
        ring = train(model, batches, CHUNK)
        slabs = train(model, batches, None)
    assert torch.equal(ring["params"], slabs["params"]) and ring["losses"] == slabs["losses"]


def test_grad_chunk_option_is_checked():
    model = llama(layers=1)
    for bad, match in [(100, "at least"), ("12 apples", "not a size")]:
        with pytest.raises(MegatrainValueError, match=match):
            step = compile_streamed(copy.deepcopy(model), {"device": "cpu", "grad_chunk": bad})
            step(*random_batches(VOCAB, 1, batch=1, seq=8)[0])
    with pytest.raises(MegatrainValueError, match="with backlog=.device.*drop one"):
        step = compile_streamed(copy.deepcopy(model), {"device": "cpu", "grad_chunk": "1MiB", "backlog": "device"})
        step(*random_batches(VOCAB, 1, batch=1, seq=8)[0])
