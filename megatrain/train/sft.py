"""Supervised fine-tuning data: chat or prompt/completion rows -> fixed-length rows with labels.

Accepted `--data` for SFT: a `.jsonl` whose rows are either
  {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]} or
  {"prompt": "...", "completion": "..."}.
Plain {"text": ...} rows are pretraining text, read by data.py; `is_sft_jsonl` tells them apart.

Loss is taken only where the model should learn to write: assistant turns of a chat, the
completion (and its eos) of a prompt/completion row. Labels follow the Hugging Face causal-LM
convention: they are the token ids themselves, NOT shifted (the model's loss shifts: position t
predicts labels[t+1]), and -100 where no loss is taken. Models that expect already-shifted
labels (megatrain.models.Llama, like data.py's batches) take `next_token_labels(labels)`.

Packing (the default) concatenates examples into rows of exactly `seq` tokens, with
`position_ids` restarting at 0 on each example's first token. Verified in transformers 5.25,
`transformers/masking_utils.py`: `_preprocess_mask_arguments` calls
`find_packed_sequence_indices(position_ids)` (a new sequence starts wherever consecutive
position ids do not differ by exactly 1) only when `position_ids` is given, `attention_mask is
None` and `cache is None`; `create_causal_mask` then ANDs the causal mask with "same sequence"
(`packed_sequence_mask_function`, positions remapped by `remap_positions_for_packed_sequence`)
and materialises it instead of relying on SDPA's is_causal. This holds for sdpa, eager and flex
attention with any batch size (each row is read on its own); flash_attention_2 instead reads the
position ids itself and only when the batch size is 1 (`_is_packed_sequence` in
modeling_flash_attention_utils.py). Caveat: LlamaModel takes `use_cache` from the config
(True by default, even in training mode) and then builds an empty DynamicCache, which turns the
detection OFF and lets packed examples attend to each other. Pass `use_cache=False` (or set
`config.use_cache = False`) when training on packed rows.

The first label of every example is -100, so the previous example's last token is never
trained to predict the next example's first token. The tail of a row is padding: pad id
(tokenizer.pad_token_id, else eos, else 0), label -100, and position ids that CONTINUE the
row's last example. Pads come after every real token, so causal attention keeps them out of
the real tokens' view, and their labels are -100; continuing (rather than restarting) means
a row holding one example has positions 0..seq-1, which transformers reads as "not packed" and
keeps the fast is_causal path, and no position ever reaches `seq`. The same holds unpacked (one
example per row, padded at the end): no attention mask is needed there either.

Examples longer than `seq` keep their first `seq` tokens and are counted (`truncated`), never
dropped silently. Batches visit rows in a fresh random order each epoch, seeded like data.py
(numpy Generator seeded with (seed, epoch)), so the position is two integers and a resumed run
reads exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import RefusedError
from .data import EpochOrder

IGNORE = -100
_SPLIT_STREAM = 0x5F7  # keeps the eval split's random stream apart from the batch orders
_FIX = ('each line must be {"messages": [{"role": ..., "content": ...}, ...]} or '
        '{"prompt": "...", "completion": "..."}')


def is_sft_jsonl(path: str | Path) -> bool:
    """True when the first non-empty line is a JSON object with SFT fields (a cheap peek, so
    the CLI can route a .jsonl before reading it; bad lines are refused later, by the reader)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with open(p, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    row = json.loads(line)
                    return isinstance(row, dict) and any(
                        k in row for k in ("messages", "prompt", "completion"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return False


def read_rows(path: str | Path) -> list[tuple[int, str, object]]:
    """The rows as (line number, "chat" | "prompt_completion", messages or (prompt, completion)).

    The format is read per row, so a file may mix both; everything is checked before any
    tokenizing so a bad line deep in a large file fails fast."""
    p = Path(path)
    if not p.is_file():
        raise RefusedError(f"--data {path}: no such file; pass a .jsonl of SFT rows ({_FIX})")
    out = []
    with open(p, "rb") as fh:  # bytes, decoded per line, so a bad byte is reported on its line
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RefusedError(f"--data {p}: line {n} is not UTF-8 (byte {e.start}: "
                                   f"{raw[e.start:e.start + 4]!r}); convert the file (e.g. "
                                   f"iconv -t utf-8)") from None
            if line.strip():
                out.append((n, *_parse(p, n, line)))
    if not out:
        raise RefusedError(f"--data {p}: the file is empty (no rows); {_FIX}")
    return out


def _parse(p: Path, n: int, line: str):
    where = f"--data {p}: line {n}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise RefusedError(f"{where} is not JSON ({e}); {_FIX}") from None
    if not isinstance(row, dict):
        raise RefusedError(f"{where} is a JSON {type(row).__name__}, not an object; {_FIX}")
    chat, pc = "messages" in row, ("prompt" in row or "completion" in row)
    if chat and pc:
        raise RefusedError(f"{where} has both \"messages\" and \"prompt\"/\"completion\"; keep one")
    if pc:
        for key in ("prompt", "completion"):
            if not isinstance(row.get(key), str):
                raise RefusedError(f"{where}: \"{key}\" is {type(row.get(key)).__name__}, not a "
                                   f"string; a prompt/completion row needs both as strings")
        return "prompt_completion", (row["prompt"], row["completion"])
    if not chat:
        if "text" in row:
            raise RefusedError(f"{where} is a {{\"text\": ...}} row, which is pretraining data, "
                               f"not SFT; train on it without SFT, or {_FIX}")
        raise RefusedError(f"{where} has neither \"messages\" nor \"prompt\"/\"completion\" "
                           f"(keys: {sorted(row)}); {_FIX}")
    msgs = row["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise RefusedError(f"{where}: \"messages\" must be a non-empty list of "
                           f"{{\"role\", \"content\"}} objects")
    for i, m in enumerate(msgs):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise RefusedError(f"{where}: message {i} ({str(m)[:60]}) is not "
                               f"{{\"role\": str, \"content\": str}}; write each turn that way")
    if not any(m["role"] == "assistant" for m in msgs):
        raise RefusedError(f"{where}: the chat has no \"assistant\" turn, so nothing would be "
                           f"learned; add the assistant's reply or drop the row")
    return "chat", msgs


def _as_ids(out) -> list[int]:
    """apply_chat_template(tokenize=True) returns a list in some versions and a dict /
    BatchEncoding with input_ids in others (transformers 5): accept both."""
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if len(out) == 1 and isinstance(out[0], list):
        out = out[0]
    return [int(i) for i in out]


def encode_chat(messages: list[dict], tokenizer, where: str = "chat") -> tuple[np.ndarray, np.ndarray]:
    """(ids, labels) of a chat rendered by the tokenizer's chat template; labels on assistant turns.

    Each assistant turn i is the tokens between the render of messages[:i] with the generation
    prompt and the render of messages[:i+1]: works for any template, without
    `{% generation %}` markers. A template that re-renders earlier turns differently later (e.g.
    one that drops past reasoning) breaks the prefix property and is refused, not guessed at."""
    if not getattr(tokenizer, "chat_template", None):
        raise RefusedError(f"{where}: the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no "
                           f"chat template, so chat rows cannot be rendered; write the data as "
                           f"prompt/completion rows or use a tokenizer with a chat_template")
    ids = _as_ids(tokenizer.apply_chat_template(messages, tokenize=True))
    labels = np.full(len(ids), IGNORE, dtype=np.int64)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:  # an empty chat may still render something (a default system prompt)
            prefix = _as_ids(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True,
                                                           tokenize=True))
        except Exception:
            if i:
                raise
            prefix = []  # some templates refuse an empty chat: the turn starts at token 0
        full = _as_ids(tokenizer.apply_chat_template(messages[:i + 1], tokenize=True))
        if full[:len(prefix)] != prefix or ids[:len(full)] != full:
            raise RefusedError(f"{where}: the chat template renders assistant turn {i} differently "
                               f"once later turns follow (the render up to it is not a prefix of "
                               f"the whole chat), so its tokens cannot be found; split the chat "
                               f"into one row per assistant turn or use prompt/completion rows")
        labels[len(prefix):len(full)] = ids[len(prefix):len(full)]
    return np.asarray(ids, dtype=np.int64), labels


def encode_prompt_completion(prompt: str, completion: str, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """tokenizer(prompt) (its special tokens included, e.g. bos) + the completion without special
    tokens + eos (when the tokenizer has one, so the model learns to stop); labels on the last two."""
    p = list(tokenizer(prompt)["input_ids"])
    c = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        c.append(int(tokenizer.eos_token_id))
    ids = np.asarray(p + c, dtype=np.int64)
    return ids, np.concatenate([np.full(len(p), IGNORE, dtype=np.int64), ids[len(p):]])


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) example indices, each sorted. round(f * n) examples, at least one, go to
    eval, picked by a permutation seeded with `seed` so a resumed run holds out the same ones."""
    if not 0 <= eval_fraction < 1:
        raise RefusedError(f"--eval-fraction {eval_fraction}: must be at least 0 and below 1 "
                           f"(e.g. 0.05 holds out 5% of the examples)")
    n_eval = max(1, round(eval_fraction * n)) if eval_fraction > 0 else 0
    if n_eval >= n and n_eval:
        raise RefusedError(f"--eval-fraction {eval_fraction}: {n} example(s) leave none for "
                           f"training after holding out {n_eval}; use more data or --eval-fraction 0")
    perm = np.random.default_rng([_SPLIT_STREAM, seed]).permutation(n)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


@dataclass
class SFTData:
    """Rows of `seq` tokens, as int32 arrays [rows, seq] (int64 only in batches, to halve memory)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    examples: int
    tokens: int          # real (non-pad) tokens
    truncated: int       # examples cut to `seq` tokens
    truncated_no_loss: int  # ...of which no labelled token survived: dropped (raise --seq)
    fmt: str             # "chat" | "prompt_completion" | "mixed"

    @property
    def seq(self) -> int:
        return int(self.input_ids.shape[1])

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def summary(self) -> dict:
        return {"format": self.fmt, "examples": self.examples, "rows": len(self), "seq": self.seq,
                "tokens": self.tokens, "trained_tokens": int((self.labels != IGNORE).sum()),
                "truncated": self.truncated, "truncated_no_loss": self.truncated_no_loss}

    def in_memory_bytes(self) -> int:
        """Host bytes the rows take (for the memory plan)."""
        return self.input_ids.nbytes + self.labels.nbytes + self.position_ids.nbytes

    def rows(self, idx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows `idx` (an index array or slice) as int64 (input_ids, labels, position_ids)."""
        return tuple(torch.from_numpy(a[idx].astype(np.int64))
                     for a in (self.input_ids, self.labels, self.position_ids))

    def iter_batches(self, batch: int):
        """Every row once, in order, `batch` at a time (the last batch may be short): for eval."""
        for start in range(0, len(self), batch):
            yield self.rows(slice(start, start + batch))


def pack_examples(examples: list[tuple[np.ndarray, np.ndarray]], seq: int, pad_id: int,
                  packing: bool = True, fmt: str = "prompt_completion") -> SFTData:
    """Lay examples into rows of `seq` tokens (see the module docstring for pads and positions).

    Packing is best fit in file order: each example goes to the open row with the least room
    that still holds it (a sorted list of free space), which wastes far less padding than
    starting a new row whenever the current one is too full, at O(n log n)."""
    if seq < 2:
        raise RefusedError(f"--seq {seq}: SFT rows need at least 2 tokens")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row) of rows that still have room
    cut, cut_no_loss, tokens = [], 0, 0
    for k, (ids, lab) in enumerate(examples):
        if len(ids) > seq:
            cut.append(k)
            if (lab[1:seq] == IGNORE).all():
                # nothing left to learn from it: a row of it alone would be a micro-batch
                # with no trained token (a mean loss of 0/0), so it is dropped, and counted
                cut_no_loss += 1
                continue
        n = min(len(ids), seq)
        tokens += n
        j = bisect.bisect_left(free, (n, -1)) if packing else len(free)
        if j < len(free):
            room, r = free.pop(j)
            rows[r].append(k)
        else:
            room, r = seq, len(rows)
            rows.append([k])
        if packing and room - n > 0:
            bisect.insort(free, (room - n, r))
    if examples and not rows:
        raise RefusedError(f"--seq {seq}: every SFT example is longer and keeps no trained "
                           f"token within it (the prompts alone fill it); raise --seq")
    shape = (len(rows), seq)
    out_ids, out_lab = np.full(shape, pad_id, np.int32), np.full(shape, IGNORE, np.int32)
    out_pos = np.zeros(shape, np.int32)
    for r, members in enumerate(rows):
        off = 0
        for k in members:
            ids, lab = examples[k]
            n = min(len(ids), seq)
            out_ids[r, off:off + n] = ids[:n]
            out_lab[r, off + 1:off + n] = lab[1:n]  # first label -100: nothing predicts it
            out_pos[r, off:off + n] = np.arange(n)
            off += n
        out_pos[r, off:] = (out_pos[r, off - 1] + 1 if off else 0) + np.arange(seq - off)
    return SFTData(out_ids, out_lab, out_pos, len(examples), tokens, len(cut), cut_no_loss, fmt)


def build_sft(path: str | Path, tokenizer, seq: int, *, packing: bool = True,
              eval_fraction: float = 0.0, seed: int = 0,
              vocab_size: int | None = None) -> tuple[SFTData, SFTData | None]:
    """Read, tokenize, split and lay out an SFT .jsonl: (train, eval or None).

    `tokenizer` is a transformers tokenizer (AutoTokenizer.from_pretrained); `vocab_size`, when
    given, is the model's, and ids outside it are refused rather than crashing the embedding."""
    rows = read_rows(path)
    examples = []
    for n, kind, payload in rows:
        where = f"--data {path}: line {n}"
        if kind == "chat":
            ids, lab = encode_chat(payload, tokenizer, where)
        else:
            ids, lab = encode_prompt_completion(*payload, tokenizer)
        if not (lab[1:] != IGNORE).any():
            raise RefusedError(f"{where}: the row has no token to learn from (empty completion and "
                               f"no eos token?); give it a non-empty answer or drop it")
        if vocab_size is not None and len(ids) and int(ids.max()) >= vocab_size:
            raise RefusedError(f"{where}: holds token id {int(ids.max())} but the model's vocabulary "
                               f"is 0..{vocab_size - 1}; use the model's own tokenizer")
        examples.append((ids, lab))
    kinds = {k for _, k, _ in rows}
    fmt = kinds.pop() if len(kinds) == 1 else "mixed"
    pad = next((int(t) for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    train_idx, eval_idx = split_indices(len(examples), eval_fraction, seed)
    train = pack_examples([examples[i] for i in train_idx], seq, pad, packing, fmt)
    held = pack_examples([examples[i] for i in eval_idx], seq, pad, packing, fmt) if len(eval_idx) else None
    return train, held


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF-convention labels [B, T] -> the target of each position ([B, T], -100 at the end), for
    models whose loss does not shift (megatrain.models.Llama: cross_entropy(logits, labels))."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)


class SFTBatches:
    """Random rows, `batch` at a time, as int64 (input_ids, labels, position_ids) of [batch, seq],
    in a data.EpochOrder over the rows: seeded per epoch, a two-integer position, every rank
    keeping its share of the same global batch, as data.TokenLoader serves windows."""

    def __init__(self, data: SFTData, batch: int, seed: int, rank: int = 0, world: int = 1):
        if len(data) < 1:
            raise RefusedError("the SFT data has no rows; pass a .jsonl with examples")
        self.data, self.seq, self.batch, self.seed = data, data.seq, batch, seed
        self.n_rows = len(data)
        self.order = EpochOrder(self.n_rows, batch, seed, rank, world)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data.rows(np.asarray(self.order.next_items()))

    def state_dict(self) -> dict:
        return {**self.order.position(), "n_rows": self.n_rows,
                "seq": self.seq, "batch": self.batch, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("n_rows", "seq", "batch", "seed"):
            if state.get(key) != mine[key]:
                raise RefusedError(f"the checkpoint's SFT data position was taken with {key}="
                                   f"{state.get(key)}, this run has {mine[key]}; resume with the "
                                   f"same --data, --tokenizer, --seq, --batch-tokens, --grad-accum, "
                                   f"--seed and packing/eval settings")
        self.order.restore(state)
