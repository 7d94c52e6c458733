"""Chrome-trace (Perfetto) timelines of a step: predicted from a Schedule, or measured.

One process per trace, one track (tid) per stream, a complete event (ph "X") per task with
microsecond times, so overlap and stalls show at a glance in ui.perfetto.dev or
chrome://tracing. Predicted and measured traces use the same track names and order, so
they read side by side, as two files or as two processes of one (`merge`).

Measured records are (name, stream, start_ms, end_ms) intervals. `cuda_records` reads
them off the streamer's last step: the CUDA event pairs it records per region (`MEASURED`
names which lists, and on which stream): weight copies, the compute stream's waits for
them, each region's compute (weights ready to evict) and its gradients' copies out.
The host optimizer's updates run on host threads without CUDA events; their measured
total is `megatrain.AdamW.host_busy_s`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

from .program import STREAMS
from .simulate import Schedule


@dataclass(frozen=True)
class Record:
    """One measured interval (e.g. between two CUDA events), in milliseconds."""

    name: str
    stream: str
    start_ms: float
    end_ms: float


# StepStats attribute -> (stream, slice name): lists of (region, start event, end event).
MEASURED = {"transfers": ("h2d", "h2d r{}"), "waits": ("compute", "wait for weights r{}"),
            "computes": ("compute", "compute r{}"), "grad_copies": ("d2h", "d2h r{}")}


def cuda_records(stats) -> list[Record]:
    """The measured intervals of a step from its CUDA event pairs, in ms from the earliest
    (blocks until they have completed); [] when none were recorded (the CPU device)."""
    pairs = [(stream, name.format(region), a, b) for attr, (stream, name) in MEASURED.items()
             for region, a, b in (getattr(stats, attr, None) or ())]
    if not pairs:
        return []
    for *_, end in pairs:
        end.synchronize()
    origin = pairs[0][2]
    times = [(name, stream, origin.elapsed_time(a), origin.elapsed_time(b)) for stream, name, a, b in pairs]
    zero = min(t[2] for t in times)
    return [Record(name, stream, a - zero, b - zero) for name, stream, a, b in times]


def _tids(streams: Iterable[str]) -> dict[str, int]:
    known = [s for s in STREAMS]
    extra = sorted(set(streams) - set(known))
    return {s: i + 1 for i, s in enumerate(known + extra)}


def _metadata(pid: int, process: str, tids: dict[str, int]) -> list[dict]:
    events = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": process}}]
    for stream, tid in tids.items():
        events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": stream}})
        events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                       "args": {"sort_index": tid}})
    return events


def _task_name(t) -> str:
    where = f"r{t.region}" if t.phase == "host" else f"r{t.region} {t.phase}"
    return f"{t.kind} {where} m{t.micro} s{t.step}"


def chrome_trace(schedule: Schedule, pid: int = 1, process: str = "megatrain predicted") -> dict:
    """The predicted timeline: every task of every stream, zero-length ops included."""
    used = [s for s, seq in schedule.streams.items() if seq]
    tids = _tids(used)
    tids = {s: tids[s] for s in used}
    events = _metadata(pid, process, tids)
    for stream in used:
        for t in schedule.streams[stream]:
            t0, t1 = schedule.start[t], schedule.end[t]
            events.append({"name": _task_name(t), "cat": t.kind, "ph": "X", "pid": pid,
                           "tid": tids[stream], "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6,
                           "args": {"region": t.region, "phase": t.phase, "micro": t.micro,
                                    "step": t.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_time_s": schedule.step_time, "gpu_idle_s": schedule.gpu_idle,
                          "peak_bytes": schedule.peak_bytes, "config": schedule.config.describe()}}


def measured_trace(records: Iterable, pid: int = 2, process: str = "megatrain measured") -> dict:
    """The measured timeline from (name, stream, start_ms, end_ms) records."""
    recs = [r if isinstance(r, Record) else Record(*r) for r in records]
    for r in recs:
        if r.end_ms < r.start_ms:
            raise ValueError(f"record {r.name!r} on {r.stream!r} ends ({r.end_ms} ms) before it "
                             f"starts ({r.start_ms} ms)")
    tids = _tids(r.stream for r in recs)
    used = {r.stream for r in recs}
    tids = {s: t for s, t in tids.items() if s in used}
    events = _metadata(pid, process, tids)
    for r in recs:
        events.append({"name": r.name, "cat": r.stream, "ph": "X", "pid": pid, "tid": tids[r.stream],
                       "ts": r.start_ms * 1e3, "dur": (r.end_ms - r.start_ms) * 1e3})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def merge(traces: Iterable[dict]) -> dict:
    """One trace holding several (each with its own pid): predicted beside measured."""
    traces = list(traces)
    return {"traceEvents": [e for t in traces for e in t["traceEvents"]], "displayTimeUnit": "ms",
            "otherData": {str(i): t.get("otherData", {}) for i, t in enumerate(traces)}}


def _write(trace: dict, path) -> str:
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(trace, f)
    return path


def write_chrome_trace(schedule: Schedule, path) -> str:
    """Write the predicted timeline of `schedule` to `path` (JSON); returns the path."""
    return _write(chrome_trace(schedule), path)


def write_measured_trace(records: Iterable, path) -> str:
    """Write measured (name, stream, start_ms, end_ms) records to `path` (JSON)."""
    return _write(measured_trace(records), path)


def write_trace(trace: dict, path) -> str:
    """Write any trace built here (e.g. a `merge`) to `path` (JSON); returns the path."""
    return _write(trace, path)
