"""The run's settings: `megatrain train`'s arguments merged with defaults (or with the resumed
run's saved ones) and checked, each refusal naming the value and the fix before any work.

Checks that need the model or the data (the tokenizer's size, SFT-only flags, ...) are the
loop's, once it knows them; everything that the arguments alone decide is checked here.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain.models import PRESETS

from . import RefusedError, checkpoint, parallel, plan

SAVE_DTYPES = ("fp32", "bf16")
# What marks a folder's own tokenizer (read through transformers' AutoTokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class TrainConfig:
    model: str = "tiny"
    data: str | None = None             # None: the shipped corpus
    tokenizer: str | None = None        # None: the model folder's own, else bytes
    data_dtype: str = "auto"            # for .bin token files: auto | uint16 | uint32
    packing: bool | None = None         # SFT rows: None = packed for transformers models
    eval_fraction: float = 0.0          # SFT: share of the examples held out for eval
    eval_every: int | None = None       # None: at every checkpoint save and at the last step
    steps: int = 200
    seq: int = 256
    batch_tokens: int = 4096            # tokens per optimizer step (all micro-batches)
    grad_accum: int = 1
    lr: float | None = None             # None: 2e-5 on pretrained weights; else 3e-3 below 50M params, 3e-4
    warmup: int | None = None           # None: steps // 10, at most 2000
    min_lr_ratio: float = 0.1           # cosine decays to lr * min_lr_ratio at --steps
    weight_decay: float = 0.1
    clip: float = 1.0                   # global grad-norm clip; 0 disables
    device: str | None = None           # None: cuda if available, else cpu
    gpu_memory: str | None = None
    host_memory: str | None = None      # None: the backend's default
    precision: str | None = None        # None: bf16 on cuda, fp32 on cpu
    compile: str = "megatrain"          # megatrain | eager
    out: str | None = None              # None: runs/<model name>
    save_every: int | None = None       # None: a quarter of the run, at most 500; 0: only at the end
    save_dtype: str = "fp32"            # transformers checkpoints' shards: fp32 | bf16 (+ fp32 master)
    keep: int = 2                       # complete checkpoints kept
    seed: int = 0
    resume: bool = False
    overwrite: bool = False
    stop_after: int | None = None       # stop after this many steps of this invocation
    save: bool = True                   # False (--no-save): write no checkpoint at all
    progress: bool = True


# Fields a resumed run must share with its checkpoint (they fix the data and the model);
# fields that only steer this invocation are not saved with the run.
IDENTITY = ("model", "data", "tokenizer", "data_dtype", "seq", "batch_tokens", "grad_accum", "seed",
            "packing", "eval_fraction")
TRANSIENT = ("resume", "overwrite", "stop_after", "progress", "out", "save")


def backend_options(cfg: TrainConfig) -> dict:
    """The megatrain backend's options from the run's config. The loop reads only the
    loss, so it gives the consent option: a model that also returns its logits never
    copies them to the host."""
    options = {"device": cfg.device, "precision": cfg.precision, "outputs": "loss"}
    if cfg.gpu_memory is not None:
        options["gpu_memory"] = cfg.gpu_memory
    if cfg.host_memory is not None:
        options["host_memory"] = cfg.host_memory
    return options


def model_name(model: str) -> str:
    return model if model in PRESETS else (Path(model).name or "model")


def _absolute(value: str | None) -> str | None:
    if value is None or value in PRESETS or value in ("bytes", "byte"):
        return value
    return str(Path(value).expanduser().resolve()) if Path(value).expanduser().exists() else value


def has_own_tokenizer(folder: str | Path) -> bool:
    return Path(folder).is_dir() and any((Path(folder) / n).is_file() for n in TOKENIZER_FILES)


def resolve_config(given: dict) -> tuple[TrainConfig, Path | None]:
    """Merge the given arguments with defaults (or the resumed run's config); check them."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(given) - names
    assert not unknown, unknown
    given = dict(given)
    for key in ("model", "data", "tokenizer"):
        if key in given:
            given[key] = _absolute(given[key])
    model = given.get("model", TrainConfig.model)
    out = Path(given.get("out") or Path("runs") / model_name(model))
    ckpt = None
    if given.get("resume") and given.get("overwrite"):
        raise RefusedError("--resume and --overwrite conflict: --resume continues the run in "
                           "--out, --overwrite starts it over; pass one")
    if given.get("resume"):
        ckpt = _resume_checkpoint(out)
        saved = checkpoint.read_state(ckpt)["config"]
        for key in IDENTITY:
            if key in given and given[key] != saved.get(key):
                raise RefusedError(f"--resume: --{key.replace('_', '-')} {given[key]} differs from "
                                   f"the run in {out} ({saved.get(key)}); drop it to continue that "
                                   f"run, or use a new --out")
        merged = {k: v for k, v in saved.items() if k in names and k not in TRANSIENT}
        merged.update(given)
    else:
        merged = given
    cfg = TrainConfig(**merged)
    cfg.out = str(out)
    if cfg.tokenizer is None:   # a model folder's own tokenizer (and chat template), else bytes
        own = cfg.model not in PRESETS and has_own_tokenizer(cfg.model)
        cfg.tokenizer = cfg.model if own else "bytes"
    need(given.get("eval_every") is None or cfg.eval_fraction > 0,
         f"--eval-every {given.get('eval_every')}: there is no eval set; hold one out with "
         f"--eval-fraction F (SFT data), or drop --eval-every")
    _validate(cfg)
    return cfg, ckpt


def _resume_checkpoint(out: Path) -> Path:
    """The newest intact checkpoint, after saying which newer ones are damaged and why.
    Nothing is deleted: a damaged folder stays for inspection (set aside, not removed, when
    its step is saved again)."""
    ckpt, damaged = checkpoint.latest_intact_checkpoint(out)
    if ckpt is None and not damaged:
        raise RefusedError(f"--resume: no complete checkpoint in {out / checkpoint.SUBDIR}; "
                           f"pass the --out of an earlier run, or drop --resume to start anew")
    if ckpt is None:
        raise RefusedError("--resume: every checkpoint is damaged: " + "; ".join(
            f"{d} ({why})" for d, why in damaged) + "; nothing was deleted: restore one from a "
            "copy, or pass --overwrite to start over")
    for d, why in damaged:
        say(f"checkpoint {d} is damaged ({why}); resuming from {ckpt}")
    return ckpt


def say(msg: str) -> None:
    if parallel.quiet_rank():
        return
    print(msg, file=sys.stderr, flush=True)


def need(cond: bool, msg: str) -> None:
    if not cond:
        raise RefusedError(msg)


def _validate(cfg: TrainConfig) -> None:
    for name in ("steps", "seq", "batch_tokens", "grad_accum", "keep"):
        v = getattr(cfg, name)
        need(isinstance(v, int) and v >= 1,
             f"--{name.replace('_', '-')} {v}: must be a whole number >= 1")
    micro = cfg.seq * cfg.grad_accum
    need(cfg.batch_tokens % micro == 0,
         f"--batch-tokens {cfg.batch_tokens}: must be a multiple of --seq x --grad-accum = "
         f"{cfg.seq} x {cfg.grad_accum} = {micro} (each micro-batch holds whole sequences); "
         f"e.g. --batch-tokens {max(1, round(cfg.batch_tokens / micro)) * micro}")
    if cfg.save_every is None:  # never longer than the run: a kill -9 loses at most a quarter
        cfg.save_every = min(500, max(1, cfg.steps // 4))
    need(cfg.save_every >= 0, f"--save-every {cfg.save_every}: must be >= 0 (0: only at the end)")
    need(cfg.save_dtype in SAVE_DTYPES,
         f"--save-dtype {cfg.save_dtype}: choose fp32 (the shards are the exact fp32 weights) or "
         f"bf16 (half-size shards to share; the exact fp32 weights kept for --resume)")
    need(isinstance(cfg.eval_fraction, (int, float)) and 0 <= cfg.eval_fraction < 1,
         f"--eval-fraction {cfg.eval_fraction}: must be at least 0 and below 1 (e.g. 0.05 holds "
         f"out 5% of the SFT examples for eval; 0: no eval)")
    need(cfg.eval_every is None or (isinstance(cfg.eval_every, int) and cfg.eval_every >= 0),
         f"--eval-every {cfg.eval_every}: must be a whole number >= 0 (0: only at the last step)")
    if cfg.eval_every is None:
        cfg.eval_every = cfg.save_every
    need(cfg.stop_after is None or cfg.stop_after >= 1,
         f"--stop-after {cfg.stop_after}: must be >= 1")
    need(cfg.lr is None or (math.isfinite(cfg.lr) and cfg.lr > 0),
         f"--lr {cfg.lr}: must be a positive number such as 3e-4")
    need(cfg.warmup is None or 0 <= cfg.warmup <= cfg.steps,
         f"--warmup {cfg.warmup}: must be between 0 and --steps {cfg.steps}")
    need(math.isfinite(cfg.clip) and cfg.clip >= 0, f"--clip {cfg.clip}: must be >= 0 (0: off)")
    need(cfg.weight_decay >= 0, f"--weight-decay {cfg.weight_decay}: must be >= 0")
    need(0 <= cfg.min_lr_ratio <= 1, f"--min-lr-ratio {cfg.min_lr_ratio}: must be in [0, 1]")
    need(cfg.compile in ("megatrain", "eager"),
         f"--compile {cfg.compile}: choose megatrain or eager")
    need(cfg.data_dtype in ("auto", "uint16", "uint32"),
         f"--data-dtype {cfg.data_dtype}: choose auto, uint16 or uint32")
    if cfg.device is None:
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(cfg.device)
    except (RuntimeError, ValueError):
        raise RefusedError(f"--device {cfg.device}: not a device; use cpu, cuda or cuda:N") from None
    need(dev.type in ("cpu", "cuda"), f"--device {cfg.device}: megatrain trains on cpu or cuda")
    if dev.type == "cuda":
        need(torch.cuda.is_available(),
             f"--device {cfg.device}: no CUDA GPU is visible (torch.cuda.is_available() is "
             f"False); use --device cpu")
        need(dev.index is None or dev.index < torch.cuda.device_count(),
             f"--device {cfg.device}: only {torch.cuda.device_count()} GPU(s); use cuda:0")
    if cfg.precision is None:
        cfg.precision = "bf16" if dev.type == "cuda" else "fp32"
    need(cfg.precision in ("bf16", "fp32"),
         f"--precision {cfg.precision}: choose bf16 (fp32 master, bf16 compute) or fp32")
    plan.parse_bytes(cfg.gpu_memory)
    if cfg.compile == "megatrain":
        _check_backend_options(cfg)
    if cfg.warmup is None:
        cfg.warmup = min(cfg.steps // 10, 2000)


def _check_backend_options(cfg: TrainConfig) -> None:
    """Let the backend judge its options now, not at the first step's compile."""
    try:
        from megatrain.compiler.options import parse_options
    except ImportError:
        return
    try:
        parse_options(backend_options(cfg))
    except (ValueError, TypeError) as e:
        raise RefusedError(f"the megatrain backend rejects its options: {e}") from None
