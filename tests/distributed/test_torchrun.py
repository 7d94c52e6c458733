"""torchrun --nproc-per-node 2 runs a user's training script and `megatrain train`, and both
train exactly as one process on the same global batch (CPU, gloo)."""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "data_parallel.py"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MEGATRAIN_DIST_TIMEOUT"] = "30"
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _start(args: list[str], cwd: Path, torchrun: bool) -> subprocess.Popen:
    cmd = [sys.executable, *args]
    if torchrun:  # --standalone: a local rendezvous on a port torchrun picks itself
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:  # torchrun and its ranks share the session started for it
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def _rel(a: dict, b: dict) -> float:
    num = sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5
    return float(num / sum((b[k] ** 2).sum() for k in b) ** 0.5)


def test_torchrun_runs_a_training_script(tmp_path, monkeypatch):
    common = [str(EXAMPLE), "--device", "cpu", "--precision", "fp32", "--lowering", "eager",
              "--steps", "3", "--batch", "4"]
    proc = _start([*common, "--out", str(tmp_path / "dp.pt")], tmp_path, torchrun=True)
    try:  # meanwhile the same script as one process, here (no torchrun environment)
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setattr(sys, "argv", [*common, "--out", str(tmp_path / "one.pt")])
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    finally:
        dp_out, = _finish([proc], timeout=150)
    dp, one = (torch.load(tmp_path / f, weights_only=False) for f in ("dp.pt", "one.pt"))
    assert dp["world_size"] == 2 and one["world_size"] == 1
    assert dp["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert _rel(dp["params"], one["params"]) <= 1e-5
    assert dp_out.count("step 3: loss") == 1, "only rank 0 prints"


@pytest.mark.slow
def test_torchrun_megatrain_train_equals_one_process_and_resumes(tmp_path):
    from safetensors.torch import load_file

    args = ["-m", "megatrain", "train", "--device", "cpu", "--precision", "fp32", "--seq", "32",
            "--batch-tokens", "128", "--no-progress", "--steps", "4", "--save-every", "2",
            "--lr", "1e-2"]
    procs = [_start([*args, "--out", str(tmp_path / "dp")], tmp_path, torchrun=True),
             _start([*args, "--out", str(tmp_path / "one")], tmp_path, torchrun=False)]
    dp_out, _ = _finish(procs, timeout=300)
    assert dp_out.count("training tiny") == 1 and "on 2 ranks" in dp_out

    def rows(d):
        return [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]

    assert [r["loss"] for r in rows("dp")] == pytest.approx([r["loss"] for r in rows("one")],
                                                            rel=1e-5)
    ckpt = "checkpoints/step_00000004"
    wa, wb = (load_file(str(tmp_path / d / ckpt / "model.safetensors")) for d in ("dp", "one"))
    assert _rel(wa, wb) <= 1e-5
    # the rank-0 checkpoint holds the whole optimizer state, in the parameters' shapes
    oa, ob = (torch.load(tmp_path / d / ckpt / "optimizer.pt") for d in ("dp", "one"))
    for i, st in ob["state"].items():
        assert oa["state"][i]["exp_avg"].shape == st["exp_avg"].shape
    # stop after 2 steps, resume on 2 ranks: the same losses bit for bit
    _finish([_start([*args, "--out", str(tmp_path / "r"), "--stop-after", "2"], tmp_path, True)], 300)
    _finish([_start([*args, "--out", str(tmp_path / "r"), "--resume"], tmp_path, True)], 300)
    assert [r["loss"] for r in rows("r")] == [r["loss"] for r in rows("dp")]
