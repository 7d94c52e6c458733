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

from .helpers import compile_streamed, cpu_peak_bytes, flat, random_batches, rel

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
    step = compile_streamed(model, {"device": device, "precision": "bf16"})
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
    return losses, grads, peaks, megatrain.explain(step).graphs[0]


@pytest.mark.skipif(not hasattr(torch._inductor.config, "use_joint_graph_passes"),
                    reason="this torch has no switch to turn Inductor's joint-graph passes off")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_loss_backward_holds_no_one_hot_buffer(device):
    batches = random_batches(CFG.vocab_size, 3, batch=BATCH, seq=SEQ)
    losses, grads, peaks, graph = _train(device, True, batches)
    losses_off, grads_off, peaks_off, graph_off = _train(device, False, batches)
    code, code_off, predicted = graph.backward_code, graph_off.backward_code, graph.schedule.plan.peak_bytes
    assert graph.saved_activations == graph_off.saved_activations  # the same boundaries

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


class _ScaledSoftmaxLayer(torch.nn.Module):
    """Attention-like scores, softmax(q k^T * scale): Inductor's joint passes rewrite the
    scaled softmax into several new nodes, of which only the last inherits the region."""

    def __init__(self, width: int):
        super().__init__()
        self.q, self.o = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        scores = torch.softmax(self.q(x) @ x.transpose(-1, -2) * 0.125, dim=-1)
        return x + self.o(scores @ x)


class _Stack(torch.nn.Module):
    def __init__(self, width: int = 32, layers: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList(_ScaledSoftmaxLayer(width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_rewritten_nodes_stay_in_their_region_and_nothing_more_is_saved():
    """New nodes the passes add take their region (partition.adopt_regions): untagged, each
    looked like a region boundary and the partition saved every layer's scores."""
    x = torch.randn(4, 64, 32)

    def saved(joint_passes: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        step = compile_streamed(_Stack(), {"device": "cpu", "precision": "fp32", "lowering": "inductor"})
        with torch._inductor.config.patch(use_joint_graph_passes=joint_passes):
            loss = step(x)
            loss.backward()
        graph = megatrain.explain(step).graphs[0]
        return loss.item(), graph.saved_activations, graph.saved_activation_bytes, graph.forward_code

    loss, names, nbytes, code = saved(True)
    loss_off, names_off, nbytes_off, code_off = saved(False)
    assert code != code_off, "the passes rewrote nothing: the test no longer tests them"
    assert (len(names), nbytes) == (len(names_off), nbytes_off), (names, names_off)
    assert abs(loss - loss_off) <= 1e-6 * abs(loss_off)
