"""Benchmark rows name the commit they ran: from git, or, in a tree unpacked from `git
archive` (how the device machine gets it), from bench/ARCHIVED_COMMIT, which the archive
fills in (.gitattributes export-subst)."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_an_archived_tree_names_its_commit(tmp_path):
    try:
        head = _git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing to archive")
    tar = subprocess.run(["git", "archive", "HEAD", "bench/_results.py", "bench/ARCHIVED_COMMIT"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(tmp_path, filter="data")
    spec = importlib.util.spec_from_file_location("archived_results", tmp_path / "bench" / "_results.py")
    results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results)
    assert results.archived_commit() == head
    # the working tree's own copy is not an archive's
    assert (ROOT / "bench" / "ARCHIVED_COMMIT").read_text().startswith("$Format")
