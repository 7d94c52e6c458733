"""Attention over a long sequence streams without its [S, S] matrix: the step fits a budget
smaller than one head's score matrix, and trains like eager."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import megatrain
from megatrain.models import Llama, LlamaConfig
from tests.compiler.helpers import compile_streamed, cpu_peak_bytes


def _own_llama(seq):
    cfg = LlamaConfig(vocab_size=128, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64,
                      rope_theta=10000.0, max_seq=seq)
    return Llama(cfg), lambda m, ids, labels: m(ids, labels=labels)


def _hf_llama(seq):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model, lambda m, ids, labels: m(input_ids=ids, labels=labels).loss


@pytest.mark.parametrize("build", [_own_llama, _hf_llama], ids=["own_llama", "hf_llama"])
def test_a_sequence_whose_score_matrix_exceeds_the_budget_trains_like_eager(build):
    """One sequence of S tokens (S = 2048..4096): a single head's fp32 [S, S] scores
    (16-64 MiB) would not fit the 14 MiB budget, yet the planned and measured step fit it,
    and the loss and gradients match eager fp32 (SDPA's fused kernel, forward and
    backward, in both; Hugging Face's causal mask stays SDPA's own, never a [S, S] tensor)."""
    torch.manual_seed(random.randint(0, 10**6))
    seq = random.choice([2048, 3072, 4096])
    model, loss_of = build(seq)
    ref = copy.deepcopy(model)
    ids, labels = torch.randint(0, 128, (1, seq)), torch.randint(0, 128, (1, seq))
    budget = 14 << 20
    assert budget < seq * seq * 4  # one head's scores alone would not fit
    step = compile_streamed(model, {"device": "cpu", "gpu_memory": budget, "lowering": "eager",
                                    "precision": "fp32"})
    out = {}

    def run():
        out["loss"] = loss_of(step, ids, labels)
        out["loss"].backward()

    run()  # compiles; the step measured is the next one, on the same batch
    model.zero_grad(set_to_none=True)
    peak = cpu_peak_bytes(run)
    plan = megatrain.explain(step)
    assert plan.predicted_peak_bytes <= budget and peak <= budget, (plan.predicted_peak_bytes, peak)
    loss_ref = loss_of(ref, ids, labels)
    loss_ref.backward()
    assert abs(out["loss"].item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
