"""Inductor's joint-graph passes run before megatrain's partition (lower.joint_passes).

The one that matters: cross-entropy's backward scatters its one-hot gradient into a
[tokens, vocab] zeros tensor that Inductor realises as a buffer in the loss's dtype (fp32
under bf16 autocast); Inductor's `scatter_upon_const_tensor` rewrites it as a pointwise
`where` that fuses into its reader. The model's vocabulary is large against its hidden
size, so that buffer is most of the step's memory. Each run is held against the same
run with Inductor's switch for the passes off (`use_joint_graph_passes=False`, which
megatrain honours), so the test fails if the passes stop running or stop paying. On a
GPU the same holds of the CUDA allocator's peak, with Triton's fusion rules.
"""

from __future__ import annotations

import pytest
import torch

import megatrain
from megatrain.models import Llama, LlamaConfig

from .helpers import cpu_peak_bytes, flat, random_batches, rel

CFG = LlamaConfig(vocab_size=8192, hidden=64, layers=2, heads=4, kv_heads=4, ffn=172,
                  rope_theta=10000.0)
BATCH, SEQ = 4, 256


def _peak_bytes(device: str, run) -> int:
    if device == "cpu":
        return cpu_peak_bytes(run)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _train(device: str, joint_passes: bool, batches):
    """Losses, first-step gradients, per-step peaks and the backward's code of a bf16 run."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(CFG)
    step = torch.compile(model, backend="megatrain", options={"device": device, "precision": "bf16"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # leaves gradients in p.grad
    losses, peaks, grads = [], [], None
    with torch._inductor.config.patch(use_joint_graph_passes=joint_passes):
        for ids, labels in batches:
            def one():
                loss = step(ids, labels=labels)
                loss.backward()
                losses.append(loss.item())

            peaks.append(_peak_bytes(device, one))
            if grads is None:
                grads = flat(p.grad for p in model.parameters())
            opt.step()
            opt.zero_grad()
    graph = megatrain.explain(step).graphs[0]
    return losses, grads, peaks, graph.backward_code, graph.schedule.plan.peak_bytes


@pytest.mark.skipif(not hasattr(torch._inductor.config, "use_joint_graph_passes"),
                    reason="this torch has no switch to turn Inductor's joint-graph passes off")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_loss_backward_holds_no_one_hot_buffer(device):
    batches = random_batches(CFG.vocab_size, 3, batch=BATCH, seq=SEQ)
    losses, grads, peaks, code, predicted = _train(device, True, batches)
    losses_off, grads_off, peaks_off, code_off, _ = _train(device, False, batches)

    assert "scatter" in code_off and "scatter" not in code, "the one-hot scatter was not rewritten"
    one_hot = BATCH * SEQ * CFG.vocab_size * 4  # fp32 [tokens, vocab]
    saved = max(peaks_off[1:]) - max(peaks[1:])
    assert saved >= 0.9 * one_hot, (peaks, peaks_off, one_hot)
    # The rewrite computes the same one-hot: on the CPU the same numbers, step after step;
    # on a GPU the fused kernel may sum in another order (bf16 compute).
    if device == "cpu":
        assert losses == losses_off
        torch.testing.assert_close(grads, grads_off, rtol=0, atol=0)
    else:
        assert losses[0] == losses_off[0] and rel(grads, grads_off) < 1e-3, (losses, losses_off)
    assert max(peaks[1:]) <= predicted, (peaks, predicted)  # the plan's peak still bounds it
