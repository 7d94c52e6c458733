"""What the loop feeds the model: plain-text windows (data.py) or SFT rows (sft.py), as one
Batch type, and the eval pass over the held-out SFT rows.

A Batch carries the labels in both conventions, so each model source takes the one its
forward expects: `labels` are Hugging Face's (the ids themselves, shifted inside the model's
loss; plain text passes the inputs, so the window's last target goes untrained, as with any
transformers Trainer), `targets` the next token of each position (megatrain's Llama). -100
marks a position without loss in both.

SFT data is a `.jsonl` whose rows are chats or prompt/completion pairs (sft.is_sft_jsonl);
everything else is plain text, read as before. The SFT-only flags are refused with plain
text (--packing/--no-packing, --eval-fraction) rather than ignored.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import RefusedError, data, sft
from .sft import IGNORE
from .tokenizer import ByteTokenizer


class Batch(NamedTuple):
    input_ids: torch.Tensor
    labels: torch.Tensor                 # Hugging Face convention: unshifted
    targets: torch.Tensor                # the next token of each position: shifted
    position_ids: torch.Tensor | None    # None: 0..seq-1 in every row

    def to(self, device) -> Batch:
        return Batch(*(None if t is None else t.to(device, non_blocking=True) for t in self))


def text_batch(x: torch.Tensor, y: torch.Tensor) -> Batch:
    return Batch(x, x, y, None)


def sft_batch(ids: torch.Tensor, labels: torch.Tensor, pos: torch.Tensor) -> Batch:
    return Batch(ids, labels, sft.next_token_labels(labels), pos)


def is_sft(src: data.DataSource) -> bool:
    return src.kind == "jsonl" and sft.is_sft_jsonl(src.path)


def check_options(cfg, src: data.DataSource, source) -> bool:
    """Whether the data is SFT; refuses the flags that do not apply to it or to the model and
    settles `cfg.packing` (packed where the model can keep packed examples apart)."""
    if not is_sft(src):
        flag = {True: "--packing", False: "--no-packing"}.get(cfg.packing)
        if flag:
            raise RefusedError(f"{flag}: packing applies to SFT data (a .jsonl of \"messages\" or "
                               f"\"prompt\"/\"completion\" rows); --data {src.path} is plain text, "
                               f"read as back-to-back windows: drop {flag}")
        if cfg.eval_fraction:
            raise RefusedError(f"--eval-fraction {cfg.eval_fraction}: eval holds out SFT examples "
                               f"(a .jsonl of \"messages\" or \"prompt\"/\"completion\" rows); "
                               f"--data {src.path} is plain text: drop --eval-fraction")
        return False
    if cfg.packing is None:
        cfg.packing = source.packs
    if cfg.packing and not source.packs:
        raise RefusedError(f"--packing: {source.no_packing} (--model {cfg.model}), so packed "
                           f"examples would attend to each other; drop --packing (each example "
                           f"is padded to its own row) or train a model that takes position ids")
    return True


def data_bytes(src: data.DataSource, sft_data: bool, tok) -> int:
    """Host bytes the data takes (for the memory plan). SFT: about 28 bytes a token while
    tokenizing (two int64 arrays per example, three int32 per row); a token is a byte with
    the byte tokenizer, about three bytes of text with a subword one."""
    if not sft_data:
        return src.in_memory_bytes()
    return int(28 * src.nbytes / (1 if isinstance(tok, ByteTokenizer) else 3))


@dataclass
class Feed:
    kind: str                          # "text" | "sft"
    loader: object                     # data.TokenLoader | sft.SFTBatches
    summary: str                       # what the log says of the data
    eval_data: sft.SFTData | None = None

    def next_batch(self) -> Batch:
        parts = self.loader.next_batch()
        return sft_batch(*parts) if self.kind == "sft" else text_batch(*parts)


def load(cfg, src: data.DataSource, tok, source, micro_batch: int, rank: int, world: int,
         sft_data: bool) -> Feed:
    """Read and check the data (refusals name the line or the token) and make its loader."""
    if not sft_data:
        tokens = data.load_tokens(src, tok, source.vocab_size, cfg.data_dtype)
        if len(tokens) <= cfg.seq:
            raise RefusedError(f"--data {src.path}: {len(tokens)} tokens, too few for one sequence "
                               f"of --seq {cfg.seq} (needs {cfg.seq + 1}); use a smaller --seq or "
                               f"more data")
        loader = data.TokenLoader(tokens, cfg.seq, micro_batch, cfg.seed, rank=rank, world=world)
        return Feed("text", loader, f"data {src.path} ({len(tokens):,} tokens)")
    train, held = sft.build_sft(src.path, getattr(tok, "hf", tok), cfg.seq, packing=cfg.packing,
                                eval_fraction=cfg.eval_fraction, seed=cfg.seed,
                                vocab_size=source.vocab_size)
    loader = sft.SFTBatches(train, micro_batch, cfg.seed, rank=rank, world=world)
    s = train.summary()
    layout = "packed" if cfg.packing else "one per row, padded"
    text = (f"SFT data {src.path}: {s['examples']} {s['format']} examples in {s['rows']} rows of "
            f"{s['seq']} tokens ({layout}), {s['tokens']:,} tokens, {s['trained_tokens']:,} "
            f"trained (assistant/completion); {s['truncated']} examples longer than --seq were "
            f"truncated")
    if s["truncated_no_loss"]:
        text += f" ({s['truncated_no_loss']} kept no trained token and were dropped: raise --seq)"
    if not source.packs:
        text += (f"\n  {source.no_packing}: each example is padded to a row of its own "
                 f"(packing needs position ids, which transformers masks across)")
    if held is not None:
        every = f"every {cfg.eval_every} steps and " if cfg.eval_every else ""
        text += (f"\n  eval: {held.examples} examples held out ({len(held)} rows), mean loss "
                 f"{every}at the last step")
    return Feed("sft", loader, text, held)


@torch.no_grad()
def evaluate(step_fn, model: torch.nn.Module, source, eval_data: sft.SFTData, batch: int,
             device: torch.device | None, autocast=None) -> float:
    """The mean loss per trained token over every held-out row, through the same step
    function (compiled: one inference graph; every batch is padded to the training batch's
    rows, so there is one shape to compile). `device`: move the batches there (eager)."""
    autocast = contextlib.nullcontext() if autocast is None else autocast
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for ids, labels, pos in eval_data.iter_batches(batch):
            short = batch - ids.shape[0]
            if short:   # rows without loss: they change neither the sum nor the count
                ids = torch.cat([ids, ids.new_zeros(short, ids.shape[1])])
                labels = torch.cat([labels, labels.new_full((short, labels.shape[1]), IGNORE)])
                pos = torch.cat([pos, torch.arange(pos.shape[1]).expand(short, -1)])
            b = sft_batch(ids, labels, pos)
            n = int((b.targets != IGNORE).sum())
            if not n:
                continue
            if device is not None:
                b = b.to(device)
            with autocast:
                loss = source.loss(step_fn, b)
            total += float(loss) * n
            count += n
    finally:
        model.train(was_training)
    return total / count if count else float("nan")
