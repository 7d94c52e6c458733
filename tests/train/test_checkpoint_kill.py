"""A process killed inside a checkpoint save leaves the previous checkpoint intact."""

import os
import signal
import subprocess
import sys
import time

from megatrain.models import PRESETS, Llama
from megatrain.train import checkpoint

from _train_helpers import SMALL, python_env, rows, train


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    common = ["--steps", "6", "--save-every", "2", "--keep", "5", "--lr", "1e-2"]
    env = python_env()
    env["MEGATRAIN_SAVE_SLEEP"] = "4:120"      # sleep inside the step-4 save, before the rename
    proc = subprocess.Popen([sys.executable, "-m", "megatrain", "train", *SMALL, *common,
                             "--out", str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    root = out / "checkpoints"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            tmp = [d for d in root.glob(".tmp-step_00000004-*") if (d / "state.json").exists()] \
                if root.is_dir() else []
            if tmp:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        else:
            raise AssertionError("the save of step 4 never started")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    # the step-2 checkpoint is complete and loads; the half-written step 4 is not listed
    assert [s for s, _ in checkpoint.list_checkpoints(out)] == [2]
    model = Llama(PRESETS["tiny"])
    state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(out), model)
    assert state["step"] == 2 and state["data"]["index"] == 2 * 4
    # resuming continues from step 2, removes the stray temp folder, and matches a clean run
    assert train(*common, "--out", str(out), "--resume") == 0
    assert not list(root.glob(".tmp-*"))
    assert train(*common, "--out", str(tmp_path / "clean")) == 0
    assert [r["loss"] for r in rows(out)] == [r["loss"] for r in rows(tmp_path / "clean")]
    assert [s for s, _ in checkpoint.list_checkpoints(out)] == [2, 4, 6]
