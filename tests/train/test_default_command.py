"""The real default command: `megatrain train` in a fresh folder, on the CPU, through the
megatrain backend (Inductor compile included).

The whole default run (200 steps of `tiny` on the shipped corpus, about 70 s on 2 cores
after the compile) is the README's main job; it is marked slow and run before a release
(`python -m pytest -m slow tests/train/test_default_command.py`). The default test run
trains the same defaults for 30 steps, which exercises every default but the step count.
"""

import pytest

from megatrain.train import checkpoint

from _train_helpers import rows, run_module


def _run_defaults(tmp_path, *args):
    p = run_module("train", *args, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[megatrain, fp32, megatrain AdamW]" in p.stderr
    assert "memory plan" in p.stderr
    out = tmp_path / "runs" / "tiny"
    assert (out / "metrics.png").is_file()
    return p, out, rows(out)


def test_the_default_command_trains_its_first_steps(tmp_path):
    """Every default but --steps: the backend trains, the loss falls from above 5 by well
    over a nat in 30 steps, and the run ends with its checkpoint and plot."""
    p, out, r = _run_defaults(tmp_path, "--steps", "30")
    assert len(r) == 30
    first, last = r[0]["loss"], sum(x["loss"] for x in r[-5:]) / 5
    assert first > 5.0 and last < first - 1.5, (first, last)
    assert checkpoint.latest_checkpoint(out).name == "step_00000030"
    assert "done: step 30" in p.stderr


@pytest.mark.slow
def test_default_command(tmp_path):
    """`megatrain train` with no arguments: 200 steps, the loss below 2.7."""
    p, out, r = _run_defaults(tmp_path)
    assert len(r) == 200
    first, last = r[0]["loss"], sum(x["loss"] for x in r[-10:]) / 10
    assert first > 5.0 and last < 2.7, (first, last)
    assert checkpoint.latest_checkpoint(out).name == "step_00000200"
    assert "done: step 200" in p.stderr
    print(f"default command: loss {first:.2f} -> {last:.2f}")
