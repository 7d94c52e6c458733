"""Tokenizers: byte-level (the default: no download, vocab 256) or a local Hugging Face one.

A Hugging Face tokenizer is read by the `tokenizers` package (`--tokenizer PATH` on plain
text: no `transformers` needed) or through transformers' AutoTokenizer (a model folder's own
tokenizer, and any tokenizer for SFT data: it carries the chat template, eos and pad ids).
Plain text is encoded the same way by both: the fast tokenizer's `encode_batch`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from . import RefusedError


class ByteTokenizer:
    """UTF-8 bytes are the tokens: ids 0..255, nothing to download, lossless."""

    name = name_or_path = "bytes"
    vocab_size = 256
    # What sft.build_sft reads of a tokenizer: prompt/completion rows work (no eos to learn
    # to stop at); chat rows are refused for want of a template.
    chat_template = eos_token_id = pad_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text).astype(int).tolist()}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw file bytes are already tokens: no decode/encode round trip."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def files(self) -> list[Path]:
        return []


class HFTokenizer:
    """A `tokenizer.json` read by the `tokenizers` package (no `transformers` needed)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise RefusedError(
                f"--tokenizer {path}: reading a Hugging Face tokenizer needs the 'tokenizers' "
                f"package, which is not importable ({e}); install it (pip install tokenizers) or "
                f"use the default byte-level tokenizer (--tokenizer bytes)"
            ) from None
        self.path = path
        self.folder = path.parent
        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> np.ndarray:
        dtype = np.uint16 if self.vocab_size <= 65536 else np.uint32
        # Encode in pieces cut at line ends so a large file does not become one huge string op.
        pieces, out, size, chunk = text.splitlines(keepends=True), [], 0, []
        for line in pieces:
            chunk.append(line)
            size += len(line)
            if size >= 1 << 20:
                out.append("".join(chunk))
                chunk, size = [], 0
        if chunk:
            out.append("".join(chunk))
        ids = [np.asarray(e.ids, dtype=dtype) for e in self._tok.encode_batch(out)] if out else []
        return np.concatenate(ids) if ids else np.zeros(0, dtype=dtype)

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return self.encode(data.decode("utf-8", errors="replace"))

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def files(self) -> list[Path]:
        """Files to copy next to checkpoint weights so the folder is self-contained."""
        names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
        return [self.folder / n for n in names if (self.folder / n).is_file()]


class TransformersTokenizer(HFTokenizer):
    """A tokenizer read by transformers' AutoTokenizer; `hf` is that object (for SFT and
    for saving it into checkpoints with everything it carries)."""

    def __init__(self, path: Path):
        from .hf_models import require_transformers

        tf = require_transformers()
        folder = path if path.is_dir() else path.parent
        try:
            if path.is_dir():
                self.hf = tf.AutoTokenizer.from_pretrained(str(path))
            else:
                self.hf = tf.PreTrainedTokenizerFast(tokenizer_file=str(path))
        except (OSError, ValueError, TypeError, KeyError) as e:
            why = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise RefusedError(f"--tokenizer {path}: transformers cannot load it ({why}); pass a "
                               f"folder saved by a Hugging Face tokenizer's save_pretrained") from None
        self.path, self.folder, self.name = path, folder, str(path)
        self._tok = getattr(self.hf, "backend_tokenizer", None)
        self.vocab_size = len(self.hf)

    def encode(self, text: str) -> np.ndarray:
        if self._tok is not None:
            return super().encode(text)
        ids = self.hf(text)["input_ids"]
        return np.asarray(ids, dtype=np.uint16 if self.vocab_size <= 65536 else np.uint32)

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids])

    def save_pretrained(self, folder) -> None:
        self.hf.save_pretrained(str(folder))


def load_tokenizer(spec: str | os.PathLike | None, transformers: bool = False):
    """`bytes` (or None) -> ByteTokenizer; a folder holding tokenizer.json, or that file -> HF
    (through AutoTokenizer when `transformers`, else the `tokenizers` package)."""
    if spec is None or str(spec) in ("bytes", "byte"):
        return ByteTokenizer()
    path = Path(spec)
    if transformers and path.is_dir() and any((path / n).is_file() for n in
                                               ("tokenizer.json", "tokenizer_config.json")):
        return TransformersTokenizer(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise RefusedError(
            f"--tokenizer {spec}: no such tokenizer (expected 'bytes', a folder with tokenizer.json, "
            f"or a tokenizer.json file); use --tokenizer bytes for the byte-level default"
        )
    return TransformersTokenizer(path) if transformers else HFTokenizer(path)
