"""Helpers shared by tests/train (imported by name: pytest puts this folder on sys.path)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from megatrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
# Small and fast: the tiny preset on short sequences, plain torch on the CPU, fp32.
SMALL = ["--compile", "eager", "--device", "cpu", "--precision", "fp32", "--seq", "32",
         "--batch-tokens", "128", "--no-progress"]


def train(*args: str) -> int:
    return main(["train", *SMALL, *args])


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def python_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_module(*args: str, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrain", *args], cwd=cwd, env=env or python_env(),
                          capture_output=True, text=True, timeout=timeout)

