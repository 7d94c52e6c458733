"""Per-step metrics: `metrics.jsonl` in the run folder, one JSON object per optimizer step.

Each row has at least step, loss, lr, tokens_per_s; also tflops (model FLOPs: 6 N T plus
attention, recompute not counted), grad_norm, step_time_s, tokens, elapsed_s and memory.
A run with an eval set also writes {"step", "eval_loss"} rows (after that step's row).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

FILENAME = "metrics.jsonl"


def read_metrics(out: str | Path) -> list[dict]:
    path = Path(out) / FILENAME
    if not path.is_file():
        return []
    rows = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break        # a torn last line from a killed process
    return rows


class MetricsWriter:
    """Appends rows; on resume first drops rows past the checkpoint's step."""

    def __init__(self, out: str | Path, resume_step: int | None = None):
        self.path = Path(out) / FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep = [r for r in read_metrics(out) if r.get("step", 0) <= resume_step] \
            if resume_step is not None else []
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as fh:
            for r in keep:
                fh.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)
        self._fh = open(self.path, "a")

    def write(self, row: dict) -> None:
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def peak_rss_bytes() -> int:
    """The process's highest resident set so far (0 where the OS does not say)."""
    try:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return 0
    return int(peak) * (1 if sys.platform == "darwin" else 1024)   # bytes on macOS, KiB else


def host_rss_bytes() -> int:
    try:
        import psutil
        return int(psutil.Process(os.getpid()).memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def device_peak_bytes(device: str) -> int | None:
    """The CUDA allocator's high-water mark: every byte allocated on the device, whoever
    holds it (AdamW state kept resident across steps included). megatrain's runtime resets
    the mark at each step's start, so after a step it is that step's peak; under eager it
    is the run's so far. None on the CPU device: its bytes are host memory, in
    `host_rss_bytes`. (`megatrain.explain(step).measured_peak_bytes` is another figure:
    the step's peak above what it started with, which leaves the resident state out.)"""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return None


def device_alloc_retries(device: str) -> int | None:
    """How often the CUDA allocator found no free block and had to give cached memory back
    to the driver and try again, over the run so far: each retry synchronizes the device,
    so a run that retries every step is paying for a device filled to its edge. None off
    CUDA."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.memory_stats(torch.device(device)).get("num_alloc_retries", 0))
    return None
