"""The plain loss against the fused linear-cross-entropy (compiler/loss_choice.py): the
head region's numbers the estimate changes, and the estimate against the step the planner
predicts for the fused loss's own graphs."""

from __future__ import annotations

import random
from copy import deepcopy

import pytest
import torch

import megatrain
from megatrain.compiler import loss_choice
from megatrain.compiler import rates as rates_mod
from megatrain.compiler.options import Options
from megatrain.models import Llama, LlamaConfig
from megatrain.plan.problem import Problem, RegionSpec

from .helpers import compile_streamed, random_batches


def test_the_fused_variant_moves_the_gradient_products_and_frees_the_logits():
    flops_fw, flops_bw = random.randint(10**6, 10**9), random.choice([None, random.randint(10**6, 10**9)])
    traffic_fw, traffic_bw = random.randint(10**6, 10**9), random.choice([None, random.randint(10**6, 10**9)])
    logits, moved, passes = random.randint(1 << 20, 1 << 30), random.randint(1, 10**6), random.randint(1, 10**9)
    body = RegionSpec(id=0, out_bytes=1 << 20, work_fw=1 << 22, work_bw=1 << 23, flops_fw=10**9)
    head = RegionSpec(id=1, inputs=(0,), out_bytes=4, work_fw=logits + 100, work_bw=logits // 2,
                      flops_fw=flops_fw, flops_bw=flops_bw, traffic_fw=traffic_fw, traffic_bw=traffic_bw)
    problem = Problem(regions=(body, head))
    fused = loss_choice.fused_variant(problem, 1, loss_choice.LossHead(
        region=7, logits_bytes=logits, moved_flops=moved, moved_bytes=passes))
    assert fused.regions[0] == body
    new = fused.regions[1]
    assert (new.work_fw, new.work_bw) == (100, 0)  # never below nothing
    assert new.flops_fw == flops_fw + moved
    # a recomputing head runs the forward (now with the products) again and a backward
    # without them: its recompute + backward FLOPs are unchanged where the backward had
    # the products to give up
    backward = 2 * flops_fw if flops_bw is None else flops_bw
    assert new.backward_work()[0] == head.backward_work()[0] + max(moved - backward, 0)
    assert new.traffic_fw == traffic_fw + passes  # and so the passes over the logits
    traffic = 2 * traffic_fw if traffic_bw is None else traffic_bw
    assert new.backward_work()[1] == head.backward_work()[1] + max(passes - traffic, 0)


@pytest.mark.parametrize("vocab", [pytest.param(2048, marks=pytest.mark.slow), 4096])
def test_the_estimate_is_the_fused_plans_prediction(monkeypatch, vocab):
    """On a device counted as calibrated, the plain compile's estimate of the fused step is
    within 5% of the step the chooser predicts when the fused loss's own graphs are
    compiled and planned (the estimate leaves the kept set and the traffic as the plain
    plan had them)."""
    monkeypatch.setattr(rates_mod, "CALIBRATED", ("cuda", "cpu"))
    monkeypatch.setattr(loss_choice, "MARGIN", 1.0)  # keep the plain loss: its estimate is read
    # planned as for Inductor's GPU kernels, as on CUDA (the walk the estimate's logits are)
    monkeypatch.setattr(Options, "fused_lowering", property(lambda self: self.lowering == "inductor"))
    cfg = LlamaConfig(vocab_size=vocab, hidden=64, layers=3, heads=4, kv_heads=2, ffn=128, rope_theta=10000.0)
    ids, labels = random_batches(vocab, 1, 2, 64)[0]

    def choice(**extra):
        torch._dynamo.reset()
        torch.manual_seed(0)
        step = compile_streamed(Llama(cfg), {"device": "cpu", "precision": "fp32",
                                             "gpu_memory": 256 << 20, "host_memory": "8GiB", **extra})
        step(ids, labels=labels).backward()
        return megatrain.explain(step).graphs[0].keep_choice

    plain = choice()
    fused = choice(kernels=["linear_cross_entropy"])
    assert plain.fused_loss_step_s is not None and fused.fused_loss_step_s is None
    assert abs(plain.fused_loss_step_s - fused.step_s) <= 0.05 * fused.step_s, (plain, fused)


def test_no_estimate_where_the_logits_are_also_returned():
    """A Hugging Face causal LM returns its logits beside the loss: the fused loss would
    still compute and hold them for that output, so nothing is freed and no estimate is
    made. With the logits dropped (outputs="loss", the consent option) the head is found,
    with its logits' bytes and the two [tokens, width] x [width, vocab] products moved."""
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    from megatrain.compiler import outputs

    vocab, width, tokens = 128, 32, 2 * 16
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    ids = torch.randint(0, vocab, (2, 16))
    found = {}

    def backend(gm, example_inputs):
        found["returned"] = loss_choice.pending_head(gm, torch.float32, inductor=True)
        copy = torch.fx.GraphModule(gm, deepcopy(gm.graph))
        outputs.drop_non_scalar_outputs(copy)
        found["dropped"] = loss_choice.pending_head(copy, torch.float32, inductor=True)
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(input_ids=ids, labels=ids)
    assert found["returned"] is None
    product, logits, moved, passes = found["dropped"]
    # HF shifts the labels: one token fewer per sequence reaches the loss, but the product
    # runs over every token
    assert logits == passes // 2 and moved == 4 * width * vocab * (logits // (vocab * 4))
    assert (logits // (vocab * 4)) in (tokens, tokens - 2)
