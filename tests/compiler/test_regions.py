"""Region assignment: module paths from dynamo's stacks, and layers found in models nobody adapted."""

from __future__ import annotations

import copy

import pytest
import torch

import megatrain
from megatrain.compiler.regions import module_path

from .helpers import flat, rel


@pytest.mark.parametrize("raw, path", [
    ("L['self'].layers[3]", "layers.3"),
    ("L['self'].layers.3.mlp", "layers.3.mlp"),
    ("L['args'][0].model.layers.0", "model.layers.0"),  # a decorated forward(*args)
    ("L['self']._modules['layers']._modules['0']", "layers.0"),
    ("getattr(L['self'].layers, '2')", "layers.2"),
    ("L['model'].h.11", "h.11"),
    ("L['self']", ""),
])
def test_module_path(raw, path):
    assert module_path(raw) == path


def _hf(name):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4)
    configs = {
        "llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, **common),
        "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=2, **common),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "mixtral": lambda: transformers.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                                      num_experts_per_tok=2, **common),
    }
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common))
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0))
    return transformers.AutoModelForCausalLM.from_config(configs[name](), attn_implementation="sdpa")


HF = [("llama", ["model.layers"]), ("qwen2", ["model.layers"]), ("gpt2", ["transformer.h"]),
      ("mixtral", ["model.layers"]), ("bert", ["bert.encoder.layer"]),
      ("t5", ["encoder.block", "decoder.block"])]


@pytest.mark.parametrize("name, stacks", HF, ids=[n for n, _ in HF])
def test_hugging_face_models_stream_and_train_like_eager(name, stacks):
    torch.manual_seed(0)
    model = _hf(name)
    ref = copy.deepcopy(model)
    step = torch.compile(model, backend="megatrain",
                         options={"device": "cpu", "precision": "fp32", "lowering": "eager"})
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16))
        loss_ref = ref(input_ids=ids, labels=ids).loss  # the model's own loss
        loss_ref.backward()
        loss = step(input_ids=ids, labels=ids).loss
        loss.backward()
        assert abs(loss.item() - loss_ref.item()) / loss_ref.item() < 1e-5
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    assert rel(flat(model.parameters()), flat(ref.parameters())) < 1e-3
    names = [r.name for r in megatrain.explain(step).regions]
    layers = [n for n in names if n not in ("prologue", "epilogue") and not n.startswith("between")]
    assert layers == [f"{s}.{i}" for s in stacks for i in range(3)]
    assert names[0] == "prologue" and names[-1] == "epilogue"
