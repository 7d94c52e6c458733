"""Atomic checkpoints: `OUT/checkpoints/step_00000100/` holds

    model.safetensors (or shards + index)  fp32 weights under Hugging Face Llama names
    config.json                            Hugging Face LlamaForCausalLM config
    tokenizer files                        when a Hugging Face tokenizer was used
    optimizer.pt                           optimizer.state_dict()
    rng.pt                                 torch CPU (+ CUDA) generator, python random, numpy
    state.json                             step, data position, tokens seen, run config

Everything is written into `checkpoints/.tmp-step_...` and fsynced, then the folder is
renamed into place: a visible `step_*` folder is always complete, and a process killed
mid-save leaves the previous one untouched (the stray temp folder is removed next run).
Set MEGATRAIN_SAVE_SLEEP=STEP:SECONDS (or SECONDS for every save) to sleep between the
writes and the rename: the kill-during-save test uses it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from . import hf

SUBDIR = "checkpoints"
PREFIX = "step_"


def checkpoints_root(out: str | Path) -> Path:
    return Path(out) / SUBDIR


def list_checkpoints(out: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_root(out)
    found = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith(PREFIX) and (d / "state.json").is_file():
                try:
                    found.append((int(d.name[len(PREFIX):]), d))
                except ValueError:
                    continue
    return sorted(found)


def latest_checkpoint(out: str | Path) -> Path | None:
    ckpts = list_checkpoints(out)
    return ckpts[-1][1] if ckpts else None


def remove_partial(out: str | Path) -> None:
    """Remove temp folders left by a save that was killed before its rename."""
    root = checkpoints_root(out)
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith(".tmp-"):
                shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------------- RNG

def capture_rng() -> dict:
    ver, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [ver, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "cuda": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    ver, internal, gauss = state["python"]
    random.setstate((ver, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------- save

def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _test_hook(step: int) -> None:
    spec = os.environ.get("MEGATRAIN_SAVE_SLEEP")
    if not spec:
        return
    at, _, secs = spec.rpartition(":")
    if not at or int(at) == step:
        time.sleep(float(secs))


def save_checkpoint(out: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, state: dict, hf_config: dict,
                    extra_files: list[Path] = (), keep: int = 2) -> Path:
    """Write the checkpoint for `step` atomically; keep the newest `keep`; return its folder."""
    root = checkpoints_root(out)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    if final.is_dir() and (final / "state.json").is_file():
        return final          # this exact step is already saved (e.g. re-saved after resume)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # Both state_dicts read current values (megatrain.AdamW's queued and resident updates
    # included, optim/module_reads.py): no synchronize(), which would send resident state home.
    hf.save_weights(model, tmp)
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    for f in extra_files:
        shutil.copy2(f, tmp / Path(f).name)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(capture_rng(), tmp / "rng.pt")
    # state.json last: its presence marks a complete folder even to a reader that ignores
    # the rename protocol.
    (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2))
    _fsync_tree(tmp)
    _test_hook(step)
    os.rename(tmp, final)
    _fsync_dir(root)
    for _, old in list_checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------- load

def read_state(path: Path) -> dict:
    return json.loads((Path(path) / "state.json").read_text())


def load_checkpoint(path: Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, rng: bool = True) -> dict:
    """Load weights (and optimizer state, RNG) from a checkpoint folder; return state.json."""
    path = Path(path)
    hf.load_weights(model, hf.weight_files(path))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu",
                                             weights_only=True))
    if rng:
        restore_rng(torch.load(path / "rng.pt", map_location="cpu", weights_only=True))
    return read_state(path)
