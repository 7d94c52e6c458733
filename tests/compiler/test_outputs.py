"""The consent option outputs="loss": a training graph hands back its scalars only.

Against eager training of a copy on fresh random tokens (CPU, fp32): the loss and every
gradient are the same, the logits come back as a meta tensor that raises when read, a call
without labels still returns its logits with values, a graph split by a break keeps its
outputs, and a vocabulary 100x the width needs no room for its logits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megatrain.errors import MegatrainValueError
from megatrain.plan.search import InfeasibleBudget

from .helpers import compile_streamed, flat, param_bytes, rel

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

V, H, LAYERS = 128, 64, 6


def _llama(vocab=V, tied=False):
    cls = transformers.Qwen2Config if tied else transformers.LlamaConfig
    cfg = cls(vocab_size=vocab, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.train()
    return model


def _train(model, budget_fraction, vocab=V, steps=3):
    ref = copy.deepcopy(model)
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "outputs": "loss",
                                    "lowering": "eager",
                                    "gpu_memory": int(budget_fraction * param_bytes(model))})
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        ids = torch.randint(0, vocab, (2, 12))
        want = ref(input_ids=ids, labels=ids)
        got = step(input_ids=ids, labels=ids)
        assert got.logits.device.type == "meta"
        assert got.logits.shape == want.logits.shape and got.logits.dtype == want.logits.dtype
        want.loss.backward()
        got.loss.backward()
        assert abs(got.loss.item() - want.loss.item()) / abs(want.loss.item()) < 1e-5, i
        if i == 0:
            grads = flat(p.grad for p in model.parameters())
            assert rel(grads, flat(p.grad for p in ref.parameters())) < 1e-5
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    assert rel(flat(model.parameters()), flat(ref.parameters())) < 1e-3
    return step, ref


def test_the_loss_trains_like_eager_and_the_logits_are_not_made():
    model = _llama()
    step, ref = _train(model, 0.49)
    out = step(input_ids=torch.randint(0, V, (2, 12)), labels=torch.randint(0, V, (2, 12)))
    with pytest.raises((NotImplementedError, RuntimeError), match="meta"):
        out.logits.sum().item()
    # Without labels the graph has no 0-dim output: the logits come back, with values.
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        got, want = step(input_ids=ids).logits, ref(input_ids=ids).logits
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _least_budget(model, outputs, vocab):
    """The planner's least gpu_memory for a step of ``model`` (from its refusal)."""
    step = torch.compile(model, backend="megatrain", options={
        "device": "cpu", "precision": "fp32", "outputs": outputs, "gpu_memory": int(1.05 * param_bytes(model))})  # the tied vocabulary: ~all of them
    ids = torch.randint(0, vocab, (2, 12))
    with pytest.raises(InfeasibleBudget) as refused:
        step(input_ids=ids, labels=ids)
    return refused.value.min_budget


def test_a_vocabulary_100x_the_width_needs_no_room_for_its_logits():
    """With every output asked for, the step holds the [tokens, vocab] logits until the
    graph returns them (the fused loss, tried for memory, still leaves the head's matmul
    for that output); with the loss alone nothing keeps them, and the least budget drops by
    at least their fp32 bytes."""
    vocab = 100 * H
    least = {o: _least_budget(_llama(vocab, tied=True), o, vocab) for o in ("all", "loss")}
    assert least["loss"] + 2 * 12 * vocab * 4 <= least["all"], least
    model = _llama(vocab, tied=True)
    _train(model, 1.02 * least["loss"] / param_bytes(model), vocab=vocab)


class _Broken(nn.Module):
    """Layers with a graph break between them: the first graph's outputs are the hidden
    states the Python code after the break reads, and must come back with values."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, y):
        x = torch.tanh(self.layers[1](torch.tanh(self.layers[0](x))))
        torch._dynamo.graph_break()  # outside a loop: two graphs, the frame not skipped
        x = torch.tanh(self.layers[3](torch.tanh(self.layers[2](x))))
        return ((x - y) ** 2).mean(), x


@pytest.mark.filterwarnings("ignore:megatrain. the model has a graph break")
def test_a_graph_that_ends_at_a_break_keeps_its_outputs():
    torch.manual_seed(0)
    model = _Broken()
    ref = copy.deepcopy(model)
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "outputs": "loss",
                                    "lowering": "eager"})
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    loss, hidden = step(x, y)
    loss_ref, _ = ref(x, y)
    assert hidden.device.type == "meta"  # the last graph's non-scalar output
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flat(p.grad for p in model.parameters()),
                               flat(p.grad for p in ref.parameters()), rtol=1e-5, atol=1e-6)


def test_an_unknown_value_is_refused_with_the_choices():
    with pytest.raises(MegatrainValueError, match="outputs='logits'.*'all'.*'loss'"):
        torch.compile(nn.Linear(2, 2), backend="megatrain",
                      options={"device": "cpu", "outputs": "logits"})(torch.randn(1, 2))
