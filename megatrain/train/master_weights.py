"""The exact fp32 weights of a checkpoint whose shards are bf16 (`--save-dtype bf16`).

bf16 shards are what a user shares, but they round every weight, and a resumed run must go
on from the very bits the interrupted one held. So such a checkpoint also holds
`master.safetensors`: the model's own state_dict (names as the live module has them, after
transformers' renames and fusions, tied tensors once), fp32. Resuming loads the model from
the shards through transformers (which builds the module, its buffers and ties), then
overwrites every tensor from this file, one tensor at a time, so the peak is the model plus
one tensor. `from_pretrained` never reads this file: it loads `model.safetensors` or the
shards of its index only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import RefusedError

FILENAME = "master.safetensors"


def _unique(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the state_dict with each tied parameter under its first name only, the other names).

    Tied parameters are one Parameter object under several names; `named_parameters` keeps
    the first, as it does on a meta model, where there is no storage to compare."""
    every = dict(model.named_parameters(remove_duplicate=False))
    dropped = sorted(set(every) - set(dict(model.named_parameters())))
    return {k: v for k, v in model.state_dict().items() if k not in dropped}, dropped


def save(model: torch.nn.Module, folder: str | Path) -> Path:
    """Write the model's state_dict, fp32 as it is, tied tensors once."""
    from safetensors.torch import save_file

    kept, tied = _unique(model)
    path = Path(folder) / FILENAME
    save_file({k: t.detach().contiguous() for k, t in kept.items()}, str(path),
              metadata={"format": "pt", "tied": json.dumps(tied)})
    return path


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return {n: tuple(fh.get_slice(n).get_shape()) for n in fh.keys()}  # noqa: SIM118 - a safe_open handle, not a dict
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
        raise RefusedError(f"{path.name} has an unreadable header ({type(e).__name__}: {e})") from None


def check(model: torch.nn.Module, path: str | Path) -> None:
    """Refuse unless the file holds every tensor of `model` (a meta model is fine), with its
    shape, and nothing else; read from the header only."""
    path = Path(path)
    if not path.is_file():
        raise RefusedError(f"{path.name} is missing (a --save-dtype bf16 checkpoint keeps the "
                           f"exact fp32 weights there)")
    head = _header(path)
    kept, _ = _unique(model)
    for name, t in kept.items():
        if name not in head:
            raise RefusedError(f"{path.name} lacks tensor {name}")
        if head[name] != tuple(t.shape):
            raise RefusedError(f"{path.name}: tensor {name} has shape {head[name]}, the model "
                               f"makes {tuple(t.shape)}")
    extra = sorted(set(head) - set(kept))
    if extra:
        raise RefusedError(f"{path.name} holds tensors the model has not: {extra[:4]}")


@torch.no_grad()
def load(model: torch.nn.Module, path: str | Path) -> None:
    """Copy every tensor of the file into `model`'s state_dict in place, checked first."""
    from safetensors import safe_open

    path = Path(path)
    check(model, path)
    kept, _ = _unique(model)
    with safe_open(str(path), framework="pt") as fh:
        for name, t in kept.items():
            t.copy_(fh.get_tensor(name))
