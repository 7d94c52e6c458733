"""End-to-end `megatrain train` on the CPU: loss, metrics, plot, checkpoints, resume."""

import json
import re
import shutil

import pytest
import torch
from _train_helpers import SMALL, rows, run_module, run_modules, train
from safetensors.torch import load_file

from megatrain.cli import main
from megatrain.train import checkpoint, loop


def test_loss_falls_metrics_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    assert train("--steps", "40", "--seq", "64", "--batch-tokens", "512", "--out", str(out)) == 0
    r = rows(out)
    assert [x["step"] for x in r] == list(range(1, 41))
    for x in r:
        assert {"step", "loss", "lr", "tokens_per_s", "tflops"} <= set(x)
        assert x["tokens_per_s"] > 0
    first, last = r[0]["loss"], sum(x["loss"] for x in r[-5:]) / 5
    assert first > 5.0 and last < first - 1.5, (first, last)   # ln(256) = 5.55 at init
    assert r[0]["lr"] < r[5]["lr"] and r[-1]["lr"] < r[10]["lr"]      # warmup, then cosine
    png = out / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    err = capsys.readouterr().err
    assert "memory plan" in err and "host RAM available now" in err
    # eager has no planner: no step prediction at all (the backend's is the only one)
    assert "predicted step" not in err and re.search(r"done: .* step [0-9.]+ m?s; checkpoint", err)
    # `megatrain plot DIR -o FILE`
    other = tmp_path / "again.png"
    assert main(["plot", str(out), "-o", str(other)]) == 0
    assert other.stat().st_size > 10_000
    assert main(["plot", str(tmp_path / "nothing")]) == 2


def _weights(ckpt):
    return load_file(str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("accum", [1, 2])
def test_resume_is_bit_exact(tmp_path, accum):
    common = ["--steps", "8", "--save-every", "4", "--grad-accum", str(accum), "--lr", "1e-2"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(*common, "--out", str(a)) == 0
    assert train(*common, "--out", str(b), "--stop-after", "3") == 0
    assert [x["step"] for x in rows(b)] == [1, 2, 3]
    assert [s for s, _ in checkpoint.list_checkpoints(b)] == [3]
    assert train(*common, "--out", str(b), "--resume") == 0
    ra, rb = rows(a), rows(b)
    assert [x["step"] for x in rb] == list(range(1, 9))
    assert [x["loss"] for x in ra] == [x["loss"] for x in rb]          # bit for bit
    wa = _weights(checkpoint.latest_checkpoint(a))
    wb = _weights(checkpoint.latest_checkpoint(b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_checkpoint_contents(tmp_path):
    out = tmp_path / "run"
    assert train("--steps", "3", "--out", str(out)) == 0
    ckpt = checkpoint.latest_checkpoint(out)
    assert ckpt.name == "step_00000003"
    names = {p.name for p in ckpt.iterdir()}
    assert {"model.safetensors", "config.json", "optimizer.pt", "rng.pt", "state.json"} <= names
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 3 and state["data"]["index"] == 3 * 4
    assert state["config"]["seq"] == 32 and "resume" not in state["config"]
    rng = torch.load(ckpt / "rng.pt", weights_only=True)
    assert {"torch", "python", "numpy", "cuda"} <= set(rng)
    assert "model.layers.0.self_attn.q_proj.weight" in _weights(ckpt)
    # the disk check's estimate is what a checkpoint takes (fp32 weights + AdamW's moments)
    n_params = sum(t.numel() for t in _weights(ckpt).values())
    held = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    estimate = checkpoint.checkpoint_bytes(n_params, 4)
    assert held <= estimate and 0.97 < (estimate - checkpoint.SLACK_BYTES) / held <= 1.0
    # an existing run is not overwritten by accident
    assert train("--steps", "3", "--out", str(out)) == 2
    assert train("--steps", "3", "--out", str(out), "--overwrite") == 0


def test_no_save_and_the_disk_check(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert train("--steps", "2", "--out", str(out), "--no-save") == 0
    assert len(rows(out)) == 2 and not checkpoint.list_checkpoints(out)
    # a disk that cannot hold the run's checkpoints is refused before any work
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(
        1 << 40, (1 << 40) - (1 << 20), 1 << 20))    # 1 MiB free
    fresh = tmp_path / "fresh"
    assert train("--steps", "4", "--save-every", "1", "--keep", "2", "--out", str(fresh)) == 2
    err = capsys.readouterr().err
    assert f"--out {fresh}" in err and "holds up to 3 at once" in err and "--no-save" in err
    assert "0.0 GB free" in err and not fresh.exists()
    assert train("--steps", "2", "--out", str(fresh), "--no-save") == 0   # nothing to write


def test_compile_path_passes_options(tmp_path, monkeypatch):
    """`--compile megatrain` goes through torch.compile(backend, options=...): a stand-in
    backend records the options and runs the graph as is; losses match eager."""
    seen = []

    def fake_backend(gm, example_inputs, options=None):
        seen.append(options)
        return gm.forward

    monkeypatch.setattr(loop, "resolve_backend", lambda: fake_backend)
    args = ["--steps", "3", "--gpu-memory", "1GiB"]
    assert train(*args, "--out", str(tmp_path / "e")) == 0
    assert main(["train", "--compile", "megatrain", "--device", "cpu", "--precision", "fp32",
                 "--seq", "32", "--batch-tokens", "128", "--no-progress", *args,
                 "--out", str(tmp_path / "m")]) == 0
    assert seen and seen[0] == {"device": "cpu", "precision": "fp32", "gpu_memory": "1GiB",
                                "outputs": "loss"}   # the loop reads only the loss
    le = [x["loss"] for x in rows(tmp_path / "e")]
    lm = [x["loss"] for x in rows(tmp_path / "m")]
    assert lm == pytest.approx(le, rel=1e-5)


def test_resume_is_bit_exact_with_the_megatrain_backend(tmp_path):
    """The same contract through torch.compile(backend="megatrain") on the CPU in fp32,
    each run in its own process as a user would run it."""
    try:
        loop.resolve_backend()
    except loop.RefusedError:
        pytest.skip("the megatrain backend is not importable")
    common = ["train", *SMALL, "--compile", "megatrain", "--steps", "4", "--save-every", "2",
              "--lr", "1e-2"]
    a, b = tmp_path / "a", tmp_path / "b"
    # The full run and the interrupted one are independent: run them side by side, since
    # each spends most of its time in Inductor's compile, which keeps only one core busy.
    for p in run_modules([*common, "--out", str(a)],
                         [*common, "--out", str(b), "--stop-after", "2"], timeout=300):
        assert p.returncode == 0, p.stderr[-3000:]
    p = run_module(*common, "--out", str(b), "--resume", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    # the backend's plan, once; on the CPU device without a step prediction (plan_summary)
    assert re.search(r"plan: planned peak device [0-9.]+ [KMG]iB; compile .*lowering [0-9.]+ s",
                     p.stderr)
    assert "predicted step" not in p.stderr and re.search(r"done: .* step [0-9.]+ m?s; checkpoint", p.stderr)
    # one device figure: the plan's; the CPU device's bytes are host RSS in the rows
    assert "estimated" not in p.stderr
    assert all(r["device_peak_bytes"] is None and r["device_alloc_retries"] is None for r in rows(b))
    assert [x["loss"] for x in rows(a)] == [x["loss"] for x in rows(b)]
    wa = _weights(checkpoint.latest_checkpoint(a))
    wb = _weights(checkpoint.latest_checkpoint(b))
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_resident_updates_train_and_checkpoint_like_host_updates(tmp_path):
    """Resident AdamW state forced (megatrain.config.updates) under the CLI's defaults
    (clipping at 1.0, so gradients wait on the device for step()): on the CPU the same bits
    as every update on the host, in the losses and in the checkpoints (whose save brings the
    device state home)."""
    import megatrain.config

    try:
        loop.resolve_backend()
    except loop.RefusedError:
        pytest.skip("the megatrain backend is not importable")
    import torch._dynamo

    runs = {}
    for updates in ("resident", "host"):
        torch._dynamo.reset()
        out = tmp_path / updates
        with megatrain.config.patch(updates=updates):
            assert main(["train", *SMALL, "--compile", "megatrain", "--steps", "4", "--save-every", "2",
                         "--lr", "1e-2", "--out", str(out)]) == 0
        runs[updates] = out
    assert [x["loss"] for x in rows(runs["resident"])] == [x["loss"] for x in rows(runs["host"])]
    wr = _weights(checkpoint.latest_checkpoint(runs["resident"]))
    wh = _weights(checkpoint.latest_checkpoint(runs["host"]))
    assert wr.keys() == wh.keys() and all(torch.equal(wr[k], wh[k]) for k in wr)
