"""The models and tokens every system of bench/train.py trains on: the bench's model names,
the preset each stands for (a depth override gives the depth sweep at the same width), and
the shipped corpus as token ids. One module, so that the parent, every child and the other
scripts (bench/plan_preview.py) build exactly the same shape from the same name.
Imports torch lazily: bench/readme_table.py reads MODELS without it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODELS = {"1.3b": "1b", "3b": "3b", "8b": "8b", "tiny": "tiny"}  # bench name -> preset


def _tokens(n: int, vocab: int):
    """`n` token ids from the shipped corpus's bytes (repeated as needed): real text, the
    same for every system, with no tokenizer or download."""
    import numpy as np
    import torch

    raw = (REPO / "megatrain/data/shakespeare.txt").read_bytes()
    ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int64) % vocab
    reps = -(-n // len(ids))
    return torch.from_numpy(np.tile(ids, reps)[:n].copy())


def _config(name: str, layers: int | None = None):
    """The preset's config; `layers` overrides its depth at the same width (depth sweep)."""
    import dataclasses

    from megatrain.models import PRESETS

    cfg = PRESETS[MODELS[name]]
    return dataclasses.replace(cfg, layers=layers) if layers else cfg


def _model(name: str, layers: int | None = None):
    """The model, seeded: every system starts from the same weights."""
    import torch

    from megatrain.models import Llama

    torch.manual_seed(0)
    return Llama(_config(name, layers))


def _param_count(name: str, layers: int | None = None) -> int:
    """Parameters of the model, counted on the meta device: no memory, no init time (8B)."""
    import torch

    from megatrain.models import Llama

    with torch.device("meta"):
        return sum(p.numel() for p in Llama(_config(name, layers)).parameters())

