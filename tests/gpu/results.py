"""Result rows of the GPU tests, appended where the device run collects them."""

from __future__ import annotations

import contextlib
import json
import os

import torch


def record_result(name: str, row: dict) -> None:
    """Append a row to $MEGATRAIN_RESULTS/backend_gpu.jsonl (nothing when it is unset)."""
    out = os.environ.get("MEGATRAIN_RESULTS")
    if out:
        row = {"test": name, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **row}
        with open(os.path.join(out, "backend_gpu.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


@contextlib.contextmanager
def allocations():
    """Record the CUDA caching allocator's events inside the block; yields the list of
    events (filled on exit) for `blocks_at_peak`."""
    trace: list[dict] = []
    torch.cuda.memory._record_memory_history(stacks="python")
    try:
        yield trace
        trace.extend(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def blocks_at_peak(trace: list[dict]) -> list[str]:
    """Replay a CUDA allocator trace (torch.cuda.memory._snapshot): the blocks allocated
    while recording that were live when their sum peaked, biggest first, each with the
    frames that allocated it (`where`)."""
    live, total, peak, at_peak = {}, 0, -1, {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]

    def frame(f):
        return f"{f['name']} ({f['filename'].rsplit('/', 1)[-1]}:{f['line']})"

    def where(event):
        """The innermost frame, and the innermost in megatrain or the tests if that differs
        (Inductor's generated code runs inside megatrain's ops)."""
        frames = event.get("frames") or [{"filename": "?", "line": 0, "name": "?"}]
        ours = [f for f in frames if "megatrain" in f["filename"] or "tests" in f["filename"]]
        return frame(frames[0]) + (f" in {frame(ours[0])}" if ours and ours[0] is not frames[0] else "")

    return [f"{e['size'] / 2**20:.1f} MiB at {where(e)}"
            for e in sorted(at_peak.values(), key=lambda e: -e["size"])]
