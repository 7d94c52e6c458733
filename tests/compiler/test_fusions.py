"""Kernel-pattern lowering on dynamo's torch-level graphs: what is replaced, and that it is exact.

Each test captures the graph dynamo would hand the backend, rewrites a copy with
replace_kernel_patterns, and runs both GraphModules eagerly on the same real inputs (the
kernels through TRITON_INTERPRET=1): outputs and every input gradient must agree to fp32
tolerance. Patterns that are not exactly the kernel's math must be left alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import megatrain

from megatrain.compiler.backend import megatrain_backend
from megatrain.compiler.fusions import (
    DEFAULT,
    PATTERNS,
    linear_cross_entropy,
    replace_kernel_patterns,
)
from megatrain.compiler.regions import assign_regions, module_path
from megatrain.kernels import apply_rotary, rms_norm, swiglu
from megatrain.models import GPT2, GPT2Config, Llama, LlamaConfig
from megatrain.models.llama import MLP, Attention, RMSNorm, rotate_half

from . import hf_like

LAYERS = 2
VOCAB = 96
LLAMA = LlamaConfig(vocab_size=VOCAB, hidden=48, layers=LAYERS, heads=4, kv_heads=2, ffn=80,
                    max_seq=32)  # head_dim 12, hidden 48: not powers of two
ALL_LAYERS = {"rmsnorm": 2 * LAYERS + 1, "rope": LAYERS, "swiglu": LAYERS,
              "linear_cross_entropy": 1}
NONE = {name: 0 for name in PATTERNS}


def capture(model, *args):
    """The graph dynamo hands a backend for model(*args), and its real inputs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(model, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def rewrite(model, *args, enabled=None):
    """(rewritten gm, untouched copy, real inputs, counts)."""
    gm, inputs = capture(model, *args)
    reference = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    counts = replace_kernel_patterns(gm, enabled)
    return gm, reference, inputs, counts


def assert_same(gm, reference, inputs, tol=1e-5):
    """Outputs and the gradients of every input that requires grad agree."""
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    results = []
    for module in (reference, gm):
        outs = module(*inputs)
        gen = torch.Generator().manual_seed(1)
        probe = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
        results.append((outs, torch.autograd.grad(probe, wrt)))
    (ref_out, ref_grads), (out, grads) = results
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    for p, a, b in zip(wrt, grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{tuple(p.shape)}: {m}")


def batch(vocab=VOCAB, seq=12):
    ids, labels = torch.randint(0, vocab, (2, seq)), torch.randint(0, vocab, (2, seq))
    labels[0, :3] = -100  # ignore_index rows
    return ids, labels


def llama(cfg=LLAMA):
    model = Llama(cfg)
    with torch.no_grad():  # norm weights away from 1, so a dropped weight would show
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return model


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def innermost(node) -> tuple[str, type]:
    path, cls = list(node.meta["nn_module_stack"].values())[-1]
    return module_path(path), cls


# --- the models users bring ---------------------------------------------------------------

def test_llama_replaced_and_exact():
    gm, reference, inputs, counts = rewrite(llama(), *batch())
    assert counts == ALL_LAYERS
    left = targets(gm)
    for gone in (torch.rsqrt, F.silu, F.cross_entropy, torch._C._nn.linear):
        assert left.count(gone) == (7 * LAYERS if gone is torch._C._nn.linear else 0)
    assert "chunk" not in left
    assert_same(gm, reference, inputs)


def test_new_nodes_carry_the_stack_of_what_they_replace():
    gm, reference, _, _ = rewrite(llama(), *batch())
    by_target = {}
    for n in gm.graph.nodes:
        by_target.setdefault(n.target, []).append(n)
    norms = [innermost(n) for n in by_target[rms_norm]]
    assert norms == [(f"layers.{i}.{name}", RMSNorm) for i in range(LAYERS)
                     for name in ("input_layernorm", "post_attention_layernorm")] + [("norm", RMSNorm)]
    assert [innermost(n) for n in by_target[apply_rotary]] == \
        [(f"layers.{i}.self_attn", Attention) for i in range(LAYERS)]
    assert [innermost(n) for n in by_target[swiglu]] == [(f"layers.{i}.mlp", MLP) for i in range(LAYERS)]
    (ce,) = by_target[linear_cross_entropy]
    (old,) = [n for n in reference.graph.nodes if n.target is F.cross_entropy]
    assert ce.meta.get("nn_module_stack") == old.meta.get("nn_module_stack")  # top level: none
    assert ce.meta["stack_trace"] == old.meta["stack_trace"]
    assert all("llama.py" in n.meta["stack_trace"] for ns in by_target.values() for n in ns
               if n.op == "call_function" and n.target in (rms_norm, apply_rotary, swiglu))
    regions = assign_regions(gm.graph)
    where = {n.name: regions.regions[regions.of_node[n]].name for n in gm.graph.nodes
             if n.target in (rms_norm, apply_rotary, swiglu, linear_cross_entropy)}
    assert [where[n.name] for n in by_target[swiglu]] == [f"layers.{i}" for i in range(LAYERS)]
    assert where[by_target[rms_norm][-1].name] == where[ce.name] == "epilogue"


def test_hf_llama_replaced_and_exact():
    gm, reference, inputs, counts = rewrite(hf_like.LlamaForCausalLM(vocab=VOCAB, layers=LAYERS),
                                            *batch())
    assert counts == ALL_LAYERS
    assert "unsqueeze" not in [t for t in targets(gm) if isinstance(t, str)][1:]  # cos/sin [B, S, D]
    assert_same(gm, reference, inputs)


class _HFLoss(nn.Module):
    """A transformers causal LM returning (loss, logits), its loss its own ForCausalLMLoss:
    the fp32 upcast, the shifted labels and, with num_items_in_batch, a summed loss over it."""

    def __init__(self, model, num_items=False, logits=True):
        super().__init__()
        self.model, self.num_items, self.logits = model, num_items, logits

    def forward(self, ids, labels):
        extra = {"num_items_in_batch": (labels != -100).sum()} if self.num_items else {}
        out = self.model(input_ids=ids, labels=labels, **extra)
        return (out.loss, out.logits) if self.logits else out.loss


@pytest.mark.parametrize("arch,num_items", [("llama", False), ("qwen2_tied", True)])
def test_transformers_causal_lm_loss_is_fused_and_exact(arch, num_items):
    """Hugging Face's ForCausalLMLoss is fused although the model also returns its logits:
    the head's matmul stays for that output, the loss and every gradient come from the
    fused kernel, exact against the unfused graph (fp32)."""
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    cfg = (transformers.LlamaConfig(**_HF_COMMON) if arch == "llama"
           else transformers.Qwen2Config(**_HF_COMMON, tie_word_embeddings=True))
    torch.manual_seed(0)
    model = _HFLoss(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), num_items)
    gm, reference, inputs, counts = rewrite(model, *batch(), enabled=["linear_cross_entropy"])
    assert counts["linear_cross_entropy"] == 1
    left = targets(gm)
    assert F.cross_entropy not in left and linear_cross_entropy in left
    assert left.count(torch._C._nn.linear) == targets(reference).count(torch._C._nn.linear)
    assert_same(gm, reference, inputs)


_HF_COMMON = {"vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": LAYERS,
              "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("logits", [False, True], ids=["loss_only", "logits_returned"])
def test_gemma2_soft_capped_loss_is_fused_where_only_the_loss_reads_the_logits(logits):
    """Gemma 2 caps its final logits, tanh(z / 30) * 30, before its ForCausalLMLoss. Where
    only the loss reads them (outputs="loss" drops the returned logits) the cap, the
    upcast and the cross-entropy become one fused loss with softcap=30, exact against the
    unfused graph (fp32); where the logits are returned too, the capped logits are
    needed as they are and nothing is fused."""
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    cfg = transformers.Gemma2Config(**_HF_COMMON, head_dim=12, query_pre_attn_scalar=12, sliding_window=16,
                                    final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # logits large enough that the cap bends them
        net.lm_head.weight.mul_(40.0)
    gm, reference, inputs, counts = rewrite(_HFLoss(net, logits=logits), *batch(), enabled=["linear_cross_entropy"])
    left, caps = targets(gm), targets(reference).count(torch.tanh)  # the attention's caps too
    if logits:
        assert counts["linear_cross_entropy"] == 0 and left.count(torch.tanh) == caps
        return
    assert counts["linear_cross_entropy"] == 1 and left.count(torch.tanh) == caps - 1
    assert F.cross_entropy not in left and linear_cross_entropy in left
    fused = [n for n in gm.graph.nodes if n.target is linear_cross_entropy]
    assert fused[0].args[5] == 30.0
    assert_same(gm, reference, inputs)


def test_gpt2_only_the_tied_head_loss_is_replaced():
    model = GPT2(GPT2Config(vocab_size=VOCAB, hidden=48, layers=LAYERS, heads=4, max_seq=32))
    gm, reference, inputs, counts = rewrite(model, *batch())
    assert counts == {**NONE, "linear_cross_entropy": 1}
    assert_same(gm, reference, inputs)  # wte's gradient sums the embedding and the head


def test_bf16_llama_graph_is_matched():
    """In a bf16 model dynamo bakes `.to(torch.bfloat16)` for the cast back; still RMSNorm."""
    _, _, _, counts = rewrite(llama().to(torch.bfloat16), *batch())
    assert counts == ALL_LAYERS


def test_enabled_selects_patterns():
    gm, _, _, counts = rewrite(llama(), *batch(), enabled=["swiglu"])
    assert counts == {"swiglu": LAYERS}
    assert torch.rsqrt in targets(gm)
    assert DEFAULT == set(PATTERNS)
    with pytest.raises(ValueError, match="rms_norm"):
        replace_kernel_patterns(gm, ["rms_norm"])


def test_rewritten_graph_streams_through_the_backend():
    """capture, regions and AOTAutograd take the new nodes, also once the sequence is dynamic."""
    counts = []

    def backend(gm, example_inputs, options=None):
        counts.append(replace_kernel_patterns(gm))
        return megatrain_backend(gm, example_inputs, options=options)

    model = hf_like.LlamaForCausalLM(vocab=VOCAB, layers=LAYERS)
    eager = copy.deepcopy(model)
    step = torch.compile(model, backend=backend, options={"device": "cpu", "precision": "fp32", "gpu_memory": "1GiB"})
    for seq in (8, 11):  # the second length recompiles with a symbolic sequence length
        ids, labels = batch(seq=seq)
        with megatrain.config.patch(lowering="eager"):
            loss = step(ids, labels)
        expect = eager(ids, labels)
        loss.backward()
        expect.backward()
        torch.testing.assert_close(loss, expect, rtol=1e-5, atol=1e-5)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
        model.zero_grad()
        eager.zero_grad()
    assert counts == [ALL_LAYERS, ALL_LAYERS]


# --- near misses: replaced only when exact --------------------------------------------------

class Norm(nn.Module):
    def __init__(self, eps=1e-5, eps_tensor=False, leak_variance=False):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(40) + 0.5)
        self.leak_variance = leak_variance
        if eps_tensor:
            self.register_buffer("eps", torch.tensor(eps))
        else:
            self.eps = eps

    def forward(self, x):
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)
        out = self.weight * (h * torch.rsqrt(variance + self.eps)).to(x.dtype)
        return (out, variance) if self.leak_variance else (out,)


class Gated(nn.Module):
    def __init__(self, leak_silu=False):
        super().__init__()
        self.leak_silu = leak_silu

    def forward(self, gate, up):
        act = F.silu(gate)
        return (act * up, act) if self.leak_silu else (act * up,)


class Rotate(nn.Module):
    def __init__(self, leak_rotated=False, k_too=True, k_late=False):
        super().__init__()
        self.leak_rotated, self.k_too, self.k_late = leak_rotated, k_too, k_late

    def forward(self, q, k, cos, sin):
        rq = rotate_half(q)
        q = q * cos + rq * sin
        if self.k_late:  # k's value is made after q's rotation: the fused op goes after it
            k = k * 2
        k = k * cos + rotate_half(k) * sin if self.k_too else k
        return (q, k, rq) if self.leak_rotated else (q, k)


class Head(nn.Module):
    def __init__(self, leak_logits=False, leak_flat=False, **ce):
        super().__init__()
        self.lm_head = nn.Linear(40, VOCAB, bias=False)
        self.leak_logits, self.leak_flat, self.ce = leak_logits, leak_flat, ce

    def forward(self, h, labels):
        logits = self.lm_head(h)
        flat = logits.view(-1, VOCAB)
        loss = F.cross_entropy(flat, labels.view(-1), **self.ce)
        return (loss,) + ((logits,) if self.leak_logits else ()) + ((flat,) if self.leak_flat else ())


def _inputs(module):
    def leaf(*shape, scale=0.05):
        return (torch.randn(*shape) * scale).requires_grad_()

    if isinstance(module, Norm):
        return (leaf(3, 5, 40),)  # small values: eps matters
    if isinstance(module, Gated):
        return leaf(3, 40), leaf(3, 40)
    if isinstance(module, Rotate):
        angles = torch.rand(7, 12) * 6
        return leaf(2, 4, 7, 12), leaf(2, 2, 7, 12), angles.cos(), angles.sin()
    labels = batch(seq=7)[1]
    labels[labels == -100] = module.ce.get("ignore_index", -100)
    return leaf(2, 7, 40, scale=1.0), labels


CASES = {
    "rmsnorm eps 1e-2": (Norm(eps=1e-2), {"rmsnorm": 1}),
    "rmsnorm eps as a tensor": (Norm(eps_tensor=True), {}),
    "rmsnorm variance also returned": (Norm(leak_variance=True), {}),
    "swiglu": (Gated(), {"swiglu": 1}),
    "swiglu silu also returned": (Gated(leak_silu=True), {}),
    "rope q and k": (Rotate(), {"rope": 1}),
    "rope rotate_half also returned": (Rotate(leak_rotated=True), {}),
    "rope q alone": (Rotate(k_too=False), {}),
    "rope k made after q's rotation": (Rotate(k_late=True), {"rope": 1}),
    "linear ce sum": (Head(reduction="sum", ignore_index=3), {"linear_cross_entropy": 1}),
    # the head's matmul stays for the returned logits; the loss no longer keeps them
    "linear ce logits also returned": (Head(leak_logits=True), {"linear_cross_entropy": 1}),
    "linear ce flattened logits also returned": (Head(leak_flat=True), {}),
    "linear ce label smoothing": (Head(label_smoothing=0.1), {}),
}


@pytest.mark.parametrize("case", CASES)
def test_replaced_only_when_exact(case):
    module, expected = CASES[case]
    gm, reference, inputs, counts = rewrite(module, *_inputs(module))
    assert counts == {**NONE, **expected}
    if case == "rmsnorm eps 1e-2":
        assert [n.args[2] for n in gm.graph.nodes if n.target is rms_norm] == [1e-2]
    assert_same(gm, reference, inputs)


def test_hf_meta_style_rmsnorm():
    """`_norm(x.float()).type_as(x) * weight`, the original Llama reference spelling."""
    module = hf_like.MetaRMSNorm(40, eps=1e-3)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
    gm, reference, inputs, counts = rewrite(module, (torch.randn(3, 40) * 0.05).requires_grad_())
    assert counts["rmsnorm"] == 1
    assert_same(gm, reference, inputs)


def test_linear_cross_entropy_follows_autocast():
    """Under bf16 autocast the lm_head matmul runs in bf16, even from an fp32 hidden state."""
    hidden, labels = torch.randn(2, 7, 40), batch(seq=7)[1]
    weight = (torch.randn(VOCAB, 40) * 0.1).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, labels.flatten())
        expect = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1).float(), labels.flatten())
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expect, rtol=1e-3, atol=1e-3)
