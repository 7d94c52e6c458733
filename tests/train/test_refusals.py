"""Refusals: exit status 2 before any work, with a message naming the value and the fix."""

import pytest
import torch

from megatrain.memory import host_store
from megatrain.train import plan

from _train_helpers import python_env, run_module, train


def _refused(capsys, *args) -> str:
    assert train(*args) == 2
    return capsys.readouterr().err


def test_refuses_when_host_ram_is_short(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(host_store, "available_host_bytes", lambda: 100 << 20)   # 100 MiB free
    out = tmp_path / "run"
    err = _refused(capsys, "--steps", "2", "--seq", "256", "--batch-tokens", "4096",
                   "--out", str(out))
    assert "refused: host RAM" in err and "100.0 MiB" in err and "bytes" in err
    assert "DOES NOT FIT" in err                       # the plan table was printed first
    assert not out.exists()                            # nothing was written


def test_refuses_8b_on_a_small_host(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(host_store, "available_host_bytes", lambda: 24 << 30)
    err = _refused(capsys, "--model", "8b", "--seq", "256", "--batch-tokens", "4096",
                   "--out", str(tmp_path / "x"))
    # 8.03 B params x 16 B (master, m, v, p.grad in eager) > 24 GiB
    assert "refused: host RAM" in err and "24.0 GiB" in err
    assert "fp32 weights" in err or "fp32 master" in err


def test_subprocess_exit_code_is_2(tmp_path):
    p = run_module("train", "--compile", "eager", "--steps", "0", "--out", str(tmp_path / "r"),
                   cwd=tmp_path, env=python_env(), timeout=120)
    assert p.returncode == 2 and "--steps 0" in p.stderr, p.stderr


BAD = [
    (["--batch-tokens", "100"], "--batch-tokens 100"),
    (["--grad-accum", "3"], "multiple of --seq x --grad-accum"),
    (["--steps", "-1"], "--steps -1"),
    (["--lr", "-1"], "--lr -1"),
    (["--lr", "nan"], "--lr nan"),
    (["--clip", "-1"], "--clip -1"),
    (["--warmup", "99"], "--warmup 99"),
    (["--save-every", "-1"], "--save-every -1"),
    (["--seq", "1024", "--batch-tokens", "1024"], "max_seq 512"),
    (["--model", "13b"], "--model 13b"),
    (["--data", "/no/such/file.txt"], "--data /no/such/file.txt"),
    (["--tokenizer", "/no/such/tok"], "--tokenizer /no/such/tok"),
    (["--device", "tpu"], "--device tpu"),
    (["--gpu-memory", "lots"], "--gpu-memory 'lots'"),
    (["--resume"], "--resume: no complete checkpoint"),
    (["--resume", "--overwrite"], "--resume and --overwrite conflict"),
    (["--updates", "resident"], "--updates is not a flag any more: megatrain decides"),
]
if not torch.cuda.is_available():
    BAD.append((["--device", "cuda"], "no CUDA GPU"))


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments(tmp_path, capsys, args, needle):
    out = tmp_path / "run"
    err = _refused(capsys, "--steps", "2", "--out", str(out), *args)
    assert needle in err, err
    assert not (out / "metrics.jsonl").exists()


def test_missing_backend_is_refused(tmp_path, monkeypatch, capsys):
    from megatrain.train import loop

    def missing():
        raise loop.RefusedError("--compile megatrain: the megatrain torch.compile backend is not "
                                "available (ImportError: x); use --compile eager")
    monkeypatch.setattr(loop, "resolve_backend", missing)
    err = _refused(capsys, "--steps", "2", "--compile", "megatrain", "--out", str(tmp_path / "r"))
    assert "--compile eager" in err


def test_tokenizers_package_missing_is_explained(tmp_path, capsys):
    import importlib.util
    if importlib.util.find_spec("tokenizers") is not None:
        pytest.skip("runs only where the tokenizers package is missing")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    err = _refused(capsys, "--steps", "2", "--tokenizer", str(tok), "--out", str(tmp_path / "r"))
    assert "tokenizers" in err and "--tokenizer bytes" in err


def test_data_and_out_refusals_name_the_path_before_any_work(tmp_path, capsys):
    """An empty data file, a corpus too short for one sequence, and --out naming a file:
    each refused with exit 2, naming the path and the fix, and nothing left behind."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("a few words")
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    for args, needle in ((["--data", str(empty)], f"--data {empty}: the file is empty"),
                         (["--data", str(short)], f"--data {short}: 11 tokens, too few"),
                         (["--out", str(afile)], f"--out {afile}: is a file, not a folder")):
        out = tmp_path / "run"
        err = _refused(capsys, "--steps", "2", "--out", str(out), *args)
        assert needle in err and "Traceback" not in err, err
        assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()
    assert afile.read_text() == "not a folder"


def test_parse_bytes():
    assert plan.parse_bytes("16GiB") == 16 << 30
    assert plan.parse_bytes("80GB") == 80 * 10**9
    assert plan.parse_bytes("1.5 MiB") == 3 << 19
    assert plan.parse_bytes(123) == 123
    with pytest.raises(ValueError, match="16GiB"):
        plan.parse_bytes("16 apples")


def test_gpu_budget_the_backend_refuses_exits_2_before_training(tmp_path, capsys):
    out = tmp_path / "run"
    assert train("--compile", "megatrain", "--device", "cpu", "--precision", "fp32", "--seq", "32",
                 "--batch-tokens", "128", "--no-progress", "--steps", "2", "--gpu-memory", "100000",
                 "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert "cannot hold even one region" in err and "needs" in err and "Traceback" not in err
    assert "PyTorch" not in err and "TORCHDYNAMO" not in err  # the message is megatrain's whole story
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()
    # nothing left behind blocks the corrected rerun in the same folder
    assert train("--steps", "2", "--out", str(out)) == 0
