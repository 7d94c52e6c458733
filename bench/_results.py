"""Shared tail of the bench scripts: run metadata and appending result rows to a jsonl file.

Every row a benchmark records carries where and on what it ran (GPU, commit, versions),
so rows from different machines and commits can share one file.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def archived_commit() -> str:
    """The commit a `git archive` of the repository was made from (export-subst fills
    ARCHIVED_COMMIT, .gitattributes); "unknown" in a tree that was not archived."""
    try:
        text = (REPO / "bench" / "ARCHIVED_COMMIT").read_text().strip()
    except OSError:
        return "unknown"
    return text if text and not text.startswith("$Format") else "unknown"


def run_metadata() -> dict:
    """commit (and whether the tree was dirty), GPU name ("cpu" without CUDA), torch,
    triton and python versions, the local time, and a run_id shared by every row of this
    run (comparisons such as "vs resident-compiled" are only fair inside one run)."""
    try:
        commit, dirty = _git("rev-parse", "HEAD"), bool(_git("status", "--porcelain"))
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = archived_commit(), None
    # A copy of the tree on another machine may carry a stale .git or none: the caller
    # names the commit it copied.
    commit = os.environ.get("MEGATRAIN_COMMIT", commit)
    now = time.localtime()
    return {
        "run_id": f"{time.strftime('%Y%m%dT%H%M%S', now)}-{os.getpid()}",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "triton": _version("triton"),
        "python": platform.python_version(),
        "commit": commit, "dirty": dirty, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", now),
        # which machine: rows of two runs on one warm machine may be compared (readme_table)
        "hostname": platform.node(),
    }


def append_rows(path: str | Path, rows: list[dict]) -> Path:
    """Append one JSON line per row to `path` (parents created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"appended {len(rows)} rows to {out}")
    return out
