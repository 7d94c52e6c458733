"""The memory plan's numbers follow from the parameter count: 12 B/param of fp32 master and
AdamW moments on the host, plus what the run's options add."""

import random

import pytest
import torch

from megatrain.models import PRESETS, Llama
from megatrain.train.plan import PlanConfig, check_fits, model_flops_per_token, plan_memory


def _meta(name):
    with torch.device("meta"):
        return Llama(PRESETS[name])


def test_host_bytes_per_parameter():
    model = _meta("tiny")
    n = sum(p.numel() for p in model.parameters())
    fast = plan_memory(model, PlanConfig(tokens=4096, seq=256, device="cuda"))
    assert fast.n_params == n
    assert fast.host["fp32 master weights"] == 4 * n
    assert fast.host["AdamW moments m, v (fp32)"] == 8 * n
    assert "gradients p.grad (fp32)" not in fast.host          # megatrain.AdamW: none
    compat = plan_memory(model, PlanConfig(tokens=4096, seq=256, device="cuda", optimizer="torch"))
    assert compat.host["gradients p.grad (fp32)"] == 4 * n
    assert compat.host_needed == compat.host_total              # device memory is separate
    # clipping holds each gradient until the norm is known: bf16 as handed in, fp32 summed
    clipped = plan_memory(model, PlanConfig(tokens=4096, seq=256, device="cuda", clip=1.0))
    assert clipped.host["gradients held for the clip (bf16)"] == 2 * n
    summed = plan_memory(model, PlanConfig(tokens=4096, seq=256, device="cuda", clip=1.0,
                                           grad_accum=2))
    assert summed.host["gradients p.grad (fp32)"] == 4 * n
    assert "checkpoint shard buffer" in fast.host
    unsaved = plan_memory(model, PlanConfig(tokens=4096, seq=256, device="cuda", saves=False))
    assert fast.host_total - unsaved.host_total == fast.host["checkpoint shard buffer"]
    cpu = plan_memory(model, PlanConfig(tokens=4096, seq=256, device="cpu", compile="eager"))
    assert cpu.host_needed == cpu.host_total + cpu.device_total  # the CPU is the device


def test_8b_plan():
    model = _meta("8b")
    p = plan_memory(model, PlanConfig(tokens=4096, seq=4096, device="cuda"))
    assert 8.0e9 < p.n_params < 8.1e9
    assert p.host_total >= 12 * p.n_params
    # the device holds a few layers and activations, not the model
    assert p.device_total < 0.5 * 4 * p.n_params
    with pytest.raises(ValueError, match="host RAM"):
        check_fits(p, 64 << 30)
    check_fits(p, 1 << 40)
    text = p.table(1 << 40)
    assert "fp32 master weights" in text and "fits" in text
    # the device's bytes are the planner's: no coarse estimate or step guess beside its plan
    assert "the planner fits the step" in text and "predicted step" not in text


def test_model_flops_per_token():
    model = _meta("tiny")
    cfg = PRESETS["tiny"]
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model_flops_per_token(model, 256) == 6 * linear + 12 * cfg.layers * cfg.hidden * 256


def test_plan_summary_predicts_the_step_where_the_cost_model_holds(monkeypatch):
    """On a GPU the line carries the backend's predicted step, which the run's last line is
    measured against; on the CPU device only the planned peak (no uncalibrated guess)."""
    import types

    import megatrain
    from megatrain.train.plan import plan_summary

    step_s, peak = random.uniform(0.01, 2.0), random.randint(1 << 20, 1 << 34)
    aot = random.uniform(0.5, 90.0)
    info = types.SimpleNamespace(predicted_step_s=step_s, predicted_peak_bytes=peak,
                                 compile_seconds={"aot": aot, "planning": aot / 10}, waits=[],
                                 kept_regions=[], regions=[object()] * 5)
    monkeypatch.setattr(megatrain, "explain", lambda fn: info)
    line, predicted = plan_summary(object(), "cuda")
    assert predicted == step_s and "predicted step" in line and "planned peak device" in line
    assert f"; compile aot {aot:.1f} s, planning {aot / 10:.1f} s" in line   # longest first
    assert "GPU waits" not in line and "keep their activations" not in line
    info.kept_regions = ["layers.0", "layers.1"]
    line, _ = plan_summary(object(), "cuda")
    assert "(2 of 5 regions keep their activations, no recompute)" in line
    from megatrain.plan.waits import Wait
    from megatrain.train.plan import fmt_seconds

    info.waits = sorted((Wait(random.uniform(1e-3, 1.0), r, random.randint(0, 9))
                         for r in random.sample(["host", "h2d", "d2h"], 2)), key=lambda w: -w.seconds)
    line, _ = plan_summary(object(), "cuda")
    most = {"host": "the host optimizer", "h2d": "weights coming in", "d2h": "gradients going out"}
    total = fmt_seconds(sum(w.seconds for w in info.waits))
    assert f"GPU waits {total} (most on {most[info.waits[0].reason]})" in line
    line, predicted = plan_summary(object(), "cpu")
    assert predicted is None and "predicted step" not in line and "planned peak device" in line


def test_plan_at_end_reads_the_sites_in_effect_and_the_resident_share(monkeypatch):
    """The run's last line carries the prediction with the update sites as they ended (the
    resident set grows after measured steps) and the share of parameters whose AdamW state
    the device holds; on the CPU no prediction, and nothing said of a share of none."""
    import types

    import megatrain
    from megatrain.train.plan import plan_at_end

    n = random.randint(10**6, 10**10)
    resident, step_s = random.randint(1, n), random.uniform(0.01, 9.0)
    info = types.SimpleNamespace(predicted_step_s=step_s, resident_params=resident)
    monkeypatch.setattr(megatrain, "explain", lambda fn: info)
    words, predicted, held = plan_at_end(object(), "cuda", n)
    assert predicted == step_s and held == resident
    assert words.startswith("plan: ") and f"({resident / n:.0%}) on the device" in words
    info.resident_params = 0
    words, predicted, held = plan_at_end(object(), "cpu", n)
    assert (words, predicted, held) == ("", None, 0)
