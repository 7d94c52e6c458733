"""bench/plan_preview.py: the plan of a bench shape on the CPU, stopped before compiling."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from plan_preview import peak_contents, preview  # noqa: E402


def test_preview_plans_within_the_budget_and_names_the_least_one_when_it_cannot():
    schedule, error = preview("tiny", None, tokens=1024, seq=256, gpu_memory="64MiB")
    assert error is None and 0 < schedule.plan.peak_bytes <= 64 << 20
    # what fills the peak: the planner's own words, the boundary activations among them
    contents = peak_contents(schedule.plan)
    assert " of region " in contents and "boundary activations" in contents, contents
    too_small = schedule.plan.peak_bytes // 4
    schedule, error = preview("tiny", None, tokens=1024, seq=256, gpu_memory=str(too_small))
    assert schedule is None and f"gpu_memory={too_small} bytes" in str(error), error
