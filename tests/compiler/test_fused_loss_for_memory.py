"""The fused linear-cross-entropy, applied by the backend on its own.

Kernels are off by default (options["kernels"] not given): on the H200 none is faster than
Inductor's code (fusions.DEFAULT's comment). But a long sequence's step peaks in the loss
region's backward ([tokens, vocab] logits, their fp32 upcast, their gradient), which the
fused loss never holds. So when a graph's plan does not fit gpu_memory and the user left
`kernels` unset, the backend plans it again with the fused loss; and where the plain loss
fits, the cost model weighs the fused one (compiler/loss_choice.py) and the backend
compiles it where it is predicted faster. An explicit `kernels` is kept exactly.

The model has a vocabulary large against its hidden size and token count, so the logits
dominate the step's memory. Budgets are derived from the planner's own numbers: the
minimum budget it names without the fused loss and with it. Small sizes keep the Triton
interpreter (TRITON_INTERPRET=1, tests/conftest.py) fast: it walks tokens x vocab.
"""

from __future__ import annotations

import pytest
import torch

import megatrain
from megatrain.plan.search import InfeasibleBudget
from megatrain.models import Llama, LlamaConfig

from .helpers import compile_streamed, rel, random_batches, train_side_by_side

CFG = LlamaConfig(vocab_size=512, hidden=8, layers=2, heads=2, kv_heads=1, ffn=16,
                  rope_theta=10000.0)
BATCH, SEQ = 2, 8
FUSED = "fused linear-cross-entropy"


def options(budget: int, **extra) -> dict:
    return {"device": "cpu", "precision": "fp32", "lowering": "eager", "gpu_memory": budget, **extra}


def min_budget(model, budget: int, **extra) -> InfeasibleBudget:
    """The InfeasibleBudget of one step of `model` compiled with `budget`."""
    torch._dynamo.reset()
    step = compile_streamed(model, options(budget, **extra))
    ids, labels = random_batches(CFG.vocab_size, 1, BATCH, SEQ)[0]
    with pytest.raises(InfeasibleBudget) as info:
        step(ids, labels=labels)
    return info.value


@pytest.fixture(scope="module")
def budgets():
    """(too small even with the fused loss, fits only with it), from the planner's minima.
    The backend accepts a budget that holds the largest region's weights (the epilogue's:
    the lm_head, [vocab, hidden] fp32, the final norm and alignment padding, within twice
    the lm_head); below any schedule's peak, it makes the planner name its minimum."""
    torch.manual_seed(0)
    model = Llama(CFG)
    tiny = 2 * CFG.vocab_size * CFG.hidden * 4
    unfused = min_budget(model, tiny, kernels=()).min_budget
    fused = min_budget(model, tiny, kernels=["linear_cross_entropy"]).min_budget
    torch._dynamo.reset()
    assert tiny < fused < unfused, (tiny, fused, unfused)
    # The bound below which the backend does not try the unfused plan holds: the logits and
    # their gradient (fp32) fit inside the planner's least unfused budget.
    assert 2 * BATCH * SEQ * CFG.vocab_size * 4 <= unfused
    # The logits dominate: the fused loss cuts this step's peak by over a third, though at
    # 16 tokens its one chunk of logits (scratch the planner counts) holds them all.
    assert 3 * fused < 2 * unfused, (fused, unfused)
    return {"tiny": tiny, "fused": fused, "unfused": unfused, "between": (fused + unfused) // 2}


def test_unset_kernels_fuse_the_loss_when_the_budget_needs_it(budgets):
    torch.manual_seed(torch.seed() % 2**31)
    model = Llama(CFG)
    budget = budgets["between"]
    r = train_side_by_side(model, random_batches(CFG.vocab_size, 3, BATCH, SEQ), options(budget),
                           lr=3e-3)
    for a, b in zip(r["loss"], r["loss_ref"]):
        assert abs(a - b) / abs(b) < 1e-5, (r["loss"], r["loss_ref"])
    assert rel(r["grads"], r["grads_ref"]) < 1e-5
    assert rel(r["params"], r["params_ref"]) < 1e-3
    plan = r["plan"]
    (graph,) = plan.graphs
    assert graph.kernels == ("linear_cross_entropy",)
    assert "megatrain.fused_linear_cross_entropy" in plan.code
    # Only the loss: the other kernels stay off.
    for op in ("megatrain.rms_norm", "megatrain.rope", "megatrain.swiglu"):
        assert op not in plan.code, op
    assert graph.note.startswith(f"{FUSED} applied for memory")
    assert str(budgets["unfused"]) in graph.note and str(budget) in graph.note
    assert plan.notes == [f"graph 0: {graph.note}"]
    assert budgets["fused"] <= plan.predicted_peak_bytes <= budget
    assert 0 < plan.measured_peak_bytes <= budget


def test_no_retry_when_the_budget_fits(budgets):
    """Enough memory without the fused loss: Inductor's (here eager) loss, no note."""
    torch.manual_seed(0)
    model = Llama(CFG)
    step = compile_streamed(model, options(2 * budgets["unfused"]))
    ids, labels = random_batches(CFG.vocab_size, 1, BATCH, SEQ)[0]
    step(ids, labels=labels).backward()
    graph = megatrain.explain(step).graphs[0]
    assert graph.kernels == () and graph.note == ""
    assert "fused_linear_cross_entropy" not in graph.code


@pytest.mark.parametrize("kernels", [(), False, ["rmsnorm"]])
def test_explicit_kernels_are_kept(budgets, kernels):
    torch.manual_seed(0)
    e = min_budget(Llama(CFG), budgets["between"], kernels=kernels)
    assert FUSED not in str(e)
    assert e.min_budget > budgets["between"]


def test_too_small_even_fused_says_the_fused_loss_was_tried(budgets):
    torch.manual_seed(0)
    e = min_budget(Llama(CFG), budgets["tiny"])
    msg = str(e)
    assert f"{FUSED} loss already applied" in msg, msg
    assert e.min_budget == budgets["fused"]
    # It still names the bytes needed (with the fused loss, and the logits' without) and
    # available.
    logits = 2 * BATCH * SEQ * CFG.vocab_size * 4
    for n in (budgets["fused"], logits, budgets["tiny"]):
        assert str(n) in msg, (n, msg)


@pytest.mark.parametrize("below_the_logits", [True, False])
def test_no_plan_without_the_fused_loss_is_tried_where_the_logits_alone_overflow(monkeypatch,
                                                                                  below_the_logits):
    """Where the [tokens, vocab] logits and their gradient alone exceed gpu_memory, no plan
    without the fused loss can fit: the backend compiles once, fused, and its note says why
    (a plain attempt costs a whole capture, AOT trace and search). Above that bound the
    plain attempt comes first, as before. Four times the tokens of the other tests, so
    that the fused plan fits below the bound."""
    from megatrain.compiler import backend

    batch, seq = 2, 4 * SEQ
    ids, labels = random_batches(CFG.vocab_size, 1, batch, seq)[0]
    logits = 2 * batch * seq * CFG.vocab_size * 4

    def compiled(budget, **extra):
        torch.manual_seed(0)
        torch._dynamo.reset()
        return compile_streamed(Llama(CFG), options(budget, **extra))

    with pytest.raises(InfeasibleBudget) as info:
        compiled(1 << 16, kernels=["linear_cross_entropy"])(ids, labels=labels)
    fused = info.value.min_budget
    assert fused < logits
    budget = (fused + logits) // 2 if below_the_logits else 2 * logits
    attempts = []
    real = backend._compile
    monkeypatch.setattr(backend, "_compile", lambda gm, inputs, opts, streamer, sid, kernels, *a, **k:
                        attempts.append(tuple(kernels)) or real(gm, inputs, opts, streamer, sid, kernels, *a, **k))
    step = compiled(budget)
    step(ids, labels=labels).backward()
    graph = megatrain.explain(step).graphs[0]
    if below_the_logits:
        assert attempts == [("linear_cross_entropy",)]
        assert graph.kernels == ("linear_cross_entropy",) and graph.predicted_peak_bytes <= budget
        assert f"without it the logits and their gradient alone take {logits} bytes" in graph.note, graph.note
    else:
        assert attempts[0] == ()


@pytest.mark.parametrize("tokens,chunk", [(40, 16), (12, 16)])
def test_planner_counts_the_fused_loss_scratch(tokens, chunk):
    """The fused loss allocates one chunk of logits and per-token losses inside itself,
    where the graph cannot show them; the planner adds them at the op (graph_sizes.GraphSizes)."""
    import torch.fx as fx

    import megatrain.kernels.fused_linear_cross_entropy  # noqa: F401  (registers the op)
    from megatrain.compiler.graph_sizes import GraphSizes

    vocab, hidden = 96, 8
    g = fx.Graph()
    h, w, y = g.placeholder("h"), g.placeholder("w"), g.placeholder("y")
    h.meta["val"] = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    w.meta["val"] = torch.empty(vocab, hidden, dtype=torch.bfloat16)
    y.meta["val"] = torch.empty(tokens, dtype=torch.long)
    op = torch.ops.megatrain.fused_linear_cross_entropy.default
    n = g.call_function(op, (h, w, y, -100, "mean", chunk, True, True))
    sizes = GraphSizes(torch.device("cpu"))
    expected = min(chunk, tokens) * vocab * 2 + tokens * 4
    assert sizes.scratch_hint(n) == expected
    assert sizes.scratch_hint(h) == 0



@pytest.mark.parametrize("fused_faster", [True, False])
def test_the_fused_loss_replaces_a_plain_one_predicted_slower(budgets, monkeypatch, tmp_path, fused_faster):
    """Where the plain loss fits, it is compiled first, and the keep chooser's answer
    prices the step with the fused loss too (loss_choice). Where that is MARGIN faster, the
    fused loss is compiled instead, its note says so and how to keep the plain one, it
    trains like eager, and a second compile of the same graph goes to it at once (the
    choice remembered). The margin is set here to force each answer; the estimate itself
    is checked against a fused plan in test_loss_choice.py."""
    from megatrain.compiler import backend, loss_choice
    from megatrain.compiler import rates as rates_mod

    monkeypatch.setattr(rates_mod, "CALIBRATED", ("cuda", "cpu"))  # the cost model decides
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(megatrain.config, "decision_cache", True)
    monkeypatch.setattr(loss_choice, "MARGIN", -1.0 if fused_faster else 1.0)
    attempts = []
    real = backend._compile
    monkeypatch.setattr(backend, "_compile", lambda gm, inputs, opts, streamer, sid, kernels, *a, **k:
                        attempts.append(tuple(kernels)) or real(gm, inputs, opts, streamer, sid, kernels, *a, **k))
    torch.manual_seed(torch.seed() % 2**31)
    budget = 2 * budgets["unfused"]  # the plain loss fits
    opts = options(budget, host_memory="8GiB")  # its default follows the free RAM: a cache key
    r = train_side_by_side(Llama(CFG), random_batches(CFG.vocab_size, 3, BATCH, SEQ), opts, lr=3e-3)
    for a, b in zip(r["loss"], r["loss_ref"]):
        assert abs(a - b) / abs(b) < 1e-5, (r["loss"], r["loss_ref"])
    assert rel(r["grads"], r["grads_ref"]) < 1e-5
    assert rel(r["params"], r["params_ref"]) < 1e-3
    (graph,) = r["plan"].graphs
    if not fused_faster:
        assert attempts == [()] and graph.kernels == () and graph.note == ""
        assert graph.keep_choice.fused_loss_step_s is not None  # weighed, and kept plain
        return
    assert attempts == [(), ("linear_cross_entropy",)]
    assert graph.kernels == ("linear_cross_entropy",)
    assert graph.note.startswith(f"{FUSED} applied for speed: predicted"), graph.note
    assert "megatrain.config.kernels = False" in graph.note

    attempts.clear()
    torch._dynamo.reset()
    step = compile_streamed(Llama(CFG), opts)
    ids, labels = random_batches(CFG.vocab_size, 1, BATCH, SEQ)[0]
    step(ids, labels=labels).backward()
    graph = megatrain.explain(step).graphs[0]
    assert attempts == [("linear_cross_entropy",)] and graph.kernels == ("linear_cross_entropy",)
    assert "remembered from an earlier compile" in graph.note, graph.note
