"""gpu_memory is a contract: what a step really allocates stays within the plan's peak.

On the CPU device the "device" memory is the CPU allocator's, which the profiler reports
allocation by allocation, so a step's real peak, Inductor's own buffer handling included,
can be compared with the planner's prediction in CI. (The H200 found the gap first: with
Inductor's buffer reuse a freed buffer is held until a later one of its size takes it,
across regions, and a step planned at 268 MB peaked at 298 MB; the same model here
measured 291 MB with reuse and 254 MB without.) Eager lowering is held to it too: it
used to keep every input of the backward graph alive until the graph returned."""

import pytest
import torch

import megatrain
from megatrain.models import Llama, LlamaConfig

from .helpers import compile_streamed, cpu_peak_bytes, least_budgets, random_batches

CONFIG = LlamaConfig(vocab_size=512, hidden=128, layers=4, heads=4, kv_heads=4, ffn=344,
                     rope_theta=10000.0)


def _compiled(options, lowering="inductor"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(CONFIG)
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": lowering, **options})
    return step, megatrain.AdamW(model.parameters(), lr=1e-3)


def _train(step, opt, batches):
    def one(ids, labels):
        step(ids, labels=labels).backward()

    peaks = []
    for ids, labels in batches:
        peaks.append(cpu_peak_bytes(lambda: one(ids, labels)))
        opt.step()
        opt.zero_grad()
    return peaks


@pytest.mark.parametrize("lowering,offload", [("inductor", True),
                                             pytest.param("eager", True, marks=pytest.mark.slow),
                                             pytest.param("inductor", False, marks=pytest.mark.slow)])
def test_steps_stay_within_the_predicted_peak(lowering, offload):
    """A budget that binds (between the leanest plans with and without offloading): every
    step after the first (which also sets up the optimizer's state and the gradient slabs,
    host memory on a GPU) allocates no more than the plan predicted."""
    batches = random_batches(512, 3, batch=4, seq=512)
    step, opt = _compiled({"offload": False}, "eager")  # planning alone: no need to compile
    _train(step, opt, batches[:1])
    need = least_budgets(megatrain.explain(step).graphs[0].schedule)
    budget = (need[False] + need[True]) // 2 if offload else need[False] + need[False] // 20

    step, opt = _compiled({"gpu_memory": budget, "offload": offload}, lowering)
    peaks = _train(step, opt, batches)
    plan = megatrain.explain(step).graphs[0].schedule.plan
    assert bool(plan.config.offloaded) == offload, plan.config
    assert max(peaks[1:]) <= plan.peak_bytes <= budget, (peaks, plan.peak_bytes, budget)


@pytest.mark.parametrize("lowering", ["inductor", pytest.param("eager", marks=pytest.mark.slow)])
def test_kept_weights_stay_within_the_predicted_peak(lowering):
    """keep_weights, under a budget that has room for only some regions' forward weights
    beside the plan: the kept buffers live from the forward to the backward, and every
    step still allocates no more than the plan predicted."""
    batches = random_batches(512, 3, batch=4, seq=512)
    step, opt = _compiled({"offload": False}, "eager")
    _train(step, opt, batches[:1])
    plain = megatrain.explain(step).graphs[0].schedule.plan
    layer_weights = max(w.nbytes for w in plain.schedule.problem.weights if w.numel < 512 * 128)
    budget = plain.peak_bytes + 2 * layer_weights  # room for a few layers' weights, not all

    step, opt = _compiled({"gpu_memory": budget, "offload": False, "keep_weights": True}, lowering)
    peaks = _train(step, opt, batches)
    plan = megatrain.explain(step).graphs[0].schedule.plan
    assert 0 < len(plan.config.kept_weights) < CONFIG.layers, plan.config
    assert max(peaks[1:]) <= plan.peak_bytes <= budget, (peaks, plan.peak_bytes, budget)


def test_eager_lowering_frees_its_inputs_on_entry_and_runs_without_boxed_codegen(monkeypatch):
    """The boxed graph clears the caller's list (its inputs can die at their last use);
    where torch.fx has no boxed codegen, the unboxed fallback still computes the same."""
    import torch.fx as fx

    from megatrain.compiler.lower import _boxed

    linear = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    args = [x]
    torch.testing.assert_close(_boxed(fx.symbolic_trace(linear))(args), linear(x))
    assert args == []
    monkeypatch.delattr(fx.graph, "_BoxedCodeGen")
    torch.testing.assert_close(_boxed(fx.symbolic_trace(linear))([x]), linear(x))
