"""bench/plan_preview.py: the plan of a bench shape on the CPU, stopped before compiling."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from plan_preview import peak_contents, preview  # noqa: E402


def test_preview_plans_within_the_budget_and_names_the_least_one_when_it_cannot():
    schedule, error, sites = preview("tiny", None, tokens=1024, seq=256, gpu_memory="64MiB")
    assert error is None and sites is None and 0 < schedule.plan.peak_bytes <= 64 << 20
    # what fills the peak: the planner's own words, the boundary activations among them
    contents = peak_contents(schedule.plan)
    assert " of region " in contents and "boundary activations" in contents, contents
    too_small = schedule.plan.peak_bytes // 4
    schedule, error, _ = preview("tiny", None, tokens=1024, seq=256, gpu_memory=str(too_small))
    assert schedule is None and f"gpu_memory={too_small} bytes" in str(error), error


def test_preview_shows_which_regions_the_reserve_makes_resident():
    """--updates resident: the compile's own choice, within the reserve the plan leaves."""
    schedule, error, roomy = preview("tiny", None, tokens=1024, seq=256, gpu_memory="64MiB", updates="resident")
    assert error is None and set(roomy.sites.values()) == {"resident"}, roomy
    state = 12 * sum(roomy.numel.values())  # master, m, v in fp32
    assert state <= roomy.reserve
    # a budget whose reserve holds about half the state: the regions the next forward needs
    # first (the backward's last) are resident, the others stay on the host
    _, error, half = preview("tiny", None, tokens=1024, seq=256, gpu_memory=str(schedule.plan.peak_bytes + state // 2),
                             updates="resident")
    resident = [r for r, site in half.sites.items() if site == "resident"]
    assert error is None and 0 < len(resident) < len(half.sites), half
    assert min(half.sites) in resident
    assert 12 * sum(half.numel[r] for r in resident) <= half.reserve
    assert f"resident {len(resident)} regions" in half.summary(), half.summary()


def test_preview_plans_with_a_gpu_runs_rates_and_times_the_sites():
    """--rates: the plan as a GPU run's rates make it (a row's planned_rates); with update
    sites the step is timed as the runtime runs it: all resident, no host updates left."""
    from megatrain.plan.costs import GPU_DEFAULT

    schedule, error, sites = preview("tiny", None, tokens=1024, seq=256, gpu_memory="64MiB",
                                     updates="resident", rates=GPU_DEFAULT)
    assert error is None and schedule.rates == GPU_DEFAULT
    slow = GPU_DEFAULT.scaled(host=0.01)  # every update on the host bounds the step
    schedule_slow, _, sites_slow = preview("tiny", None, tokens=1024, seq=256, gpu_memory="64MiB",
                                           updates="resident", rates=slow)
    assert schedule_slow.rates == slow and sites_slow.sites == sites.sites
    sited = sites_slow.predicted(schedule_slow)
    assert sited.peak_bytes == schedule_slow.plan.peak_bytes
    assert sum(sited.end[t] - sited.start[t] for t in sited.streams["host"]) == 0
    assert sited.step_time < schedule_slow.plan.step_time


@pytest.mark.slow  # bench tooling (bench/prediction_check.py)
def test_prediction_check_replans_a_recorded_row_with_its_rates(tmp_path, capsys):
    """bench/prediction_check.py: a row's prediction is reproduced from its planned_rates
    (the recorded one is what the bench stored), with its live resident count applied."""
    import json

    from megatrain.plan.costs import GPU_DEFAULT

    import prediction_check

    slow = GPU_DEFAULT.scaled(host=0.01)
    schedule, _, sites = preview("tiny", None, tokens=1024, seq=256, gpu_memory="64MiB", updates="resident",
                                 rates=slow)
    assert len(sites.acquiring) >= 2
    row = {"system": "megatrain", "model": "tiny", "layers": None, "tokens_per_step": 1024, "seq": 256,
           "gpu_memory": "64MiB", "updates": "resident", "resident_regions": 1, "kernels": None,
           "planned_rates": slow.to_json(), "step_s": 1.0, "predicted_step_s": schedule.plan.step_time,
           "time": "2026-12-05T00:00:00"}
    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps(row) + "\n" + json.dumps({**row, "system": "resident-compiled"}) + "\n")
    assert [r["system"] for r in prediction_check.rows_to_check(rows, ["tiny"])] == ["megatrain"]
    got = prediction_check.replan(row, {})
    assert got["host"] == schedule.plan.step_time  # the recorded prediction, reproduced
    one = sites.predicted(schedule, sites.with_resident(1)).step_time
    assert got["sited"] == one and sites.predicted(schedule).step_time < one < got["host"]
    assert prediction_check.main(["--rows", str(rows), "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "1 rows" in out and "mean absolute error, sited" in out


def test_preview_plans_a_hugging_face_model_as_the_hf_bench_compiles_it():
    """A model of bench/hf_train.py (here Qwen2-1.5B's width, one layer): built on the meta
    device and emptied in place, so its tied embedding stays one weight that two regions
    fetch; compiled as the HF bench does (outputs="loss"), so the planned step holds no
    [tokens, vocab] logits for the caller."""
    import hf_models

    cfg = hf_models.config("qwen2-1.5b")
    tokens, vocab, hidden = 512, cfg.vocab_size, cfg.hidden_size
    planned = {}
    for outputs in ("loss", "all"):
        schedule, error, _ = preview("qwen2-1.5b", 1, tokens=tokens, seq=256, gpu_memory="3GiB",
                                     kernels="linear_cross_entropy", outputs=outputs)
        assert error is None, error
        planned[outputs] = schedule.plan.schedule.problem
    problem = planned["loss"]
    tied = [w for w in problem.weights if w.nbytes >= vocab * hidden * 2]
    assert len(tied) == 1, [w.nbytes for w in problem.weights]
    assert sum(1 for r in problem.regions if tied[0].id in r.reads("fw")) == 2
    # returning the logits makes the head's forward hold them: [tokens, vocab] in bf16
    head = lambda p: max(int(r.work_fw) for r in p.regions)  # noqa: E731
    assert head(planned["all"]) - head(problem) >= tokens * vocab * 2
