"""The training loop behind `megatrain train`.

Order of work: resolve and check every argument, build the model on the meta device, print
the memory plan and refuse (RefusedError -> exit 2) if host RAM cannot hold it; only then
read the data, materialise the model, build the optimizer, restore a checkpoint, compile
(`compile_model`, the one place that calls the backend) and train.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from megatrain.models import PRESETS, Llama
from megatrain.memory import host_store

from . import RefusedError, checkpoint, data, hf, interrupts, metrics, parallel, plan, plot, tokenizer


@dataclass
class TrainConfig:
    model: str = "tiny"
    data: str | None = None             # None: the shipped corpus
    tokenizer: str = "bytes"
    data_dtype: str = "auto"            # for .bin token files: auto | uint16 | uint32
    steps: int = 200
    seq: int = 256
    batch_tokens: int = 4096            # tokens per optimizer step (all micro-batches)
    grad_accum: int = 1
    lr: float | None = None             # None: 3e-3 below 50M params, else 3e-4
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
    keep: int = 2                       # complete checkpoints kept
    seed: int = 0
    resume: bool = False
    overwrite: bool = False
    stop_after: int | None = None       # stop after this many steps of this invocation
    progress: bool = True


# Fields a resumed run must share with its checkpoint (they fix the data and the model);
# fields that only steer this invocation are not saved with the run.
IDENTITY = ("model", "data", "tokenizer", "data_dtype", "seq", "batch_tokens", "grad_accum", "seed")
TRANSIENT = ("resume", "overwrite", "stop_after", "progress", "out")


# ------------------------------------------------------------------------ backend, optimizer

def resolve_backend():
    """The registered 'megatrain' dynamo backend, or its function when not pip-installed."""
    try:
        from torch._dynamo.backends.registry import lookup_backend
        lookup_backend("megatrain")
        return "megatrain"
    except Exception:
        pass
    try:
        from megatrain.compiler.backend import megatrain_backend
        return megatrain_backend
    except Exception as e:  # ImportError, or an error inside the half-written backend
        raise RefusedError(
            f"--compile megatrain: the megatrain torch.compile backend is not available "
            f"({type(e).__name__}: {e}); use --compile eager (plain torch on --device)"
        ) from None


def compile_model(model: torch.nn.Module, cfg: TrainConfig):
    """The one place the backend is called. Eager returns the model itself."""
    if cfg.compile == "eager":
        return model
    options = backend_options(cfg)
    if torch.device(cfg.device).type == "cpu":
        # Resume is exact only if a step computes the same bits every time. Inductor's CPU
        # code accumulates the embedding gradient with atomic adds, whose order varies
        # between runs with 2+ threads; deterministic mode makes it use ATen's index_put.
        torch.use_deterministic_algorithms(True, warn_only=True)
    return torch.compile(model, backend=resolve_backend(), options=options)


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


def optimizer_class(cfg: TrainConfig):
    """megatrain.AdamW (host optimizer) when it exists and the backend streams, else torch's."""
    if cfg.compile == "megatrain":
        try:
            from megatrain.optim import AdamW
            return AdamW, "megatrain"
        except ImportError:
            pass
    return torch.optim.AdamW, "torch"


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, distributed: bool = False):
    """AdamW over two groups (decay on matrices only); under torchrun megatrain's is the
    sharded one (megatrain.ShardedAdamW: gradients averaged over ranks, state split)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    cls, kind = optimizer_class(cfg)
    if distributed and kind == "megatrain":
        from megatrain.distributed import ShardedAdamW
        cls = ShardedAdamW
    kwargs = {"lr": cfg.lr, "betas": (0.9, 0.95), "eps": 1e-8}
    params = inspect.signature(cls).parameters
    if kind == "megatrain" and cfg.clip and "max_grad_norm" in params:
        kwargs["max_grad_norm"] = cfg.clip     # the fast path clips inside the optimizer
    if kind == "torch" and all(p.device.type in ("cpu", "cuda") for p in model.parameters()):
        kwargs["fused"] = True
    return cls(groups, **kwargs), kind


def clip_gradients(model, opt, max_norm: float) -> float | None:
    """Clip p.grad before opt.step(); None when the optimizer clips inside step() itself
    (megatrain.AdamW(max_grad_norm=...): read `grad_norm_after_step` then)."""
    if not max_norm or getattr(opt, "max_grad_norm", None):
        return None
    grads = [p for p in model.parameters() if p.grad is not None]
    if not grads:
        raise RuntimeError("--clip needs the gradients in p.grad, but the optimizer consumed "
                           "them; pass --clip 0")
    return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))


def grad_norm_after_step(opt) -> float | None:
    norm = getattr(opt, "last_grad_norm", None) if getattr(opt, "max_grad_norm", None) else None
    return None if norm is None else float(norm)


def accumulating(opt, last_micro_batch: bool):
    """megatrain.AdamW applies each region's update during backward unless told that more
    micro-batches follow (`opt.accumulate()`, like DDP's no_sync); torch's needs nothing."""
    if last_micro_batch or not hasattr(opt, "accumulate"):
        return contextlib.nullcontext()
    return opt.accumulate()


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to --lr over `warmup` steps, then cosine to lr*min_lr_ratio at --steps."""
    if step <= cfg.warmup:
        return cfg.lr * step / max(1, cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


# ------------------------------------------------------------------------ argument checks

def _model_name(model: str) -> str:
    return model if model in PRESETS else (Path(model).name or "model")


def _absolute(value: str | None) -> str | None:
    if value is None or value in PRESETS or value in ("bytes", "byte"):
        return value
    return str(Path(value).expanduser().resolve()) if Path(value).expanduser().exists() else value


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
    out = Path(given.get("out") or Path("runs") / _model_name(model))
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
        _say(f"checkpoint {d} is damaged ({why}); resuming from {ckpt}")
    return ckpt


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise RefusedError(msg)


def _validate(cfg: TrainConfig) -> None:
    for name in ("steps", "seq", "batch_tokens", "grad_accum", "keep"):
        v = getattr(cfg, name)
        _need(isinstance(v, int) and v >= 1,
              f"--{name.replace('_', '-')} {v}: must be a whole number >= 1")
    micro = cfg.seq * cfg.grad_accum
    _need(cfg.batch_tokens % micro == 0,
          f"--batch-tokens {cfg.batch_tokens}: must be a multiple of --seq x --grad-accum = "
          f"{cfg.seq} x {cfg.grad_accum} = {micro} (each micro-batch holds whole sequences); "
          f"e.g. --batch-tokens {max(1, round(cfg.batch_tokens / micro)) * micro}")
    if cfg.save_every is None:  # never longer than the run: a kill -9 loses at most a quarter
        cfg.save_every = min(500, max(1, cfg.steps // 4))
    _need(cfg.save_every >= 0, f"--save-every {cfg.save_every}: must be >= 0 (0: only at the end)")
    _need(cfg.stop_after is None or cfg.stop_after >= 1,
          f"--stop-after {cfg.stop_after}: must be >= 1")
    _need(cfg.lr is None or (math.isfinite(cfg.lr) and cfg.lr > 0),
          f"--lr {cfg.lr}: must be a positive number such as 3e-4")
    _need(cfg.warmup is None or 0 <= cfg.warmup <= cfg.steps,
          f"--warmup {cfg.warmup}: must be between 0 and --steps {cfg.steps}")
    _need(math.isfinite(cfg.clip) and cfg.clip >= 0, f"--clip {cfg.clip}: must be >= 0 (0: off)")
    _need(cfg.weight_decay >= 0, f"--weight-decay {cfg.weight_decay}: must be >= 0")
    _need(0 <= cfg.min_lr_ratio <= 1, f"--min-lr-ratio {cfg.min_lr_ratio}: must be in [0, 1]")
    _need(cfg.compile in ("megatrain", "eager"),
          f"--compile {cfg.compile}: choose megatrain or eager")
    _need(cfg.data_dtype in ("auto", "uint16", "uint32"),
          f"--data-dtype {cfg.data_dtype}: choose auto, uint16 or uint32")
    if cfg.device is None:
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(cfg.device)
    except (RuntimeError, ValueError):
        raise RefusedError(f"--device {cfg.device}: not a device; use cpu, cuda or cuda:N") from None
    _need(dev.type in ("cpu", "cuda"), f"--device {cfg.device}: megatrain trains on cpu or cuda")
    if dev.type == "cuda":
        _need(torch.cuda.is_available(),
              f"--device {cfg.device}: no CUDA GPU is visible (torch.cuda.is_available() is "
              f"False); use --device cpu")
        _need(dev.index is None or dev.index < torch.cuda.device_count(),
              f"--device {cfg.device}: only {torch.cuda.device_count()} GPU(s); use cuda:0")
    if cfg.precision is None:
        cfg.precision = "bf16" if dev.type == "cuda" else "fp32"
    _need(cfg.precision in ("bf16", "fp32"),
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


def _model_spec(cfg: TrainConfig, ckpt: Path | None):
    """(LlamaConfig, HF config to extend when saving, safetensors files to start from)."""
    if ckpt is not None:
        raw = hf.read_config(ckpt)
        return hf.llama_config_from_hf(raw, str(ckpt / "config.json")), raw, []
    if cfg.model in PRESETS:
        return dataclasses.replace(PRESETS[cfg.model]), None, []
    path = Path(cfg.model)
    if hf.is_hf_folder(path):
        raw = hf.read_config(path)
        return hf.llama_config_from_hf(raw, str(path / "config.json")), raw, hf.weight_files(path)
    if path.is_dir():
        raise RefusedError(f"--model {cfg.model}: the folder has no config.json; point at a "
                           f"Hugging Face model folder or use a preset ({', '.join(PRESETS)})")
    raise RefusedError(f"--model {cfg.model}: neither a preset ({', '.join(PRESETS)}) nor a "
                       f"folder with a Hugging Face config.json")


# ------------------------------------------------------------------------------ the run

def _say(msg: str) -> None:
    if parallel.quiet_rank():
        return
    print(msg, file=sys.stderr, flush=True)


def train(given: dict, available_bytes=None) -> dict:
    """Run `megatrain train`; `given` holds the arguments the user set. Returns a summary.

    Raises RefusedError before any work when an argument is wrong or the plan cannot fit.
    Under torchrun, trains data parallel (see megatrain.train.parallel).
    """
    cfg, ckpt = resolve_config(given)
    dinfo = parallel.start(cfg)
    agreement = parallel.Agreement(dinfo)
    try:
        summary = _train(cfg, ckpt, dinfo, agreement, available_bytes)
    except RefusedError as e:
        try:
            agreement.refuse(e)
        finally:
            _shutdown(dinfo)
    _shutdown(dinfo)
    return summary


def _shutdown(dinfo) -> None:
    from megatrain.distributed import shutdown
    shutdown(dinfo)


def _train(cfg: TrainConfig, ckpt: Path | None, dinfo, agreement, available_bytes) -> dict:
    out = Path(cfg.out)
    _need(not out.exists() or out.is_dir(),
          f"--out {out}: is a file, not a folder; give a folder for the run (it is created "
          f"if missing), e.g. --out {out.with_suffix('')}-run")
    # A run is what left a checkpoint or a step's row: a first run refused or stopped before
    # its first step (an empty metrics.jsonl) does not block its corrected rerun.
    if not cfg.resume and not cfg.overwrite and (
            checkpoint.list_checkpoints(out) or metrics.read_metrics(out)):
        held = f" ({checkpoint.resume_note(out)})" if checkpoint.list_checkpoints(out) else ""
        raise RefusedError(f"--out {out}: already holds a run{held}; pass --resume to continue "
                           f"it, --overwrite to start over there, or another --out")
    lcfg, hf_base, init_files = _model_spec(cfg, ckpt)
    _need(cfg.seq <= lcfg.max_seq, f"--seq {cfg.seq}: longer than the model's max_seq "
                                   f"{lcfg.max_seq}; use --seq {lcfg.max_seq} or less")
    tok = tokenizer.load_tokenizer(cfg.tokenizer)
    _need(tok.vocab_size <= lcfg.vocab_size,
          f"--tokenizer {cfg.tokenizer}: has {tok.vocab_size} tokens but the model's vocab_size "
          f"is {lcfg.vocab_size}; use a tokenizer that fits the model or a model that fits it")
    src = data.describe(cfg.data)
    if cfg.compile == "megatrain":
        resolve_backend()

    with torch.device("meta"):
        meta = Llama(lcfg)
    if init_files:
        hf.load_weights(meta, init_files, check_only=True)
    n_params = sum(p.numel() for p in meta.parameters())
    if cfg.lr is None:
        cfg.lr = 3e-3 if n_params < 50e6 else 3e-4
    micro_batch = cfg.batch_tokens // cfg.grad_accum // cfg.seq
    parallel.check_batch(micro_batch, cfg, dinfo)
    _, opt_kind = optimizer_class(cfg)
    pcfg = plan.PlanConfig(
        tokens=micro_batch // dinfo.world_size * cfg.seq, seq=cfg.seq, grad_accum=cfg.grad_accum,
        precision=cfg.precision, device=cfg.device, compile=cfg.compile, optimizer=opt_kind,
        clip=cfg.clip,
        gpu_memory=plan.parse_bytes(cfg.gpu_memory), data_bytes=src.in_memory_bytes())
    mplan = plan.plan_memory(meta, pcfg)
    del meta
    avail = host_store.available_host_bytes() if available_bytes is None else available_bytes()
    _say(mplan.table(avail))
    plan.check_fits(mplan, avail)

    # ------------------------------------------------------------------ work starts here
    agreement.agree()  # under torchrun: every rank got here, none refused
    if dinfo.is_main:
        if cfg.overwrite and not cfg.resume:
            shutil.rmtree(checkpoint.checkpoints_root(out), ignore_errors=True)
            (out / metrics.FILENAME).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_partial(out)
    tokens = data.load_tokens(src, tok, lcfg.vocab_size, cfg.data_dtype)
    _need(len(tokens) > cfg.seq,
          f"--data {src.path}: {len(tokens)} tokens, too few for one sequence of --seq "
          f"{cfg.seq} (needs {cfg.seq + 1}); use a smaller --seq or more data")
    loader = data.TokenLoader(tokens, cfg.seq, micro_batch, cfg.seed,
                              rank=dinfo.rank, world=dinfo.world_size)

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model = Llama(lcfg)
    if init_files:
        hf.load_weights(model, init_files)
    device = torch.device(cfg.device)
    if cfg.compile == "eager":
        model.to(device)
        if device.type == "cuda" and cfg.gpu_memory:
            total = torch.cuda.get_device_properties(device).total_memory
            fraction = min(1.0, plan.parse_bytes(cfg.gpu_memory) / total)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
    opt, opt_kind = make_optimizer(model, cfg, distributed=dinfo.distributed)
    start, tokens_seen = 0, 0
    if ckpt is not None:
        state = checkpoint.load_checkpoint(ckpt, model, opt)
        loader.load_state_dict(state["data"])
        start, tokens_seen = int(state["step"]), int(state.get("tokens_seen", 0))
        _say(f"resumed from {ckpt} at step {start}")
    step_fn = compile_model(model, cfg)
    hf_config = hf.hf_config_from_llama(lcfg, hf_base)
    saved_cfg = {k: v for k, v in asdict(cfg).items() if k not in TRANSIENT}

    def save(step: int) -> Path:
        state = {"tokens_seen": tokens_seen, "data": loader.state_dict(), "config": saved_cfg,
                 "model_config": asdict(lcfg), "torch_version": torch.__version__,
                 "optimizer": opt_kind, "time": time.time()}
        saved_opt = opt
        if dinfo.distributed:  # a collective: the whole state, on rank 0
            saved_opt = parallel.SavedState(opt.full_state_dict(to_rank=0))
            if not dinfo.is_main:
                return None
        return checkpoint.save_checkpoint(out, step, model, saved_opt, state, hf_config,
                                          tok.files(), keep=cfg.keep, say=_say)

    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, start + cfg.stop_after)
    if end <= start:
        _say(f"nothing to do: {out} is at step {start} of --steps {cfg.steps}; raise --steps to "
             f"train further")
    tokens_per_step = cfg.batch_tokens
    flops_per_step = plan.model_flops_per_token(model, cfg.seq) * tokens_per_step
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                if cfg.compile == "eager" and cfg.precision == "bf16" else contextlib.nullcontext())
    writer = (metrics.MetricsWriter(out, resume_step=start if ckpt is not None else None)
              if dinfo.is_main else parallel.NullWriter())
    where = (f"{dinfo.world_size} ranks ({device.type}, data parallel)" if dinfo.distributed
             else cfg.device)
    _say(f"training {_model_name(cfg.model)} ({n_params / 1e6:,.2f} M params) on {where} "
         f"[{cfg.compile}, {cfg.precision}, {opt_kind} AdamW]: steps {start + 1}..{end} of "
         f"{cfg.steps}, {tokens_per_step} tokens/step ({micro_batch} x {cfg.seq} x "
         f"{cfg.grad_accum}), lr {cfg.lr:g} warmup {cfg.warmup} cosine; data {src.path} "
         f"({len(tokens):,} tokens); out {out}")
    bar = _progress(cfg, start)
    t_run, times, losses, last_ckpt = time.perf_counter(), [], [], None
    predicted_s = None  # the backend plan's step, read once the first step compiled it
    stop = interrupts.StopOnSignal(enabled=not dinfo.distributed)
    try:  # a crash leaves the last complete checkpoint; a signal saves one at the next boundary
        stop.__enter__()
        for step in range(start + 1, end + 1):
            lr = lr_at(step, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            t0 = time.perf_counter()
            loss_sum = 0.0
            for micro in range(cfg.grad_accum):
                x, y = loader.next_batch()
                if cfg.compile == "eager":
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with accumulating(opt, micro == cfg.grad_accum - 1):
                    with autocast:
                        loss = _first_call_refusals(step_fn, x, y, step == start + 1 and micro == 0)
                    (loss / cfg.grad_accum).backward()
                loss_sum += float(loss.detach())
            gnorm = clip_gradients(model, opt, cfg.clip)
            opt.step()
            if gnorm is None:
                gnorm = grad_norm_after_step(opt)
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            loss_val = parallel.mean_over_ranks(loss_sum, dinfo) / cfg.grad_accum
            if not math.isfinite(loss_val):
                raise FloatingPointError(f"loss is {loss_val} at step {step}; lower --lr "
                                         f"({cfg.lr:g}) or keep --clip on; the last checkpoint "
                                         f"is intact")
            tokens_seen += tokens_per_step
            times.append(dt)
            losses.append(loss_val)
            row = {"step": step, "loss": loss_val, "lr": lr, "tokens_per_s": tokens_per_step / dt,
                   "tflops": flops_per_step / dt / 1e12, "grad_norm": gnorm, "step_time_s": dt,
                   "tokens": tokens_seen, "elapsed_s": time.perf_counter() - t_run,
                   "host_rss_bytes": metrics.host_rss_bytes(),
                   "device_peak_bytes": metrics.device_peak_bytes(cfg.device, step_fn)}
            writer.write(row)
            if step == start + 1 and cfg.compile == "megatrain":
                note, predicted_s = plan.plan_summary(step_fn, cfg.device)
                (bar.write if bar is not None else _say)(note)
            if bar is not None:
                bar.update(1)
                mem = f"host {plan.fmt_bytes(row['host_rss_bytes'])}"
                if row["device_peak_bytes"] is not None:
                    mem += f" dev {plan.fmt_bytes(row['device_peak_bytes'])}"
                bar.set_postfix_str(f"loss {loss_val:.3f} | {row['tokens_per_s'] / 1e3:,.1f}k tok/s "
                                    f"| {row['tflops']:.3g} TFLOP/s | {mem}")
            if stop.requested and step != end:
                last_ckpt = save(step)
                raise interrupts.TrainingInterrupted(
                    f"{stop.requested}: stopped after step {step} and saved it ({last_ckpt}); "
                    f"--resume continues from step {step + 1}")
            if cfg.save_every and step % cfg.save_every == 0 and step != end:
                last_ckpt = save(step)
    except KeyboardInterrupt:  # a second signal: stop now, keep the last complete checkpoint
        raise interrupts.TrainingInterrupted(
            "stopped at once on a second signal; " + checkpoint.resume_note(out)) from None
    finally:
        stop.__exit__()
        writer.close()
        if bar is not None:
            bar.close()
    if end > start:
        last_ckpt = save(end)
    png = plot.plot_metrics(out) if dinfo.is_main and metrics.read_metrics(out) else None
    steady = times[1:] or times
    summary = {"steps": end, "final_loss": float(np.mean(losses[-10:])) if losses else None,
               "first_loss": losses[0] if losses else None,
               "tokens_per_s": tokens_per_step / float(np.mean(steady)) if steady else None,
               "step_time_s": float(np.mean(steady)) if steady else None,
               "predicted_step_s": predicted_s, "checkpoint": str(last_ckpt) if last_ckpt else None,
               "plot": str(png) if png else None, "out": str(out),
               "wall_s": time.perf_counter() - t_run}
    if losses:
        _say(f"done: step {end}, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
             f"{summary['tokens_per_s']:,.0f} tokens/s, step {plan.fmt_seconds(summary['step_time_s'])}"
             + (f" (plan: {plan.fmt_seconds(predicted_s)})" if predicted_s is not None else "")
             + f"; checkpoint {last_ckpt}; plot {png}")
    return summary


def _progress(cfg: TrainConfig, start: int):
    if not cfg.progress or parallel.quiet_rank():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True,
                mininterval=0.5, file=sys.stderr)


def _first_call_refusals(step_fn, x, y, first: bool):
    """The backend compiles on the first call and checks its budget then, before any compute:
    a budget or option it refuses is the user's to fix (exit 2), not a crash."""
    if not first:
        return step_fn(x, labels=y)
    try:
        from megatrain.errors import MegatrainTypeError, MegatrainValueError
    except ImportError:
        return step_fn(x, labels=y)
    try:
        return step_fn(x, labels=y)
    except (MegatrainValueError, MegatrainTypeError) as e:
        raise RefusedError(str(e)) from None
