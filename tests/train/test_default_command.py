"""The real default command: `megatrain train` with no arguments, in a fresh folder.

It trains `tiny` on the shipped corpus on the CPU (about 40 s on 2 cores in eager mode).
Until the megatrain backend is importable the default (`--compile megatrain`) is refused
with exit 2 and a pointer to `--compile eager`, and the test then runs that instead.
"""

import time

from megatrain.train import checkpoint

from _train_helpers import rows, run_module


def test_default_command(tmp_path):
    t0 = time.monotonic()
    p = run_module("train", cwd=tmp_path, timeout=600)
    if p.returncode == 2 and "--compile eager" in p.stderr:
        assert "backend is not available" in p.stderr
        p = run_module("train", "--compile", "eager", cwd=tmp_path, timeout=600)
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "runs" / "tiny"
    r = rows(out)
    assert len(r) == 200
    first, last = r[0]["loss"], sum(x["loss"] for x in r[-10:]) / 10
    assert first > 5.0 and last < 2.7, (first, last)
    assert (out / "metrics.png").is_file()
    assert checkpoint.latest_checkpoint(out).name == "step_00000200"
    assert "memory plan" in p.stderr and "done: step 200" in p.stderr
    print(f"default command: {wall:.0f} s, loss {first:.2f} -> {last:.2f}")
