"""Hugging Face's ForCausalLMLoss fused on CUDA in bf16 (the CPU twin, in fp32, is
tests/compiler/test_fusions.py): a transformers causal LM trained through the backend
with the fused linear-cross-entropy is as close to a float64 reference as the same model
with Hugging Face's own loss (upcast logits, shifted labels, -100 ignored), in the loss and
in every gradient. The logits are not asked for (outputs="loss"), so the head's matmul
goes too."""

from __future__ import annotations

import copy

import pytest
import torch

import megatrain

from ..compiler.helpers import compile_streamed, flat, rel

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

VOCAB = 4096


def _model(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2)
    if arch == "gemma2_softcap":  # final logits capped, tanh(z / 30) * 30, before the loss
        cfg = transformers.Gemma2Config(**common, head_dim=32, query_pre_attn_scalar=32, sliding_window=128,
                                        final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        with torch.no_grad():  # logits large enough that the cap bends them
            model.lm_head.weight.mul_(40.0)
        return model.train()
    cfg = (transformers.LlamaConfig(**common) if arch == "llama"
           else transformers.Qwen2Config(**common, tie_word_embeddings=True))
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.train()
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2_tied", "gemma2_softcap"])
def test_fused_hf_loss_in_bf16_is_as_close_to_float64_as_the_unfused(arch, no_tf32):
    torch.manual_seed(0)
    model = _model(arch)
    ids = torch.randint(0, VOCAB, (4, 256))
    labels = ids.clone()
    labels[:, :17] = -100  # a masked prompt
    ref = copy.deepcopy(model).double().cuda()
    want = ref(input_ids=ids.cuda(), labels=labels.cuda()).loss
    want.backward()
    want_grads = flat(p.grad for p in ref.parameters()).cpu()
    errors = {}
    for kernels in ((), ("linear_cross_entropy",)):
        # dynamo would reuse the first graph for a copy of the same class (its guards do
        # not see megatrain.config): compile afresh
        torch._dynamo.reset()
        streamed = copy.deepcopy(model)
        step = compile_streamed(streamed, {"device": "cuda", "precision": "bf16", "outputs": "loss",
                                           "kernels": kernels})
        loss = step(input_ids=ids, labels=labels).loss
        loss.backward()
        assert megatrain.explain(step).graphs[0].kernels == kernels
        errors[kernels] = (abs(loss.item() - want.item()) / abs(want.item()),
                           rel(flat(p.grad for p in streamed.parameters()), want_grads))
    unfused, fused = errors[()], errors[("linear_cross_entropy",)]
    assert fused[0] <= 1.5 * unfused[0] + 1e-3, errors
    assert fused[1] <= 1.5 * unfused[1] + 1e-3, errors
