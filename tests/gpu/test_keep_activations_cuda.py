"""Kept activations on CUDA (compiler/keep.py): with Inductor's lowering, regions whose
backward reads their saved matmul and attention outputs (flash attention's output and
log-sum-exp among them) train like the same regions recomputing; and left to the cost
model (keep_activations None) at a roomy budget with every region's AdamW state resident
(a compute-bound step), the plan keeps regions and its step stays within gpu_memory. Tolerance: assert_runs_agree's (compare.py)."""

from __future__ import annotations

import pytest

from .compare import assert_runs_agree, seeded_llama_and_batches, train_fp32_on_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]


def test_kept_activations_match_recomputing_on_cuda():
    model, batches = seeded_llama_and_batches()
    kept, kept_losses, plan = train_fp32_on_cuda(model, batches, keep_activations=True, updates="host")
    plain, plain_losses, plain_plan = train_fp32_on_cuda(model, batches, keep_activations=False, updates="host")
    assert len(plan.kept_regions) >= 4 and not plain_plan.kept_regions
    assert plan.measured_peak_bytes <= plan.budget
    assert_runs_agree(model, kept, plain, kept_losses, plain_losses)


def test_the_cost_model_keeps_regions_at_a_roomy_budget_on_cuda():
    model, batches = seeded_llama_and_batches()
    kept, losses, plan = train_fp32_on_cuda(model, batches, gpu_memory="8GiB", updates="resident")
    plain, plain_losses, _ = train_fp32_on_cuda(model, batches, gpu_memory="8GiB", keep_activations=False,
                                                updates="resident")
    assert plan.kept_regions and plan.keep_choice is not None
    assert plan.measured_peak_bytes <= plan.budget
    assert_runs_agree(model, kept, plain, losses, plain_losses)
