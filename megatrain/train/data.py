"""Training data: read a corpus into one token array and serve fixed-length batches.

Accepted `--data`:
  - a text file (any name but the ones below), tokenized whole;
  - a folder: every `*.txt` under it, sorted by path, joined with a blank line;
  - a `.jsonl` file: the "text" field of each line, joined with a blank line;
  - a file of token ids: `.bin` (raw uint16 or uint32, little-endian) or `.npy` (1-D ints);
  - nothing: the small public-domain corpus shipped in `megatrain/data/` (see its README).

Batches are windows of seq+1 tokens at multiples of seq, visited in a fresh random order
each epoch (numpy Generator seeded with (seed, epoch)), so the position is two integers
and a resumed run reads exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import RefusedError

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "data" / "shakespeare.txt"
TOKEN_SUFFIXES = (".bin", ".npy")


@dataclass
class DataSource:
    kind: str                     # "text" | "folder" | "jsonl" | "bin" | "npy"
    path: Path
    files: list[Path] = field(default_factory=list)
    nbytes: int = 0               # bytes on disk (for the memory plan)

    def in_memory_bytes(self) -> int:
        """Host bytes the token array will take (memory-mapped id files take none)."""
        return 0 if self.kind in ("bin", "npy") else 4 * self.nbytes


def describe(path: str | Path | None) -> DataSource:
    """Check `--data` and say what it is, without reading it."""
    if path is None:
        if not DEFAULT_CORPUS.is_file():
            raise RefusedError(f"the shipped corpus {DEFAULT_CORPUS} is missing (broken install); "
                               f"pass --data FILE")
        return DataSource("text", DEFAULT_CORPUS, [DEFAULT_CORPUS], DEFAULT_CORPUS.stat().st_size)
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.txt") if f.is_file())
        if not files:
            raise RefusedError(f"--data {path}: the folder holds no .txt files; put text in "
                               f"*.txt files there or pass a file")
        return DataSource("folder", p, files, sum(f.stat().st_size for f in files))
    if not p.is_file():
        raise RefusedError(f"--data {path}: no such file or folder; pass a text file, a folder of "
                           f".txt, a .jsonl, a .bin/.npy of token ids, or omit --data for the "
                           f"shipped corpus")
    if p.stat().st_size == 0:
        raise RefusedError(f"--data {path}: the file is empty; pass a file with training text "
                           f"or token ids, or omit --data for the shipped corpus")
    kind = {".jsonl": "jsonl", ".bin": "bin", ".npy": "npy"}.get(p.suffix.lower(), "text")
    return DataSource(kind, p, [p], p.stat().st_size)


def _id_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.uint32


def load_tokens(src: DataSource, tokenizer, vocab_size: int, data_dtype: str = "auto") -> np.ndarray:
    """The whole corpus as one 1-D integer array (a memory map for .bin/.npy)."""
    if src.kind in ("text", "folder"):
        parts = []
        for i, f in enumerate(src.files):
            if i:
                parts.append(tokenizer.encode("\n\n"))
            raw = f.read_bytes()
            _check_utf8(raw, f)
            parts.append(tokenizer.encode_bytes(raw))
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
    elif src.kind == "jsonl":
        texts = []
        _check_utf8(src.path.read_bytes(), src.path)
        with open(src.path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise RefusedError(f"--data {src.path}: line {n} is not JSON ({e}); each line "
                                       f"must be an object with a \"text\" field") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise RefusedError(f"--data {src.path}: line {n} has no string \"text\" field; "
                                       f"each line must look like {{\"text\": \"...\"}}")
                texts.append(row["text"])
        tokens = tokenizer.encode("\n\n".join(texts))
    elif src.kind == "bin":
        dtype = {"auto": _id_dtype(vocab_size), "uint16": np.uint16, "uint32": np.uint32}[data_dtype]
        itemsize = np.dtype(dtype).itemsize
        if src.nbytes % itemsize:
            other = "uint32" if itemsize == 2 else "uint16"
            raise RefusedError(f"--data {src.path}: {src.nbytes} bytes is not a whole number of "
                               f"{np.dtype(dtype).name} ids; pass --data-dtype {other} if that is "
                               f"how it was written")
        tokens = np.memmap(src.path, dtype=dtype, mode="r")
    else:  # npy
        try:
            tokens = np.load(src.path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise RefusedError(f"--data {src.path}: not a plain .npy array ({e}); save token ids "
                               f"with np.save(path, ids)") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise RefusedError(f"--data {src.path}: holds a {tokens.dtype} array of shape "
                               f"{tokens.shape}; it must be 1-D integer token ids")
    _check_range(src, tokens, vocab_size)
    return tokens


def _check_range(src: DataSource, tokens: np.ndarray, vocab_size: int) -> None:
    hi, lo = -1, 0
    step = 1 << 24
    for i in range(0, len(tokens), step):
        chunk = np.asarray(tokens[i:i + step])
        hi, lo = max(hi, int(chunk.max())), min(lo, int(chunk.min()))
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise RefusedError(f"--data {src.path}: holds token id {bad} but the model's vocabulary is "
                           f"0..{vocab_size - 1}; use the tokenizer the ids were made with and a "
                           f"model whose vocab_size covers it")


class EpochOrder:
    """Which items each global batch takes: 0..n-1 in a fresh random order each epoch (numpy
    Generator seeded with (seed, epoch)), so the position is two integers (epoch, index) and
    a resumed run takes exactly the items an uninterrupted run would.

    Data parallel: with ``world`` ranks every rank walks the same global batch and keeps its
    ``batch / world`` contiguous share; the position stays the global one, so a run resumes
    with any number of ranks. TokenLoader and sft.SFTBatches serve their items in this order."""

    def __init__(self, n: int, batch: int, seed: int, rank: int = 0, world: int = 1):
        assert world >= 1 and 0 <= rank < world and batch % world == 0, (rank, world, batch)
        self.n, self.batch, self.seed, self.rank, self.world = n, batch, seed, rank, world
        self.epoch, self.index = 0, 0
        self._perm_epoch, self._perm = -1, None

    def _order(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm, self._perm_epoch = rng.permutation(self.n), self.epoch
        return self._perm

    def next_items(self) -> list[int]:
        """This rank's items of the next global batch, in batch order."""
        mine = self.batch // self.world
        first = self.rank * mine
        picked = []
        for r in range(self.batch):
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
            item = int(self._order()[self.index])
            self.index += 1
            if first <= r < first + mine:
                picked.append(item)
        return picked

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class TokenLoader:
    """Random windows of `seq`+1 tokens, `batch` at a time, as (input_ids, labels) int64, in
    an EpochOrder over the windows at multiples of `seq`."""

    def __init__(self, tokens: np.ndarray, seq: int, batch: int, seed: int,
                 rank: int = 0, world: int = 1):
        self.tokens, self.seq, self.batch, self.seed = tokens, seq, batch, seed
        self.n_windows = (len(tokens) - 1) // seq
        if self.n_windows < 1:
            raise RefusedError(f"the data has {len(tokens)} tokens, too few for one sequence of "
                               f"--seq {seq} (needs {seq + 1}); use a smaller --seq or more data")
        self.order = EpochOrder(self.n_windows, batch, seed, rank, world)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        picked = self.order.next_items()
        rows = np.empty((len(picked), self.seq + 1), dtype=np.int64)
        for k, window in enumerate(picked):
            start = window * self.seq
            rows[k] = self.tokens[start:start + self.seq + 1]
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {**self.order.position(), "n_windows": self.n_windows,
                "seq": self.seq, "batch": self.batch, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("n_windows", "seq", "batch", "seed"):
            if state[key] != mine[key]:
                raise RefusedError(f"the checkpoint's data position was taken with {key}="
                                   f"{state[key]}, this run has {mine[key]}; resume with the same "
                                   f"--data, --tokenizer, --seq, --batch-tokens, --grad-accum, --seed")
        self.order.restore(state)


def _check_utf8(raw: bytes, path) -> None:
    """Text data must be UTF-8: a binary or legacy-encoded file passed as text is a mistake
    the byte tokenizer would otherwise train on silently."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RefusedError(f"--data {path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 4]!r}); "
                           f"convert it (e.g. iconv -t utf-8) or pass token ids as .bin/.npy") from None
