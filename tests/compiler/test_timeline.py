"""Chrome-trace timelines: they load as JSON, with one track per stream."""

from __future__ import annotations

import json

import pytest

from megatrain.plan.costs import GPU_DEFAULT
from megatrain.plan.problem import Problem
from megatrain.plan.search import plan_step
from megatrain.plan.timeline import Record, write_chrome_trace, write_measured_trace


def _tracks(trace: dict) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_predicted_trace_has_one_track_per_stream(tmp_path):
    p = Problem.chain([200_000_000] * 4, out_bytes=10**8, flops=4 * 10**12, work_bw=10**8, micro_batches=2)
    plan = plan_step(p, 10**10, GPU_DEFAULT)
    path = write_chrome_trace(plan.schedule, tmp_path / "predicted.json")
    trace = json.loads(open(path).read())
    tracks = _tracks(trace)
    assert sorted(tracks.values()) == sorted(s for s, seq in plan.schedule.streams.items() if seq)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(plan.schedule.graph)
    assert {e["tid"] for e in slices} == set(tracks)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    # Slices on one track never overlap: the stream runs one task at a time.
    for tid in tracks:
        xs = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices if e["tid"] == tid)
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(xs, xs[1:]))
    end_us = max(e["ts"] + e["dur"] for e in slices)
    assert end_us == pytest.approx(plan.schedule.makespan * 1e6)


def test_measured_trace_from_records(tmp_path):
    records = [("compute r0 fw", "compute", 0.5, 2.0), Record("h2d r1 fw", "h2d", 0.0, 1.0),
               ("d2h r0", "d2h", 3.0, 3.5), ("h2d r2 fw", "h2d", 1.0, 2.5)]
    trace = json.loads(open(write_measured_trace(records, tmp_path / "measured.json")).read())
    tracks = _tracks(trace)
    assert sorted(tracks.values()) == ["compute", "d2h", "h2d"]
    by_name = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert by_name["h2d r2 fw"]["ts"] == 1000.0 and by_name["h2d r2 fw"]["dur"] == 1500.0
    assert tracks[by_name["h2d r1 fw"]["tid"]] == "h2d"
    with pytest.raises(ValueError, match="before it"):
        write_measured_trace([("bad", "h2d", 2.0, 1.0)], tmp_path / "bad.json")
