"""A signal keeps the run's work: the first SIGINT or SIGTERM saves a complete checkpoint
at the next step boundary and says which step --resume continues from; a second stops at
once and says what was kept."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain.train import checkpoint

from _train_helpers import SMALL, python_env, rows, train

LONG = ["--steps", "100000", "--save-every", "0", "--lr", "1e-2"]


def _start(out: Path, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**python_env(), **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "megatrain", "train", *SMALL, *LONG, "--out", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_rows(proc, out: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    raise AssertionError(f"no {n} steps within {timeout} s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_next_step_and_resume_continues_there(tmp_path, sig):
    out = tmp_path / "run"
    proc = _start(out)
    try:
        _wait_for_rows(proc, out, 3)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    done = rows(out)[-1]["step"]
    assert f"{sig.name}: stopped after step {done} and saved it" in err, err
    assert f"--resume continues from step {done + 1}" in err, err
    assert [s for s, _ in checkpoint.list_checkpoints(out)] == [done]
    assert json.loads((checkpoint.latest_checkpoint(out) / "state.json").read_text())["step"] == done
    assert train(*LONG, "--out", str(out), "--resume", "--stop-after", "2") == 0
    assert [r["step"] for r in rows(out)][-3:] == [done, done + 1, done + 2]


def test_a_second_signal_stops_at_once_and_says_what_was_kept(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, {"MEGATRAIN_SAVE_SLEEP": ":120"})  # every save sleeps before its rename
    try:
        _wait_for_rows(proc, out, 2)
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        root = out / "checkpoints"
        while not (root.is_dir() and list(root.glob(".tmp-*"))):  # the save has started
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and time.monotonic() - t0 < 30, err
    assert "stopped at once on a second signal; no checkpoint was complete: nothing to resume" in err, err
    assert checkpoint.list_checkpoints(out) == []
