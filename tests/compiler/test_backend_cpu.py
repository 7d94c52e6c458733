"""End to end on the CPU device: megatrain training equals eager training.

`device="cpu"` runs the very pipeline used on the GPU (re-homing, region partition, FX
transfer nodes, Inductor C++ lowering, real copies into a budgeted pool), in fp32.
Bounds (issue 2): losses 1e-5 relative; first-step gradients 1e-5 relative (norm over all
parameters); parameters after 3 AdamW steps 1e-3 relative (Inductor reorders float sums and
AdamW's first steps are sign-like, amplifying that noise near zero; a stale or missed
weight shows orders of magnitude above these bounds).
"""

from __future__ import annotations

import copy

import pytest
import torch

import megatrain
from megatrain.models import GPT2, GPT2Config, Llama, LlamaConfig

from .helpers import (compile_streamed, assert_streams_each_weighted_region_once, param_bytes, rel, random_batches,
                      train_side_by_side)


def llama(tied: bool, layers: int = 8) -> Llama:
    return Llama(LlamaConfig(vocab_size=160, hidden=64, layers=layers, heads=4, kv_heads=2, ffn=176,
                             rope_theta=10000.0, tie_embeddings=tied))


def gpt2(layers: int = 8) -> GPT2:
    return GPT2(GPT2Config(vocab_size=160, hidden=64, layers=layers, heads=4, max_seq=64))


MODELS = {
    "llama-untied": lambda: llama(tied=False),
    "llama-tied": lambda: llama(tied=True),
    "gpt2": gpt2,
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_matches_eager(name):
    torch.manual_seed(torch.seed() % 2**31)
    model = MODELS[name]()
    budget = int(0.45 * param_bytes(model))
    opts = {"device": "cpu", "precision": "fp32", "gpu_memory": budget}
    r = train_side_by_side(model, random_batches(160, 3, batch=2, seq=24), opts, lr=3e-3)
    for a, b in zip(r["loss"], r["loss_ref"]):
        assert abs(a - b) / abs(b) < 1e-5, (r["loss"], r["loss_ref"])
    assert rel(r["grads"], r["grads_ref"]) < 1e-5
    assert rel(r["params"], r["params_ref"]) < 1e-3
    plan = r["plan"]
    assert plan.measured_peak_bytes is not None and 0 < plan.measured_peak_bytes <= budget
    assert plan.predicted_peak_bytes <= budget
    assert_streams_each_weighted_region_once(plan)


def test_regions_are_the_layers_plus_outer_regions():
    model = llama(tied=True, layers=5)
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager"})
    ids = torch.randint(0, 160, (2, 8))
    step(ids, labels=ids).backward()
    import megatrain

    names = [r.name for r in megatrain.explain(step).regions]
    assert names == ["prologue"] + [f"layers.{i}" for i in range(5)] + ["epilogue"]
    regions = megatrain.explain(step).regions
    # The tied weight is fetched by both regions that use it.
    assert "embed_tokens.weight" in regions[0].param_fqns
    assert "embed_tokens.weight" in regions[-1].param_fqns
    assert regions[1].param_fqns == [
        "layers.0.input_layernorm.weight", "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight", "layers.0.post_attention_layernorm.weight",
        "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight"]


def test_saved_activations_are_region_boundaries_only():
    torch.manual_seed(0)
    model = llama(tied=False, layers=3)
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager"})
    ids = torch.randint(0, 160, (2, 8))
    step(ids, labels=ids).backward()
    import megatrain

    g = megatrain.explain(step).graphs[0]
    b, t, h = 2, 8, 64
    residual = b * t * h * 4
    # Residual stream after the embedding and after each layer, the rotary tables and the
    # input ids: nothing per-layer-internal, nothing derived from weights.
    assert g.saved_activation_bytes <= 4 * residual + 2 * t * (h // 4) * 4 * 2 + 2 * b * t * 8
    assert g.saved_activation_bytes >= 3 * residual


def test_inference_streams_too():
    torch.manual_seed(0)
    model = llama(tied=False, layers=3)
    ids = torch.randint(0, 160, (2, 8))
    with torch.no_grad():
        ref = model(ids)
        step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager"})
        out = step(ids)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    import megatrain

    assert any(e.startswith("prefetch(") for e in megatrain.explain(step).graphs[0].forward_events)


def test_graph_break_trains_with_a_warning():
    class Breaking(Llama):
        def forward(self, input_ids, labels=None):
            x = self.embed_tokens(input_ids)
            cos, sin = self.rotary(x, input_ids.shape[1])
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin)
                if i == 1:
                    torch._dynamo.graph_break()
            logits = self.lm_head(self.norm(x))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    torch.manual_seed(0)
    model = Breaking(LlamaConfig(vocab_size=160, hidden=64, layers=4, heads=4, kv_heads=2, ffn=176,
                                 rope_theta=10000.0))
    opts = {"device": "cpu", "precision": "fp32", "lowering": "eager"}
    with pytest.warns(UserWarning, match="graph break"):
        r = train_side_by_side(model, random_batches(160, 3, batch=2, seq=8), opts, lr=3e-3)
    for a, b in zip(r["loss"], r["loss_ref"]):
        assert abs(a - b) / abs(b) < 1e-5
    assert rel(r["grads"], r["grads_ref"]) < 1e-5
    assert rel(r["params"], r["params_ref"]) < 1e-3
    # Prefetch continues across the break: from the second step on, each graph that runs
    # next has its first region fetched while the one before still runs: the second
    # graph's forward (by the first forward) and backward (by its own forward), the first
    # graph's backward (by the second backward); never across the step boundary.
    graphs = r["plan"].graphs
    assert len(graphs) == 2
    assert all("prefetch_next" in g.forward_events + g.backward_events for g in graphs)
    assert sorted(g.streamer.last_stats.early_hits for g in graphs) == [1, 2]


def test_kernels_option_swaps_in_the_triton_kernels():
    torch.manual_seed(0)
    model = llama(tied=False, layers=2)
    opts = {"device": "cpu", "precision": "fp32", "lowering": "eager", "kernels": True}
    r = train_side_by_side(model, random_batches(160, 2, batch=2, seq=8), opts, steps=2, lr=3e-3)
    for a, b in zip(r["loss"], r["loss_ref"]):
        assert abs(a - b) / abs(b) < 1e-5
    assert rel(r["grads"], r["grads_ref"]) < 1e-5
    code = r["plan"].code
    for op in ("megatrain.rms_norm", "megatrain.rope", "megatrain.swiglu", "megatrain.fused_linear_cross_entropy"):
        assert op in code, op


def test_varying_sequence_length_recompiles_once():
    """Torch's automatic dynamic shapes: the second length recompiles with a symbolic
    sequence, every later length reuses that graph (and its transfer schedule)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = llama(tied=False, layers=2)
    ref = copy.deepcopy(model)
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager"})
    graphs_before = counters["stats"]["unique_graphs"]  # counters live for the whole process
    for t in (16, 24, 32, 40):
        ids = torch.randint(0, 160, (2, t))
        loss = step(ids, labels=ids)
        loss.backward()
        loss_ref = ref(ids, labels=ids)
        loss_ref.backward()
        assert abs(loss.item() - loss_ref.item()) / loss_ref.item() < 1e-5
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
    # The reused graph's plan is symbolic: its sizes are sympy expressions in dynamo's
    # symbols, proven at the sizes it was compiled for and growing with them.
    import megatrain

    plan = megatrain.explain(step).graphs[-1].schedule.plan
    assert plan.symbolic is not None and plan.dims
    expr = plan.peak_expression()
    assert expr.free_symbols and expr.free_symbols <= set(plan.dims)
    assert int(expr.subs(plan.dims)) == plan.peak_bytes
    assert int(expr.subs({s: 2 * v for s, v in plan.dims.items()})) > plan.peak_bytes


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_dropout_backward_uses_the_forward_mask(lowering):
    """Compiled RNG cannot replay eager's generator, so masks differ from eager's by
    construction; what must hold is that backward uses the very mask forward drew (the
    partition saves random ops' outputs; under Inductor its joint-graph passes first turn
    them into seeded `inductor_random` ops, whose seeds the partition saves).
    h = dropout(x @ W0^T, 0.5), y = h @ W1^T, loss = sum(y * g):
    dL/dW0 = ((g @ W1) * mask * 2)^T x, with the mask seen as h != 0."""

    class Dropping(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32, bias=False) for _ in range(2))

        def forward(self, x, g):
            h = torch.nn.functional.dropout(self.layers[0](x), p=0.5, training=True)
            y = self.layers[1](h)
            return (y * g).sum(), h

    torch.manual_seed(torch.seed() % 2**31)
    model = Dropping()
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": lowering})
    x, g = torch.randn(16, 32), torch.randn(16, 32)
    loss, h = step(x, g)
    loss.backward()
    mask = (h != 0).float()
    assert 0.2 < mask.mean().item() < 0.8, "dropout dropped"
    w1 = model.layers[1].weight.detach()
    dh = (g @ w1) * mask * 2.0  # through layers[1], then dropout's mask and 1/(1-p)
    expected = dh.t() @ x
    torch.testing.assert_close(model.layers[0].weight.grad, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("optimizer,updates", [("torch", "host"), ("megatrain", "host"),
                                               ("megatrain", "resident")])
def test_frozen_parameters_stream_and_stay_frozen(optimizer, updates):
    """Fine-tuning a few parameters of a model (LoRA-style, a frozen embedding): the frozen
    weights still stream to the device for compute, get no gradient and never change,
    and the trainable ones train like eager AdamW over the same subset."""
    torch.manual_seed(torch.seed() % 2**31)
    model = llama(tied=False, layers=3)
    for name, p in model.named_parameters():
        p.requires_grad_(("layers.1." in name and "attn" in name) or name.startswith("norm"))
    ref = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    step = compile_streamed(model, {
        "device": "cpu", "precision": "fp32", "lowering": "eager", "updates": updates,
        "gpu_memory": "4MiB"})
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (megatrain.AdamW(trainable, lr=1e-2) if optimizer == "megatrain"
           else torch.optim.AdamW(trainable, lr=1e-2))
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for ids, labels in random_batches(160, 3, batch=2, seq=32):
        loss, loss_ref = step(ids, labels=labels), ref(ids, labels=labels)
        assert abs(loss.item() - loss_ref.item()) / loss_ref.item() < 1e-5
        loss.backward()
        loss_ref.backward()
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    if updates == "resident":  # the trainable regions' state lived on the device
        live = megatrain.explain(step).graphs[0].resident_regions
        assert live and set(live.values()) == {"resident"}, live
    if optimizer == "megatrain":
        opt.synchronize()
    for name, p in model.named_parameters():
        if name in frozen:
            assert p.grad is None and torch.equal(p, frozen[name]), name
    # The module docstring's bound for parameters after 3 steps: AdamW's first steps are
    # sign-like, so a gradient near zero summed in another order can flip an update.
    assert rel(torch.cat([p.detach().flatten() for p in trainable]),
               torch.cat([p.detach().flatten() for p in ref.parameters() if p.requires_grad])) < 1e-3


def test_a_checkpointed_side_effect_breaks_the_graph_and_the_warning_names_the_fix():
    """Hugging Face models with gradient checkpointing on wrap each layer in
    torch.utils.checkpoint around code with Python side effects, which dynamo refuses to
    trace inside the checkpoint: every layer becomes a graph break. The warning says how to
    remove it, and the fix it names gives one graph whose regions are the layers."""
    seen = []

    class Checkpointed(Llama):
        def forward(self, input_ids, labels=None):
            x = self.embed_tokens(input_ids)
            cos, sin = self.rotary(x, input_ids.shape[1])

            def run(layer, x):
                seen.append(x.shape)  # a side effect outside the checkpointed function
                return layer(x, cos, sin)

            for layer in self.layers:
                x = torch.utils.checkpoint.checkpoint(run, layer, x, use_reentrant=False)
            logits = self.lm_head(self.norm(x))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def train():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Checkpointed(LlamaConfig(vocab_size=160, hidden=64, layers=3, heads=4, kv_heads=2,
                                         ffn=176, rope_theta=10000.0))
        return train_side_by_side(model, random_batches(160, 2, batch=2, seq=8),
                                  {"device": "cpu", "precision": "fp32", "lowering": "eager"}, steps=2)

    with pytest.warns(UserWarning, match="skip_fwd_side_effects_in_bwd_under_checkpoint = True"):
        r = train()
    assert "layers.1" not in [g.name for g in r["plan"].regions]
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        r = train()
    assert len(r["plan"].graphs) == 1
    assert [g.name for g in r["plan"].regions] == ["prologue", "layers.0", "layers.1", "layers.2", "epilogue"]
    for a, b in zip(r["loss"], r["loss_ref"]):
        assert abs(a - b) / abs(b) < 1e-5
    assert rel(r["grads"], r["grads_ref"]) < 1e-5


def test_a_graph_break_warning_names_the_new_reasons_only():
    """A process that compiles several models: each warning names the breaks dynamo counted
    since the last one, and only their fixes (dynamo's counters, as it fills them)."""
    import warnings

    from torch._dynamo.utils import counters

    from megatrain.compiler.backend import _warn_graph_breaks

    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    counters["graph_break"]["HOP: Unsafe side effect\n  Explanation: ..."] += 1
    with pytest.warns(UserWarning, match="skip_fwd_side_effects_in_bwd_under_checkpoint"):
        _warn_graph_breaks(gm)
    counters["graph_break"]["Data-dependent branching\n  Explanation: ..."] += 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_graph_breaks(gm)
        _warn_graph_breaks(gm)  # nothing new: no second warning
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "Data-dependent branching" in message and "HOP" not in message and "skip_fwd" not in message
