"""Atomic, verifiable checkpoints: `OUT/checkpoints/step_00000100/` holds

    model.safetensors (or shards + index)  the weights, a Hugging Face model folder:
    config.json                              transformers models: written by transformers
                                             (fp32, or bf16 with --save-dtype bf16);
                                             megatrain's Llama: fp32 under HF Llama names
    master.safetensors                     bf16 shards only: the exact fp32 weights (resume)
    tokenizer files                        when a Hugging Face tokenizer was used
    optimizer.pt                           optimizer.state_dict()
    rng.pt                                 torch CPU (+ CUDA) generator, python random, numpy
    manifest.json                          every other file's size and CRC-32 per 16 MiB
    state.json                             step, data position, tokens seen, run config,
                                           `weights`: which code reads the weights back
                                           (absent in older checkpoints: megatrain's Llama)

Everything is written into `checkpoints/.tmp-step_...` and fsynced, then the folder is
renamed into place: a visible `step_*` folder is always complete, and a process killed
mid-save leaves the previous one untouched (the stray temp folder is removed next run).
Set MEGATRAIN_SAVE_SLEEP=STEP:SECONDS (or SECONDS for every save) to sleep between the
writes and the rename: the kill-during-save test uses it.

A complete folder can still go bad later (a full disk, a copy cut short, bit rot), so
`--resume` checks it first (`verify_checkpoint`) and falls back to the newest intact one
(`latest_intact_checkpoint`). Nothing is deleted on the way: a damaged folder whose step is
saved again is set aside as `step_....damaged`, and pruning only removes checkpoints at or
below the step just saved, which is intact by construction.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from megatrain.models import Llama

from . import RefusedError, hf, hf_models, master_weights

SUBDIR = "checkpoints"
PREFIX = "step_"
MANIFEST = "manifest.json"
CHUNK = 16 << 20


def checkpoints_root(out: str | Path) -> Path:
    return Path(out) / SUBDIR


def _step_folders(out: str | Path) -> list[tuple[int, Path]]:
    """Every visible `step_N` folder, complete or not, oldest first."""
    root = checkpoints_root(out)
    found = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith(PREFIX):
                try:
                    found.append((int(d.name[len(PREFIX):]), d))
                except ValueError:
                    continue
    return sorted(found)


def list_checkpoints(out: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (state.json present), oldest first; not verified."""
    return [(s, d) for s, d in _step_folders(out) if (d / "state.json").is_file()]


def latest_checkpoint(out: str | Path) -> Path | None:
    ckpts = list_checkpoints(out)
    return ckpts[-1][1] if ckpts else None


def latest_intact_checkpoint(out: str | Path, checksums: bool = True
                             ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint `verify_checkpoint` passes, and the (folder, reason) of every
    newer one it skipped, newest first. Reads and changes nothing else."""
    skipped = []
    for _, d in reversed(_step_folders(out)):
        reason = verify_checkpoint(d, checksums=checksums)
        if reason is None:
            return d, skipped
        skipped.append((d, reason))
    return None, skipped


def resume_note(out: str | Path) -> str:
    """Where --resume would continue, in words, by the quick checks: no checksums, which
    would read the whole checkpoint (tens of GB) only to word a message."""
    ckpt, damaged = latest_intact_checkpoint(out, checksums=False)
    note = "".join(f"; {d} is damaged ({why})" for d, why in damaged)
    if ckpt is None:
        return ("no checkpoint is intact" if damaged else "no checkpoint was complete") + \
            note + ": nothing to resume"
    return f"--resume continues from step {read_state(ckpt)['step'] + 1} ({ckpt}){note}"


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


# ----------------------------------------------------------------------------- checksums

def _chunk_crcs(files: list[Path]) -> dict[str, list[str]]:
    """CRC-32 of each 16 MiB chunk of each file, as 8 hex digits, keyed by file name.

    Why CRC-32: it guards against accidents (a truncated copy, a torn write, a flipped bit),
    not against tampering, and a checkpoint of an 8B run is ~100 GB that is hashed at every
    save and read again at every resume. zlib.crc32 runs at about 4 GB/s per core (SHA-256
    about 1.6, BLAKE2b under 1) and releases the GIL on large buffers, so the chunks are
    hashed on a thread pool and the disk, not the hash, sets the pace; a value per chunk
    also says where in a file the damage is.
    """
    jobs = [(f, off) for f in files for off in range(0, max(1, f.stat().st_size), CHUNK)]
    fds: dict[Path, int] = {}

    def crc(job):
        f, off = job
        return f"{zlib.crc32(os.pread(fds[f], CHUNK, off)) & 0xFFFFFFFF:08x}"

    try:
        for f in files:
            fds[f] = os.open(f, os.O_RDONLY)
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            values = list(pool.map(crc, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)
    out: dict[str, list[str]] = {f.name: [] for f in files}
    for (f, _), v in zip(jobs, values):
        out[f.name].append(v)
    return out


def _write_manifest(folder: Path, state_bytes: bytes) -> None:
    """manifest.json for every file in `folder` plus the state.json still to be written."""
    files = sorted(f for f in folder.iterdir() if f.is_file())
    crcs = _chunk_crcs(files)
    entries = {f.name: {"bytes": f.stat().st_size, "crc32": crcs[f.name]} for f in files}
    entries["state.json"] = {"bytes": len(state_bytes), "crc32": [
        f"{zlib.crc32(state_bytes[i:i + CHUNK]) & 0xFFFFFFFF:08x}"
        for i in range(0, max(1, len(state_bytes)), CHUNK)]}
    manifest = {"format": "megatrain checkpoint manifest", "version": 1,
                "checksum": "crc32", "chunk_bytes": CHUNK, "files": entries}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


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


def _set_aside(folder: Path) -> Path:
    """Rename a damaged folder out of the way (kept for inspection, never listed again)."""
    aside, n = folder.with_name(folder.name + ".damaged"), 1
    while aside.exists():
        n += 1
        aside = folder.with_name(f"{folder.name}.damaged{n}")
    os.rename(folder, aside)
    return aside


def save_checkpoint(out: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, state: dict, hf_config: dict | None,
                    extra_files: list[Path] = (), keep: int = 2, say=None,
                    write_model=None) -> Path:
    """Write the checkpoint for `step` atomically; keep the newest `keep` at or below it;
    return its folder. `say(msg)` hears of a damaged folder set aside for this step.

    `write_model(folder)` writes the weights, config and tokenizer (the model source's
    format); without it, megatrain's Llama is written: HF-named fp32 weights, `hf_config`
    as config.json and `extra_files` copied beside them."""
    root = checkpoints_root(out)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    if final.is_dir():
        reason = verify_checkpoint(final)
        if reason is None:
            return final      # this exact step is already saved and intact
        aside = _set_aside(final)
        if say is not None:
            say(f"checkpoint {final} is damaged ({reason}); kept it as {aside} (delete it once "
                f"it is no longer needed) and saving step {step} anew")
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # Both state_dicts read current values (megatrain.AdamW's queued and resident updates
    # included, optim/module_reads.py): no synchronize(), which would send resident state home.
    if write_model is not None:
        write_model(tmp)
    else:
        hf.save_weights(model, tmp)
        (tmp / "config.json").write_text(json.dumps(hf_config or {}, indent=2))
        for f in extra_files:
            shutil.copy2(f, tmp / Path(f).name)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(capture_rng(), tmp / "rng.pt")
    state_bytes = json.dumps({**state, "step": step}, indent=2).encode()
    _write_manifest(tmp, state_bytes)
    # state.json last: its presence marks a complete folder even to a reader that ignores
    # the rename protocol.
    (tmp / "state.json").write_bytes(state_bytes)
    _fsync_tree(tmp)
    _test_hook(step)
    os.rename(tmp, final)
    _fsync_dir(root)
    # Only checkpoints up to this step count: newer ones are damaged leftovers a resume
    # skipped, which are not ours to delete (nor may they push out the one just written).
    for _, old in [c for c in list_checkpoints(out) if c[0] <= step][:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------- disk room

OPTIMIZER_BYTES_PER_PARAM = 8     # AdamW's two fp32 moments, megatrain's and torch's alike
SLACK_BYTES = 64 << 20            # config, tokenizer, rng, manifest and pickling overhead


def checkpoint_bytes(n_params: int, weight_bytes_per_param: int) -> int:
    """What one checkpoint folder takes on disk: the weights as saved plus the optimizer's
    moments (`optimizer.pt`), plus a little for the small files."""
    return n_params * (weight_bytes_per_param + OPTIMIZER_BYTES_PER_PARAM) + SLACK_BYTES


def save_steps(start: int, end: int, save_every: int) -> int:
    """How many checkpoints a run from `start` to `end` writes: every `save_every` steps
    and the last (a signal's save replaces a later one, never adds one)."""
    if end <= start:
        return 0
    regular = {s for s in range(start + 1, end + 1) if save_every and s % save_every == 0}
    return len(regular | {end})


def check_disk_room(out: Path, one: int, saves: int, keep: int) -> None:
    """Refuse before any work when the disk holding `out` cannot take what the run will
    write: a new checkpoint is written whole before the oldest beyond `keep` is pruned, so
    at the peak the run's own folders number min(held + saves, keep + 1), `held` being the
    complete ones already in `out` (a resumed run's)."""
    if saves <= 0:
        return
    held = list_checkpoints(out)
    held_bytes = sum(_folder_bytes(f) for _, f in held)
    peak_new = max(0, min(len(held) + saves, keep + 1) * one - held_bytes)
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if peak_new > free:
        copies = min(len(held) + saves, keep + 1)
        raise RefusedError(
            f"--out {out}: a checkpoint of this model takes {one / 1e9:,.1f} GB and this run "
            f"holds up to {copies} at once (--keep {keep}, plus the one being written), "
            f"{peak_new / 1e9:,.1f} GB more than now, but the disk there has "
            f"{free / 1e9:,.1f} GB free; point --out at a disk with room, lower --keep, "
            f"or pass --no-save (no checkpoints: a stopped run keeps nothing)")


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


# -------------------------------------------------------------------------------- verify

def verify_checkpoint(path: str | Path, checksums: bool = True) -> str | None:
    """None if the folder is an intact checkpoint, else why not, in words naming the file.

    Cheap checks first: state.json parses and names this folder's step; every file the
    manifest lists is there with its size; the safetensors headers hold every tensor the
    checkpoint's config.json makes, with its shape. Then, with `checksums`, every chunk's
    CRC-32, which reads the whole checkpoint once. A checkpoint written before manifests
    existed gets what can be checked without one: no empty file, optimizer.pt and rng.pt
    load; refusing it would strand every run saved by an older megatrain.
    """
    path = Path(path)
    try:
        reason = _check_state(path)
        if reason is not None:
            return reason
        manifest, reason = _read_manifest(path)
        if reason is None:
            reason = _check_legacy(path) if manifest is None else _check_sizes(path, manifest)
        if reason is None:
            reason = _check_weights(path)
        if reason is None and manifest is not None and checksums:
            reason = _check_crcs(path, manifest)
        return reason
    except OSError as e:
        return f"unreadable ({type(e).__name__}: {e})"


def _check_state(path: Path) -> str | None:
    f = path / "state.json"
    if not f.is_file():
        return "state.json is missing"
    try:
        state = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"state.json is not valid JSON ({e})"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return "state.json has no step"
    if path.name.startswith(PREFIX) and path.name[len(PREFIX):] != f"{state['step']:08d}":
        return f"state.json says step {state['step']}, not the folder's"
    return None


def _read_manifest(path: Path) -> tuple[dict | None, str | None]:
    """(manifest, None), (None, None) when there is none, or (None, why it is unusable)."""
    mf = path / MANIFEST
    if not mf.exists():
        return None, None
    try:
        manifest = json.loads(mf.read_text())
        for name, entry in manifest["files"].items():
            int(entry["bytes"]), list(entry["crc32"])
            if Path(name).name != name:
                return None, f"{MANIFEST} lists {name!r}, not a file of this folder"
        if int(manifest["chunk_bytes"]) != CHUNK:
            return None, f"{MANIFEST} uses {manifest['chunk_bytes']}-byte chunks, not {CHUNK}"
        return manifest, None
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"


def _check_sizes(path: Path, manifest: dict) -> str | None:
    for name, entry in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != int(entry["bytes"]):
            return (f"{name} has {f.stat().st_size:,} bytes where the manifest lists "
                    f"{int(entry['bytes']):,}: cut short or overwritten")
    return None


def _check_crcs(path: Path, manifest: dict) -> str | None:
    files = manifest["files"]
    found = _chunk_crcs([path / name for name in files])
    for name, entry in files.items():
        want = list(entry["crc32"])
        for i, (got, exp) in enumerate(zip(found[name], want)):
            if got != exp:
                return (f"{name} does not match its checksum in bytes "
                        f"{i * CHUNK:,}..{min((i + 1) * CHUNK, int(entry['bytes'])):,}")
        if len(want) != len(found[name]):
            return f"{name} has {len(found[name])} chunks, the manifest {len(want)} checksums"
    return None


def _check_legacy(path: Path) -> str | None:
    """A checkpoint without a manifest: no empty file, and the pickles load (optimizer.pt
    memory-mapped, so its tensors are not read)."""
    for f in sorted(path.iterdir()):
        if f.is_file() and f.stat().st_size == 0:
            return f"{f.name} is empty"
    for name, mmap in (("optimizer.pt", True), ("rng.pt", False)):
        if not (path / name).is_file():
            return f"{name} is missing"
        try:
            torch.load(path / name, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as e:  # noqa: BLE001 - any load error means a damaged file
            return f"{name} cannot be loaded ({type(e).__name__}: {e})"
    return None


def _check_weights(path: Path) -> str | None:
    """Every tensor the model built from the checkpoint's config.json needs, with its shape,
    in the safetensors headers (read without the tensors)."""
    state = read_state(path)
    if state.get("weights") == "transformers":
        return _check_transformers(path, state.get("save_dtype"))
    return _check_llama(path)


def _check_transformers(path: Path, save_dtype: str | None) -> str | None:
    """A transformers-format checkpoint: transformers' own key mapping over the shard
    headers (hf_models.check_weights), and the fp32 master's header beside bf16 shards.
    Without transformers this is refused (the run cannot resume), not called damage."""
    hf_models.require_transformers()
    try:
        meta = hf_models.build_meta(path).model
        if not hf_models.check_weights(meta, path).files:
            return "model.safetensors is missing"
        if save_dtype == "bf16":
            master_weights.check(meta, path / master_weights.FILENAME)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # RefusedError included
        return str(e) if isinstance(e, RefusedError) else f"{type(e).__name__}: {e}"
    return None


def _check_llama(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        raw = json.loads((path / "config.json").read_text())
        with torch.device("meta"):
            model = Llama(hf.llama_config_from_hf(raw, "config.json"))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"config.json is unusable ({type(e).__name__}: {e})"
    index = path / "model.safetensors.index.json"
    try:
        files = hf.weight_files(path) if index.is_file() else sorted(path.glob("*.safetensors"))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{index.name} is unusable ({type(e).__name__}: {e})"
    if not files:
        return "model.safetensors is missing"
    tied = getattr(model.config, "tie_embeddings", False)
    need = {hf.to_hf_name(n): tuple(t.shape) for n, t in model.state_dict().items()
            if not (tied and n == "lm_head.weight")}
    for f in files:
        if not f.is_file():
            return f"{f.name} is missing"
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - a safe_open handle
                    if name in need:
                        shape = tuple(fh.get_slice(name).get_shape())
                        if shape != need[name]:
                            return (f"{f.name}: tensor {name} has shape {shape}, config.json "
                                    f"makes {need[name]}")
                        need.pop(name)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
            return f"{f.name} has an unreadable header ({type(e).__name__}: {e})"
    if need:
        names = sorted(need)
        where = files[0].name if len(files) == 1 else f"the {len(files)} weight shards"
        return f"{where} lack{'s' if len(files) == 1 else ''} tensor {', '.join(names[:4])}" + (
            f" and {len(names) - 4} more" if len(names) > 4 else "")
    return None


# ---------------------------------------------------------------------------------- load

def read_state(path: Path) -> dict:
    return json.loads((Path(path) / "state.json").read_text())


def load_checkpoint(path: Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, rng: bool = True,
                    weights: bool = True) -> dict:
    """Load weights (and optimizer state, RNG) from a checkpoint folder; return state.json.
    `weights=False`: the model already holds them (the loop's model source read them).

    Raises RefusedError naming the folder (and, for weights, the tensor) when a file does
    not load: `--resume` verified it before, so this means it changed since or is of
    another kind of run.
    """
    path = Path(path)
    try:
        if weights:
            hf.load_weights(model, hf.weight_files(path))
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu",
                                                 weights_only=True))
        if rng:
            restore_rng(torch.load(path / "rng.pt", map_location="cpu", weights_only=True))
        return read_state(path)
    except (RefusedError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - safetensors, zip and pickle errors have no common base
        raise RefusedError(f"checkpoint {path} cannot be loaded ({type(e).__name__}: {e})") from None
