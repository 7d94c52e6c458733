"""Token chunks on CUDA (the op in runtime/token_chunks.py, forced on through
megatrain.config): the chunked step trains like the unchunked one, in fp32 through the
eager lowering and in bf16 through Inductor, and it holds less device memory at its peak.

Tolerances: fp32 as in compare.py (both runs do the same math in another order). bf16:
each chunk's matmuls round like the whole sequence's, but the parameter gradients are
summed over chunks in fp32 where the unchunked backward sums over all tokens inside one
bf16 matmul, so they differ by bf16 rounding (~0.4% of a gradient's size); a chunk lost
or counted twice moves a gradient by a whole chunk's share (>= 1/4 here)."""

from __future__ import annotations

import pytest
import torch

from megatrain.compiler import token_chunks as pass_mod
from megatrain.models import Llama, LlamaConfig

from ..compiler.helpers import random_batches, train_megatrain
from .compare import assert_runs_agree

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

SEQ = 4 * pass_mod.MIN_CHUNK


def _llama():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=512, hidden=256, layers=2, heads=4, kv_heads=2, ffn=1024,
                              rope_theta=10000.0, max_seq=SEQ, tie_embeddings=False))
    return model, random_batches(512, 3, batch=1, seq=SEQ)


def _train(model, batches, precision, lowering, chunks):
    out = train_megatrain(model, batches, {"device": "cuda", "precision": precision, "lowering": lowering,
                                           "token_chunks": chunks, "kernels": False})
    assert (out["plan"].token_chunks > 0) == chunks, out["plan"]
    return out


def test_chunked_fp32_trains_like_unchunked_on_cuda():
    model, batches = _llama()
    chunked = _train(model, batches, "fp32", "eager", True)
    plain = _train(model, batches, "fp32", "eager", False)
    assert_runs_agree(model, [p.detach() for p in chunked["model"].parameters()],
                      [p.detach() for p in plain["model"].parameters()], chunked["losses"], plain["losses"])
    # the MLP's [S, 1024] intermediates live a chunk at a time
    assert chunked["plan"].measured_peak_bytes < plain["plan"].measured_peak_bytes, \
        (chunked["plan"].measured_peak_bytes, plain["plan"].measured_peak_bytes)


def test_chunked_bf16_under_inductor_matches_unchunked_gradients():
    model, batches = _llama()
    batches = batches[:1]
    a, b = (_train(model, batches, "bf16", "inductor", chunks) for chunks in (True, False))
    assert abs(a["losses"][0] - b["losses"][0]) <= 1e-2 * abs(b["losses"][0]), (a["losses"], b["losses"])
    # one AdamW step from the same start: the first step moves each element by ~lr*sign(g),
    # so compare the update's direction where the gradient is not tiny: sign agreement
    start = dict(model.named_parameters())
    for (name, p), q in zip(a["model"].named_parameters(), b["model"].parameters()):
        da, db = (p.detach().cpu() - start[name].detach()), (q.detach().cpu() - start[name].detach())
        agree = (da.sign() == db.sign()).float().mean().item()
        assert agree >= 0.97, f"{name}: update directions agree on {agree:.3f} of elements"
