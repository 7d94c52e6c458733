"""Token chunks on CUDA (the op in runtime/token_chunks.py, forced on through
megatrain.config): the chunked step trains like the unchunked one, in fp32 through the
eager lowering and in bf16 through Inductor, and it holds less device memory at its peak.

Tolerances: fp32 as in compare.py (both runs do the same math in another order). bf16:
each chunk's matmuls round like the whole sequence's, but the parameter gradients are
summed over chunks in fp32 where the unchunked backward sums over all tokens inside one
bf16 matmul, so they differ by bf16 rounding (~0.4% of a gradient's size); a chunk lost
or counted twice moves a gradient by a whole chunk's share (>= 1/4 here)."""

from __future__ import annotations

import copy

import pytest
import torch

from megatrain.compiler import token_chunks as pass_mod
from megatrain.models import Llama, LlamaConfig

from ..compiler.helpers import compile_streamed, random_batches, train_megatrain
from .compare import assert_runs_agree

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

SEQ = 4 * pass_mod.MIN_CHUNK


def _llama():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=512, hidden=256, layers=2, heads=4, kv_heads=2, ffn=1024,
                              rope_theta=10000.0, max_seq=SEQ, tie_embeddings=False))
    return model, random_batches(512, 3, batch=1, seq=SEQ)


def _options(precision, lowering, chunks):
    return {"device": "cuda", "precision": precision, "lowering": lowering, "token_chunks": chunks, "kernels": False}


def _train(model, batches, precision, lowering, chunks):
    out = train_megatrain(model, batches, _options(precision, lowering, chunks))
    assert (out["plan"].token_chunks > 0) == chunks, out["plan"]
    return out


def _first_gradients(model, batch, precision, lowering, chunks):
    """One step's loss and parameter gradients of a copy of `model` (torch's autograd
    leaves them on the host parameters' .grad)."""
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    ids, labels = batch
    loss = compile_streamed(model, _options(precision, lowering, chunks))(ids, labels=labels)
    loss.backward()
    return loss.item(), [p.grad.detach().float().cpu() for p in model.parameters()]


def test_chunked_fp32_trains_like_unchunked_on_cuda():
    """Gradients equal to fp32 summation order (the CPU test's tolerance against eager);
    three megatrain.AdamW steps give the same losses; the peak is lower. Parameters after
    AdamW are not compared elementwise: an element whose gradient cancels to ~eps moves by
    a share of lr on a last-bit difference (compare.py)."""
    model, batches = _llama()
    (loss_a, grads_a), (loss_b, grads_b) = (_first_gradients(model, batches[0], "fp32", "eager", chunks)
                                            for chunks in (True, False))
    assert abs(loss_a - loss_b) <= 1e-6 * abs(loss_b)
    for (name, _), a, b in zip(model.named_parameters(), grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    chunked = _train(model, batches, "fp32", "eager", True)
    plain = _train(model, batches, "fp32", "eager", False)
    assert_runs_agree(model, [p.detach() for p in chunked["model"].parameters()],
                      [p.detach() for p in plain["model"].parameters()], chunked["losses"], plain["losses"],
                      compare_params=False)
    # the MLP's [S, 1024] intermediates live a chunk at a time
    assert chunked["plan"].measured_peak_bytes < plain["plan"].measured_peak_bytes, \
        (chunked["plan"].measured_peak_bytes, plain["plan"].measured_peak_bytes)


def test_chunked_bf16_under_inductor_matches_unchunked_gradients():
    """bf16 through Inductor: the loss within 1% and each parameter's gradient within 3% of
    the unchunked one in relative norm (bf16 rounding is ~0.4%): a lost or doubled chunk
    moves a gradient by a quarter of its size."""
    model, batches = _llama()
    (loss_a, grads_a), (loss_b, grads_b) = (_first_gradients(model, batches[0], "bf16", "inductor", chunks)
                                            for chunks in (True, False))
    assert abs(loss_a - loss_b) <= 1e-2 * abs(loss_b), (loss_a, loss_b)
    for (name, _), a, b in zip(model.named_parameters(), grads_a, grads_b):
        scale = b.abs().max().item()
        err = (a - b).norm().item() / max(b.norm().item(), 1e-30)
        assert err <= 0.03, f"{name}: relative error {err:.4f} (largest |g| {scale:.3e})"
