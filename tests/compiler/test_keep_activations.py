"""Regions that keep their activations (compiler/keep.py, plan/keep.py): their backward
reads the matmul and attention outputs the forward saved instead of recomputing them.

Exactness: kept, mixed kept/recomputed and kept/offloaded plans train like eager fp32 on
the own Llama and a Hugging Face Llama. Mechanism: a kept region's backward runs no
forward matmul again (the backward graph has exactly that many fewer matmuls). Decision:
on random problems the chooser's pick fits the budget, is never predicted slower than
recomputing everywhere, and more budget never predicts a slower pick.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from megatrain.compiler import rates as rates_mod
from megatrain.errors import MegatrainValueError
from megatrain.models import Llama, LlamaConfig
from megatrain.plan import keep
from megatrain.plan.problem import Problem
from megatrain.plan.search import InfeasibleBudget, PlannerOptions, plan_step
from megatrain.plan.validate import min_budget, validate

from .helpers import least_budgets, random_batches, rel, train_side_by_side
from .test_activation_offload import BUDGET as OFFLOAD_BUDGET
from .test_activation_offload import model as offload_model
from .test_planner import budget_settings, problems, rates_st


def _llama(layers=3):
    return Llama(LlamaConfig(vocab_size=96, hidden=48, layers=layers, heads=4, kv_heads=2, ffn=96,
                             rope_theta=10000.0))


def _hf_llama():
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")

    class Loss(torch.nn.Module):  # train_side_by_side's call: model(ids, labels=...) -> loss
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, ids, labels):
            return self.inner(input_ids=ids, labels=labels).loss

    return Loss()


def _opts(keep_activations, gpu_memory=None, lowering="eager"):
    o = {"device": "cpu", "precision": "fp32", "lowering": lowering, "keep_activations": keep_activations}
    if gpu_memory is not None:
        o["gpu_memory"] = gpu_memory
    return o


def _assert_like_eager(out):
    for a, b in zip(out["loss"], out["loss_ref"]):
        assert abs(a - b) <= 1e-5 * abs(b), (out["loss"], out["loss_ref"])
    assert rel(out["grads"], out["grads_ref"]) < 1e-5
    assert rel(out["params"], out["params_ref"]) < 1e-3


def _mm_count(code: str) -> int:
    return code.count("torch.ops.aten.mm.default(")


def _layer_names(plan):
    return [r.name for r in plan.regions if r.name not in ("prologue", "epilogue")]


@pytest.mark.parametrize("build", [_llama, _hf_llama], ids=["own_llama", "hf_llama"])
def test_kept_and_mixed_plans_train_like_eager_and_skip_the_matmul_recompute(build):
    """Every region kept, then every other layer: exact against eager, the kept regions are
    the plan's (StepPlan.recompute False exactly there), and the backward computes exactly
    the kept regions' forward matmuls fewer times than with every region recomputing."""
    torch.manual_seed(random.randint(0, 10**6))
    model = build()
    batches = random_batches(96, 3, batch=2, seq=32)
    runs = {}
    plain = train_side_by_side(model, batches, _opts(False))
    names = _layer_names(plain["plan"])
    for label, forced in (("all", True), ("mixed", names[::2])):
        torch._dynamo.reset()
        out = train_side_by_side(model, batches, _opts(forced))
        _assert_like_eager(out)
        runs[label] = out
    _assert_like_eager(plain)

    g0 = plain["plan"].graphs[0]
    assert not g0.kept_regions and all(r.recompute for r in g0.step_plan.regions)
    fw_mm = _mm_count(g0.forward_code)
    # each forward matmul has two in the backward (the input's and the weight's gradient);
    # recomputing adds the forward's own again
    assert _mm_count(g0.backward_code) > 2 * fw_mm
    for label, out in runs.items():
        g = out["plan"].graphs[0]
        kept = g.kept_regions
        by_name = {r.id: r.name for r in out["plan"].regions}
        assert {r.id for r in g.step_plan.regions if not r.recompute} == set(kept)
        assert g.saved_activation_bytes > g0.saved_activation_bytes
        assert _mm_count(g.forward_code) == fw_mm
        if label == "all":
            assert {by_name[r] for r in kept} >= set(names)
            assert _mm_count(g.backward_code) == 2 * fw_mm  # no forward matmul runs again
        else:
            assert {by_name[r] for r in kept} == set(names[::2])
            assert 2 * fw_mm < _mm_count(g.backward_code) < _mm_count(g0.backward_code)


def test_a_kept_region_receives_the_gradient_of_its_boundary_not_of_what_it_saves():
    """The activation-gradient buffer between two regions' backwards (plan/program.py) is the
    gradient of the boundary output, read off the backward graph: for every layer of a
    fully kept Llama, the hidden state's bytes (tokens x hidden, fp32 here), while the
    layer saves several times that for its own backward."""
    torch.manual_seed(0)
    out = train_side_by_side(_llama(), random_batches(96, 1, batch=2, seq=32), _opts(True), steps=1)
    plan = out["plan"]
    problem = plan.graphs[0].predicted_schedule.problem
    layers = {r.id for r in plan.regions if r.name.startswith("layers.")}
    hidden = 2 * 32 * 48 * 4
    specs = [r for r in problem.regions if r.id in layers]
    assert len(specs) == 3
    for r in specs:
        assert r.grad_in_bytes == hidden, (r.id, r.grad_in_bytes)
        assert r.out_bytes > 3 * hidden, (r.id, r.out_bytes)


def test_kept_activations_can_wait_in_host_memory(recwarn):
    """Kept regions at a budget that fits only with boundary activations offloaded: the kept
    matmul outputs go to host memory with them, their device bytes freed (attention's output
    is a permuted view of its buffer, and still freed), and come back for the backward; the
    step trains like eager (keep, recompute and offload in one plan)."""
    torch.manual_seed(0)
    batches = random_batches(64, 3, batch=8, seq=64)
    roomy = train_side_by_side(offload_model(), batches, _opts(True, 64 * OFFLOAD_BUDGET), steps=1)
    need = least_budgets(roomy["plan"].graphs[0].schedule)
    assert need[True] < need[False]
    budget = (need[True] + need[False]) // 2
    torch._dynamo.reset()
    out = train_side_by_side(offload_model(), batches, _opts(True, budget))
    _assert_like_eager(out)
    g = out["plan"].graphs[0]
    assert g.kept_regions and g.schedule.plan.config.offloaded & set(g.kept_regions)
    assert g.predicted_peak_bytes <= budget
    store = g.streamer.activations
    assert store.emptied_bytes > 0 and store.reloaded_bytes == store.emptied_bytes
    assert not [w for w in recwarn if "shares its storage" in str(w.message)]


def _host_total(graph) -> int:
    return sum(v for _, v in graph.step_plan.host_needs)


@pytest.mark.slow  # host_memory's part of the choice; test_host_memory.py holds its budget in the default run
def test_kept_outputs_that_host_memory_cannot_hold_are_not_kept(monkeypatch):
    """Kept outputs of offloaded regions wait in host memory: where host_memory holds the
    recompute plan's offloads but not the kept ones, a forced keep warns and recomputes
    (it does not stop the compile), and the cost model's own pick fits host_memory; both
    train like eager."""
    torch.manual_seed(0)
    batches = random_batches(64, 3, batch=8, seq=64)
    roomy = train_side_by_side(offload_model(), batches, _opts(True, 64 * OFFLOAD_BUDGET), steps=1)
    need = least_budgets(roomy["plan"].graphs[0].schedule)
    budget = (need[True] + need[False]) // 2
    plans = {}
    for forced in (False, True):
        torch._dynamo.reset()
        plans[forced] = train_side_by_side(offload_model(), batches, _opts(forced, budget), steps=1)["plan"].graphs[0]
    assert plans[True].kept_regions and plans[True].schedule.plan.config.offloaded & set(plans[True].kept_regions)
    plain, kept = _host_total(plans[False]), _host_total(plans[True])
    assert plain < kept
    host_memory = (plain + kept) // 2
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="keep_activations=True does not fit host_memory"):
        out = train_side_by_side(offload_model(), batches, {**_opts(True, budget), "host_memory": host_memory})
    _assert_like_eager(out)
    g = out["plan"].graphs[0]
    assert not g.kept_regions and _host_total(g) <= host_memory

    monkeypatch.setattr(rates_mod, "CALIBRATED", ("cuda", "cpu"))
    torch._dynamo.reset()
    out = train_side_by_side(offload_model(), batches, {**_opts(None, budget), "host_memory": host_memory})
    _assert_like_eager(out)
    g = out["plan"].graphs[0]
    assert g.keep_choice is not None and _host_total(g) <= host_memory
    scored = dict(g.keep_choice.scored)
    assert scored[max(scored)] is None  # every candidate kept: its offloads overflow the host


def test_a_permuted_dense_tensor_owns_its_storage_and_a_slice_does_not():
    from megatrain.runtime.activation_offload import _sole_owner

    shape = [random.randint(1, 5) for _ in range(4)]
    base = torch.empty(shape)
    assert _sole_owner(base.permute(*random.sample(range(4), 4)))
    assert _sole_owner(base.transpose(1, 2))
    assert not _sole_owner(torch.empty(6, 4)[:, :2])  # half the storage
    assert not _sole_owner(torch.empty(6, 4)[1:])
    assert not _sole_owner(torch.empty(4, 1).expand(4, 3))  # overlapping


def test_the_cost_model_chooses_on_a_calibrated_device(monkeypatch):
    """With the CPU counted as calibrated, keep_activations=None asks the cost model: at a
    generous budget it keeps regions, its pick is predicted no slower than recomputing
    everywhere, and the step trains like eager; at the leanest budget it keeps none."""
    monkeypatch.setattr(rates_mod, "CALIBRATED", ("cuda", "cpu"))
    torch.manual_seed(0)
    batches = random_batches(96, 3, batch=2, seq=32)
    out = train_side_by_side(_llama(), batches, _opts(None, 64 << 20))
    _assert_like_eager(out)
    g = out["plan"].graphs[0]
    choice = g.keep_choice
    assert choice is not None and choice.kept and g.kept_regions
    scored = dict(choice.scored)
    assert scored[0] is not None and choice.step_s <= scored[0]
    assert choice.step_s == min(s for s in scored.values() if s is not None) or \
        choice.step_s <= min(s for s in scored.values() if s is not None) * (1 + keep.TIE)


def test_a_failure_while_deciding_warns_and_recomputes(monkeypatch):
    """Keeping is a speed-up: should deciding it fail (here the chooser raises), the compile
    warns, every region recomputes, and the step trains like eager."""
    from megatrain.compiler import keep as compiler_keep

    def broken(*args, **kwargs):
        raise RuntimeError("no kept partition for this graph")

    monkeypatch.setattr(rates_mod, "CALIBRATED", ("cuda", "cpu"))
    monkeypatch.setattr(compiler_keep, "choose_kept", broken)
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="no kept partition for this graph"):
        out = train_side_by_side(_llama(), random_batches(96, 3, batch=2, seq=32), _opts(None, 64 << 20))
    _assert_like_eager(out)
    assert not out["plan"].graphs[0].kept_regions


@pytest.mark.slow  # a forced knob's refusal (config.keep_activations), a diagnostic path
def test_a_forced_keep_that_does_not_fit_says_so_and_recomputes():
    """keep_activations=True at a budget that holds the recomputing plan but not the kept
    one (no offload): a warning names the forced value, and the step recomputes and trains
    like eager."""
    torch.manual_seed(0)
    batches = random_batches(64, 3, batch=8, seq=64)
    need = {}
    for keep_them in (False, True):
        torch._dynamo.reset()
        out = train_side_by_side(offload_model(), batches, {**_opts(keep_them, 64 * OFFLOAD_BUDGET),
                                                            "offload": False}, steps=1)
        need[keep_them] = least_budgets(out["plan"].graphs[0].schedule)[False]
    assert need[False] < need[True]
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="keep_activations=True does not fit"):
        out = train_side_by_side(offload_model(), batches,
                                 {**_opts(True, (need[False] + need[True]) // 2), "offload": False})
    _assert_like_eager(out)
    assert not out["plan"].graphs[0].kept_regions


def test_an_unknown_region_name_is_refused_with_the_names():
    torch.manual_seed(0)
    with pytest.raises(MegatrainValueError, match="layers.0"):
        train_side_by_side(_llama(), random_batches(96, 1, batch=2, seq=32), _opts(["nope"]), steps=1)


# -- the chooser on random problems ----------------------------------------------------


def _kept_twin(problem: Problem, data) -> Problem:
    """`problem` as if every region kept: more bytes saved, its backward without the
    recompute (the simulator charges flops_fw + flops_bw)."""
    from dataclasses import replace

    regions = []
    for r in problem.regions:
        b = 2 * r.flops_fw if r.flops_bw is None else r.flops_bw
        tb = 2 * r.traffic_fw if r.traffic_bw is None else r.traffic_bw
        extra = data.draw(st.integers(0, 1 << 28))
        regions.append(replace(r, out_bytes=r.out_bytes + extra, flops_bw=max(b - r.flops_fw, 0),
                               traffic_bw=max(tb - r.traffic_fw, 0)))
    return replace(problem, regions=tuple(regions))


def _score(budget, rates):
    def score(p):
        try:
            return plan_step(p, budget, rates, options=PlannerOptions(max_slots=2)).step_time
        except InfeasibleBudget:
            return None
    return score


@budget_settings(120)
@given(problem=problems(max_regions=7), rates=rates_st, factor=st.floats(1.0, 4.0),
       more=st.floats(1.0, 3.0), data=st.data())
def test_the_chooser_fits_never_loses_to_recompute_and_likes_more_budget(problem, rates, factor, more, data):
    assume(problem.training)
    twin = _kept_twin(problem, data)
    assert keep.comparable(problem, twin)
    budget = int(min_budget(problem) * factor)
    choice = keep.choose_kept(problem, twin, rates, _score(budget, rates))
    plain = _score(budget, rates)(problem)
    assert plain is not None  # the recompute problem fits: factor >= 1
    assert choice.step_s is not None and choice.step_s <= plain
    mixed = keep.mixed(problem, twin, choice.kept)
    plan = plan_step(mixed, budget, rates, options=PlannerOptions(max_slots=2))
    validate(plan.schedule, budget)
    assert plan.step_time == pytest.approx(choice.step_s)
    larger = keep.choose_kept(problem, twin, rates, _score(int(budget * more), rates))
    assert larger.step_s <= choice.step_s * (1 + keep.TIE) + 1e-12


def test_the_chooser_keeps_where_compute_bounds_the_step_and_not_where_memory_is_short():
    """A chain of equal layers on fast links: with room for every kept layer it keeps them
    all (each saves a recompute); at the recompute plan's own least budget it keeps none."""
    from megatrain.plan.costs import GPU_DEFAULT

    n, wbytes, out, flops = 8, 1 << 20, 1 << 20, 1 << 40
    plain = Problem.chain([wbytes] * n, out_bytes=out, flops=flops)
    twin = Problem.chain([wbytes] * n, out_bytes=8 * out, flops=flops)
    from dataclasses import replace
    twin = replace(twin, regions=tuple(replace(r, flops_bw=r.flops_fw) for r in twin.regions))
    roomy = keep.choose_kept(plain, twin, GPU_DEFAULT, _score(1 << 34, GPU_DEFAULT))
    assert roomy.kept == frozenset(range(n))
    tight = keep.choose_kept(plain, twin, GPU_DEFAULT, _score(min_budget(plain), GPU_DEFAULT))
    assert len(tight.kept) < n
