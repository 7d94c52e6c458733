"""A damaged latest checkpoint does not end a run: `--resume` says which folder is damaged
and why, resumes from the newest intact one, deletes nothing, and trains on bit for bit as
if nothing had happened. With no intact checkpoint left it refuses, naming each folder."""

import hashlib
import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatrain.train import checkpoint

from _train_helpers import rows, train

COMMON = ["--steps", "6", "--save-every", "2", "--lr", "1e-2"]   # keeps step 4 and step 6
DROPPED = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """One uninterrupted run, copied by every test that damages it."""
    out = tmp_path_factory.mktemp("corruption") / "base"
    assert train(*COMMON, "--out", str(out)) == 0
    assert [s for s, _ in checkpoint.list_checkpoints(out)] == [4, 6]
    return out


def _copy(baseline: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    out = tmp_path / "run"
    shutil.copytree(baseline, out)
    root = checkpoint.checkpoints_root(out)
    return out, root / "step_00000004", root / "step_00000006"


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])


def _flip_byte(f: Path) -> None:
    """One byte of the last tensor's data: the size and the header stay as they were."""
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF
    f.write_bytes(bytes(data))


def _drop_tensor(ckpt: Path) -> None:
    """Rewrite the weights without one tensor and make the manifest agree, so that only the
    check against the model's tensor names can tell."""
    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    del tensors[DROPPED]
    save_file(tensors, str(f), metadata={"format": "pt"})
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    manifest["files"][f.name] = {"bytes": f.stat().st_size,
                                 "crc32": [f"{zlib.crc32(f.read_bytes()):08x}"]}
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))


# kind -> (damage the checkpoint folder, words the reason must hold)
DAMAGE = {
    "truncated-weights": (lambda d: _truncate(d / "model.safetensors"),
                          "model.safetensors has 1,585,412 bytes where the manifest lists 3,170,824"),
    "truncated-optimizer": (lambda d: _truncate(d / "optimizer.pt"), "optimizer.pt has"),
    "broken-state": (lambda d: _truncate(d / "state.json"), "state.json is not valid JSON"),
    "empty-rng": (lambda d: (d / "rng.pt").write_bytes(b""), "rng.pt has 0 bytes"),
    "flipped-byte": (lambda d: _flip_byte(d / "model.safetensors"),
                     "model.safetensors does not match its checksum"),
    "missing-tensor": (_drop_tensor, f"model.safetensors lacks tensor {DROPPED}"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_resume_skips_a_damaged_checkpoint_and_deletes_nothing(baseline, tmp_path, capsys,
                                                               monkeypatch, kind):
    out, older, damaged = _copy(baseline, tmp_path)
    damage, reason = DAMAGE[kind]
    damage(damaged)
    if kind == "truncated-weights":  # the exact sizes above are those of the tiny preset
        assert (older / "model.safetensors").stat().st_size == 3_170_824
    root = checkpoint.checkpoints_root(out)
    before, damaged_files = _files(root), _files(damaged)
    at_first_save = []
    real_save = checkpoint.save_checkpoint

    def save(*args, **kwargs):
        at_first_save.append(at_first_save[0] if at_first_save else _files(root))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", save)
    capsys.readouterr()
    assert train(*COMMON, "--out", str(out), "--resume") == 0
    err = capsys.readouterr().err
    assert f"checkpoint {damaged} is damaged (" in err and reason in err, err
    assert f"); resuming from {older}\n" in err, err
    assert f"resumed from {older} at step 4" in err and "steps 5..6 of 6" in err, err
    assert at_first_save[0] == before                   # nothing deleted before the new save
    ra, rb = rows(baseline), rows(out)
    assert [r["step"] for r in rb] == list(range(1, 7))
    assert [r["loss"] for r in rb] == [r["loss"] for r in ra]           # bit for bit
    # step 6 saved anew and intact; the damaged one set aside untouched, with a word on it
    aside = root / "step_00000006.damaged"
    assert f"kept it as {aside}" in err, err
    assert _files(aside) == damaged_files
    assert checkpoint.verify_checkpoint(damaged) is None
    assert checkpoint.latest_intact_checkpoint(out) == (damaged, [])
    assert [s for s, _ in checkpoint.list_checkpoints(out)] == [4, 6]
    wa, wb = (load_file(str(r / "checkpoints/step_00000006/model.safetensors"))
              for r in (baseline, out))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_every_checkpoint_damaged_is_refused_naming_each(baseline, tmp_path, capsys):
    out, older, newer = _copy(baseline, tmp_path)
    _truncate(newer / "optimizer.pt")
    (older / "state.json").write_text("{")
    before = _files(out)
    capsys.readouterr()
    assert train(*COMMON, "--out", str(out), "--resume") == 2
    err = capsys.readouterr().err
    assert "refused: --resume: every checkpoint is damaged" in err, err
    assert f"{newer} (optimizer.pt has" in err and f"{older} (state.json is not valid JSON" in err
    assert "Traceback" not in err and "nothing was deleted" in err
    assert _files(out) == before


def test_a_run_refused_without_resume_names_the_checkpoint_resume_uses(baseline, tmp_path,
                                                                       capsys):
    out, older, newer = _copy(baseline, tmp_path)
    _truncate(newer / "model.safetensors")
    capsys.readouterr()
    assert train(*COMMON, "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert (f"already holds a run (--resume continues from step 5 ({older}); {newer} is "
            f"damaged (model.safetensors has") in err, err


def test_checkpoints_without_a_manifest_are_checked_as_far_as_they_can_be(baseline, tmp_path,
                                                                           capsys):
    """Saved before manifests existed: accepted when intact, and a damaged one is skipped."""
    out, older, newer = _copy(baseline, tmp_path)
    for d in (older, newer):
        (d / checkpoint.MANIFEST).unlink()
    assert checkpoint.verify_checkpoint(older) is None
    assert checkpoint.verify_checkpoint(newer) is None
    (newer / "rng.pt").write_bytes(b"")
    assert checkpoint.verify_checkpoint(newer) == "rng.pt is empty"
    (newer / "rng.pt").write_bytes((older / "rng.pt").read_bytes())
    _truncate(newer / "model.safetensors")
    assert "model.safetensors has an unreadable header" in checkpoint.verify_checkpoint(newer)
    shutil.copy2(older / "model.safetensors", newer / "model.safetensors")
    _truncate(newer / "optimizer.pt")
    assert checkpoint.verify_checkpoint(newer).startswith("optimizer.pt cannot be loaded")
    capsys.readouterr()
    assert train(*COMMON, "--out", str(out), "--resume") == 0
    err = capsys.readouterr().err
    assert f"checkpoint {newer} is damaged (optimizer.pt cannot be loaded" in err, err
    assert f"resumed from {older} at step 4" in err, err
    assert [r["loss"] for r in rows(out)] == [r["loss"] for r in rows(baseline)]
    assert (newer / checkpoint.MANIFEST).is_file() and checkpoint.verify_checkpoint(newer) is None
