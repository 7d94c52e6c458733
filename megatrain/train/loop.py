"""The training loop behind `megatrain train`.

Order of work: resolve and check every argument (run_config), find the model (model_source:
megatrain's Llama preset or any transformers causal LM folder) and build it on the meta
device, check its weights' headers, print the memory plan and refuse (RefusedError -> exit
2) if host RAM cannot hold it, read and check the data (feed: plain text or SFT rows); only
then write anything: materialise the model, build the optimizer, restore a checkpoint,
compile (`compile_model`, the one place that calls the backend) and train.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from megatrain.memory import allocator, host_store

from . import (
    RefusedError,
    checkpoint,
    data,
    feed,
    interrupts,
    metrics,
    model_source,
    parallel,
    plan,
    plot,
    tokenizer,
)
from .run_config import (  # noqa: F401  (TrainConfig, resolve_config: this module's API too)
    IDENTITY,
    TRANSIENT,
    TrainConfig,
    backend_options,
    has_own_tokenizer,
    model_name,
    need,
    resolve_config,
    say,
)

# ------------------------------------------------------------------------ backend, optimizer

def resolve_backend():
    """The registered 'megatrain' dynamo backend, or its function when not pip-installed."""
    try:
        from torch._dynamo.backends.registry import lookup_backend
        lookup_backend("megatrain")
        return "megatrain"
    except Exception:  # noqa: BLE001, S110 - not registered (not pip-installed): import it below
        pass
    try:
        from megatrain.compiler.backend import megatrain_backend
        return megatrain_backend
    except Exception as e:  # noqa: BLE001 - ImportError, or an error inside the backend
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


# ------------------------------------------------------------------------------ the run

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
    need(not out.exists() or out.is_dir(),
         f"--out {out}: is a file, not a folder; give a folder for the run (it is created "
         f"if missing), e.g. --out {out.with_suffix('')}-run")
    # A run is what left a checkpoint or a step's row: a first run refused or stopped before
    # its first step (an empty metrics.jsonl) does not block its corrected rerun.
    if not cfg.resume and not cfg.overwrite and (
            checkpoint.list_checkpoints(out) or metrics.read_metrics(out)):
        held = f" ({checkpoint.resume_note(out)})" if checkpoint.list_checkpoints(out) else ""
        raise RefusedError(f"--out {out}: already holds a run{held}; pass --resume to continue "
                           f"it, --overwrite to start over there, or another --out")
    source = model_source.resolve(cfg.model, ckpt)
    need(cfg.save_dtype == "fp32" or source.kind == model_source.TRANSFORMERS,
         f"--save-dtype {cfg.save_dtype}: megatrain's own Llama (--model {cfg.model}) saves its "
         f"fp32 weights, which are what --resume reads; bf16 shards are for transformers model "
         f"folders: drop --save-dtype")
    need(cfg.seq <= source.max_seq, f"--seq {cfg.seq}: longer than the model's max_seq "
                                    f"{source.max_seq}; use --seq {source.max_seq} or less")
    src = data.describe(cfg.data)
    sft_data = feed.check_options(cfg, src, source)
    # the model folder's own tokenizer and any SFT tokenizer through transformers (chat template);
    # a resumed run whose tokenizer folder is gone reads the copy saved with the checkpoint
    spec = cfg.tokenizer
    if ckpt is not None and spec not in ("bytes", "byte") and not Path(spec).exists() and \
            has_own_tokenizer(ckpt):
        spec = str(ckpt)
    tok = tokenizer.load_tokenizer(spec, transformers=sft_data or cfg.tokenizer == cfg.model)
    need(tok.vocab_size <= source.vocab_size,
         f"--tokenizer {cfg.tokenizer}: has {tok.vocab_size} tokens but the model's vocab_size "
         f"is {source.vocab_size}; use a tokenizer that fits the model or a model that fits it")
    if cfg.compile == "megatrain":
        resolve_backend()

    meta = source.meta()
    weights_note = source.check()     # the weights' headers against the model: before any work
    for note in [*source.notes, weights_note]:
        if note:
            say(note)
    n_params = sum(p.numel() for p in meta.parameters())
    if cfg.lr is None:   # fine-tuning pretrained weights: TRL's SFTTrainer default
        cfg.lr = 2e-5 if source.pretrained and ckpt is None else (3e-3 if n_params < 50e6 else 3e-4)
    micro_batch = cfg.batch_tokens // cfg.grad_accum // cfg.seq
    parallel.check_batch(micro_batch, cfg, dinfo)
    _, opt_kind = optimizer_class(cfg)
    pcfg = plan.PlanConfig(
        tokens=micro_batch // dinfo.world_size * cfg.seq, seq=cfg.seq, grad_accum=cfg.grad_accum,
        precision=cfg.precision, device=cfg.device, compile=cfg.compile, optimizer=opt_kind,
        clip=cfg.clip, gpu_memory=plan.parse_bytes(cfg.gpu_memory),
        data_bytes=feed.data_bytes(src, sft_data, tok), saves=cfg.save)
    mplan = plan.plan_memory(meta, pcfg)
    del meta
    avail = host_store.available_host_bytes() if available_bytes is None else available_bytes()
    say(mplan.table(avail))
    plan.check_fits(mplan, avail)
    start = int(checkpoint.read_state(ckpt)["step"]) if ckpt is not None else 0
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, start + cfg.stop_after)
    if cfg.save and dinfo.is_main:
        one = checkpoint.checkpoint_bytes(n_params, source.saved_bytes_per_param(cfg.save_dtype))
        checkpoint.check_disk_room(
            out, one, checkpoint.save_steps(start, end, cfg.save_every), cfg.keep)
    # reading the data checks it (bad lines, ids outside the vocabulary): still before any work
    fed = feed.load(cfg, src, tok, source, micro_batch, dinfo.rank, dinfo.world_size, sft_data)

    # ------------------------------------------------------------------ work starts here
    agreement.agree()  # under torchrun: every rank got here, none refused
    if dinfo.is_main:
        if cfg.overwrite and not cfg.resume:
            shutil.rmtree(checkpoint.checkpoints_root(out), ignore_errors=True)
            (out / metrics.FILENAME).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_partial(out)
    loader = fed.loader

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    t_load = time.perf_counter()
    model = source.build()
    load_s, load_peak = time.perf_counter() - t_load, metrics.peak_rss_bytes()
    if source.pretrained:
        say(f"loaded the weights in {load_s:.1f} s; host RSS peak so far "
            f"{plan.fmt_bytes(load_peak)}")
    device = torch.device(cfg.device)
    if device.type == "cuda":  # before the run's first device allocation (memory/allocator.py)
        allocator.enable_expandable_segments()
    if cfg.compile == "eager":
        model.to(device)
        if device.type == "cuda" and cfg.gpu_memory:
            total = torch.cuda.get_device_properties(device).total_memory
            fraction = min(1.0, plan.parse_bytes(cfg.gpu_memory) / total)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
    opt, opt_kind = make_optimizer(model, cfg, distributed=dinfo.distributed)
    tokens_seen = 0
    if ckpt is not None:   # the weights came with source.build(); here the rest of the state
        state = checkpoint.load_checkpoint(ckpt, model, opt, weights=False)
        loader.load_state_dict(state["data"])
        tokens_seen = int(state.get("tokens_seen", 0))
        say(f"resumed from {ckpt} at step {start}")
    step_fn = compile_model(model, cfg)
    saved_cfg = {k: v for k, v in asdict(cfg).items() if k not in TRANSIENT}

    def save(step: int) -> Path | None:
        if not cfg.save:
            return None
        state = {"tokens_seen": tokens_seen, "data": loader.state_dict(), "config": saved_cfg,
                 **source.state(cfg.save_dtype), "torch_version": torch.__version__,
                 "optimizer": opt_kind, "time": time.time()}
        saved_opt = opt
        if dinfo.distributed:  # a collective: the whole state, on rank 0
            saved_opt = parallel.SavedState(opt.full_state_dict(to_rank=0))
            if not dinfo.is_main:
                return None
        return checkpoint.save_checkpoint(
            out, step, model, saved_opt, state, None, keep=cfg.keep, say=say,
            write_model=lambda folder: source.save(model, folder, tok, cfg.save_dtype))

    if end <= start:
        say(f"nothing to do: {out} is at step {start} of --steps {cfg.steps}; raise --steps to "
            f"train further")
    tokens_per_step = cfg.batch_tokens
    flops_per_step = source.flops_per_token(model, cfg.seq) * tokens_per_step
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                if cfg.compile == "eager" and cfg.precision == "bf16" else contextlib.nullcontext())
    writer = (metrics.MetricsWriter(out, resume_step=start if ckpt is not None else None)
              if dinfo.is_main else parallel.NullWriter())
    where = (f"{dinfo.world_size} ranks ({device.type}, data parallel)" if dinfo.distributed
             else cfg.device)
    say(fed.summary)
    say(f"training {model_name(cfg.model)} ({n_params / 1e6:,.2f} M params) on {where} "
        f"[{cfg.compile}, {cfg.precision}, {opt_kind} AdamW]: steps {start + 1}..{end} of "
        f"{cfg.steps}, {tokens_per_step} tokens/step ({micro_batch} x {cfg.seq} x "
        f"{cfg.grad_accum}), lr {cfg.lr:g} warmup {cfg.warmup} cosine; out {out}")
    bar = _progress(cfg, start)
    t_run, times, losses, last_ckpt = time.perf_counter(), [], [], None
    predicted_s = None  # the backend plan's step, read once the first step compiled it
    stop = interrupts.StopOnSignal(enabled=not dinfo.distributed)

    def evaluate(step: int) -> None:
        """Eval on the held-out rows at its steps (before a save there, so a checkpoint
        always has its eval row); every rank evaluates alike, rank 0 writes."""
        if fed.eval_data is None or not (step == cfg.steps or (
                cfg.eval_every and step % cfg.eval_every == 0)):
            return
        loss = feed.evaluate(step_fn, model, source, fed.eval_data, micro_batch // dinfo.world_size,
                             device if cfg.compile == "eager" else None, autocast)
        writer.write({"step": step, "eval_loss": loss})
        (bar.write if bar is not None else say)(f"eval at step {step}: loss {loss:.4f}")

    try:  # a crash leaves the last complete checkpoint; a signal saves one at the next boundary
        stop.__enter__()
        for step in range(start + 1, end + 1):
            lr = lr_at(step, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            t0 = time.perf_counter()
            loss_sum = 0.0
            for micro in range(cfg.grad_accum):
                batch = fed.next_batch()
                if cfg.compile == "eager":
                    batch = batch.to(device)
                with accumulating(opt, micro == cfg.grad_accum - 1):
                    with autocast:
                        loss = _first_call_refusals(source.loss, step_fn, batch,
                                                    step == start + 1 and micro == 0)
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
                   "device_peak_bytes": metrics.device_peak_bytes(cfg.device),
                   "device_alloc_retries": metrics.device_alloc_retries(cfg.device)}
            writer.write(row)
            if step == start + 1 and cfg.compile == "megatrain":
                note, predicted_s = plan.plan_summary(step_fn, cfg.device)
                (bar.write if bar is not None else say)(note)
            if bar is not None:
                bar.update(1)
                mem = f"host {plan.fmt_bytes(row['host_rss_bytes'])}"
                if row["device_peak_bytes"] is not None:
                    mem += f" dev {plan.fmt_bytes(row['device_peak_bytes'])}"
                bar.set_postfix_str(f"loss {loss_val:.3f} | {row['tokens_per_s'] / 1e3:,.1f}k tok/s "
                                    f"| {row['tflops']:.3g} TFLOP/s | {mem}")
            evaluate(step)
            if stop.requested and step != end:
                last_ckpt = save(step)
                raise interrupts.TrainingInterrupted(
                    f"{stop.requested}: stopped after step {step} and saved it ({last_ckpt}); "
                    f"--resume continues from step {step + 1}" if last_ckpt else
                    f"{stop.requested}: stopped after step {step}; --no-save: nothing saved")
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
    at_end, resident = "", 0
    if cfg.compile == "megatrain" and losses:
        at_end, predicted_end, resident = plan.plan_at_end(step_fn, cfg.device, n_params)
        predicted_s = predicted_end if predicted_end is not None else predicted_s
    summary = {"steps": end, "final_loss": float(np.mean(losses[-10:])) if losses else None,
               "first_loss": losses[0] if losses else None,
               "tokens_per_s": tokens_per_step / float(np.mean(steady)) if steady else None,
               "step_time_s": float(np.mean(steady)) if steady else None,
               "predicted_step_s": predicted_s, "resident_params": resident,
               "checkpoint": str(last_ckpt) if last_ckpt else None,
               "plot": str(png) if png else None, "out": str(out),
               "wall_s": time.perf_counter() - t_run, "load_s": load_s,
               "load_peak_rss_bytes": load_peak}
    if losses:
        say(f"done: step {end}, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
            f"{summary['tokens_per_s']:,.0f} tokens/s, step {plan.fmt_seconds(summary['step_time_s'])}"
            + (f" ({at_end})" if at_end else "")
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


def _first_call_refusals(loss_fn, step_fn, batch, first: bool):
    """The backend compiles on the first call and checks its budget then, before any compute:
    a budget or option it refuses is the user's to fix (exit 2), not a crash."""
    if not first:
        return loss_fn(step_fn, batch)
    try:
        from megatrain.errors import MegatrainTypeError, MegatrainValueError
    except ImportError:
        return loss_fn(step_fn, batch)
    try:
        return loss_fn(step_fn, batch)
    except (MegatrainValueError, MegatrainTypeError) as e:
        raise RefusedError(str(e)) from None
