"""The real default command: `megatrain train` with no arguments, in a fresh folder.

It trains `tiny` on the shipped corpus on the CPU through the megatrain backend (about
70 s on 2 cores, Inductor compile included); the loss must fall.
"""

from megatrain.train import checkpoint

from _train_helpers import rows, run_module


def test_default_command(tmp_path):
    p = run_module("train", cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[megatrain, fp32, megatrain AdamW]" in p.stderr
    out = tmp_path / "runs" / "tiny"
    r = rows(out)
    assert len(r) == 200
    first, last = r[0]["loss"], sum(x["loss"] for x in r[-10:]) / 10
    assert first > 5.0 and last < 2.7, (first, last)
    assert (out / "metrics.png").is_file()
    assert checkpoint.latest_checkpoint(out).name == "step_00000200"
    assert "memory plan" in p.stderr and "done: step 200" in p.stderr
    print(f"default command: loss {first:.2f} -> {last:.2f}")
