"""One system of bench/hf_train.py in a child process: build a Hugging Face model from its
config (bench/hf_models.py), set it up as the system trains it, train it on the shipped
corpus for the timed steps with the model's own loss (labels passed in) and return its
row. Kept apart from the parent so that each system's memory, pinned pools and compile
state live and die in its own process.

Systems:
  resident-compiled  the model on the GPU, fp32 master weights, torch.optim.AdamW(fused=True)
                     there, bf16 autocast, Hugging Face's gradient checkpointing on,
                     torch.compile with the default backend: what a user of transformers
                     does when the model fits
  megatrain          torch.compile(model, backend="megatrain", options={"gpu_memory": ...,
                     "outputs": "loss"}) with megatrain.AdamW (the loop reads only the loss:
                     the logits are never copied to the host); the planner decides
                     everything else unless a variant forces a megatrain.config decision
                     (megatrain+updates=host) or the outputs (megatrain+outputs=all)
"""

from __future__ import annotations

import statistics
import sys
import time

import child_phase
import hf_models
from fit_check import _oom_line, _out_of_memory, _refuse_if_unfit
from host_memory import _memory_now, _PinnedWatch, _rss_phases, _status
from megatrain_stats import _megatrain_stats, host_rates_again
from presets import _tokens
from step_diagnostics import _memory_at_peak, _profile_step, compile_split
from systems import _load_cuda_libraries

SYSTEMS = ("resident-compiled", "megatrain")


def parse_forced(items: list[str] | None) -> dict:
    """`--force name=value` (what the variant megatrain+name=value passes): megatrain.config
    decisions by name, "-" read as "_", the value as an int, a float, true/false/none or a
    comma-separated list where it reads as one, else the string; megatrain.config and the
    backend validate both. `huge_pages=off` is the environment switch MEGATRAIN_HUGE_PAGES=0
    (megatrain's host state on torch's allocator), not a config knob."""
    forced = {}
    for item in items or ():
        name, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--force {item!r}: give name=value (a megatrain.config decision)")
        forced[name.strip().replace("-", "_")] = _value(text.strip())
    return forced


def _value(text: str):
    low = text.lower()
    if low in ("true", "on"):
        return True
    if low in ("false", "off"):
        return False
    if low == "none":
        return None
    if "," in text:
        return [_value(t) for t in text.split(",")]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def run_probe(args) -> dict:
    """bench/probe_rates.py's probe (bf16 matmul for MFU, pinned H2D and host AdamW rates
    for the step bound) at this model's MLP shape. The probe reads the shape from the
    presets of bench/train.py, which know only megatrain's Llama; this child process is
    the probe's alone, so the shape lookup is replaced here rather than the probe copied."""
    from types import SimpleNamespace

    import probe_rates

    hidden, ffn = hf_models.mlp_shape(args.model)
    probe_rates._config = lambda name: SimpleNamespace(hidden=hidden, ffn=ffn)
    return probe_rates.run_probe(args)


def run_child(args) -> dict:
    """The child's row, an allocation failure turned into one line (SystemExit)."""
    n_params = hf_models.param_count(args.model, args.smoke)
    try:
        return run_probe(args) if args.system == "probe" else run_system(args, n_params)
    except Exception as e:
        oom = _out_of_memory(e)
        if oom is None:
            raise
        raise SystemExit(_oom_line(*oom, args, n_params)) from None


def run_system(args, n_params: int) -> dict:
    """Build and train `args.system` for the timed steps in this (child) process and return
    its row: step times and rates, time to the first step, peak GPU and host memory,
    losses, dynamo's graphs and breaks and, for megatrain, its runtime's own figures."""
    import torch
    from torch._dynamo.utils import counters

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        _load_cuda_libraries(device)
    _refuse_if_unfit(args.system, n_params, device)
    forced = parse_forced(args.force)
    if forced and args.system != "megatrain":
        raise SystemExit(f"{args.system}: --force sets megatrain.config decisions; megatrain only")
    if forced:  # before the build, which takes a minute at 6B
        import megatrain

        for name in forced:
            if name not in megatrain.config.DECISIONS + ("huge_pages", "outputs"):
                raise SystemExit(f"megatrain+{name}=...: not a megatrain.config decision; "
                                 f"decisions: {', '.join(megatrain.config.DECISIONS)}")
    rss_base, anon_base = _status("VmRSS"), _status("RssAnon")
    rss = {}

    def mark(point: str) -> None:
        rss[point] = _memory_now()

    start = time.perf_counter()  # time to the first step counts from here
    child_phase.phase = "building the model"
    model, attn, attn_refused = hf_models.build(args.model, args.smoke)
    build_s = time.perf_counter() - start
    mark("built")
    child_phase.phase = "setting up"
    cfg = model.config
    batch = args.tokens // args.seq
    # one batch per step; labels are the inputs: the model shifts them for its own loss
    data = _tokens(args.tokens * args.steps, cfg.vocab_size).view(-1, batch, args.seq)
    flops_per_token = hf_models.flops_per_token(model, args.seq)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    counters.clear()

    if args.system == "resident-compiled":
        model = model.to(device)
        checkpointing = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # gradient_checkpointing_enable's new name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        # Hugging Face's checkpointed layer sets a context variable, a side effect dynamo will
        # not replay in the recompute, so it breaks the graph at every layer; its message
        # names this switch, which a user who reads it turns on: one graph, as a baseline
        # of what torch.compile does with the model should be.
        if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step_fn, to_device = torch.compile(model), True
    elif args.system == "megatrain":
        import os

        import megatrain

        decisions = dict(forced)
        if decisions.pop("huge_pages", True) is False:  # before anything allocates host state
            os.environ["MEGATRAIN_HUGE_PAGES"] = "0"
        if cuda:  # the cost model plans with this machine's rates (probed once, cached)
            from megatrain.runtime.probe import load_or_probe

            load_or_probe(device)
        opt = megatrain.AdamW(model.parameters(), lr=1e-4)
        # a training loop reads only the loss: the consent option (megatrain+outputs=all
        # times the default instead, every output copied back to the host like eager)
        options = {"device": args.device, "precision": args.precision,
                   "outputs": decisions.pop("outputs", "loss")}
        if args.gpu_memory:
            options["gpu_memory"] = args.gpu_memory
        # a variant's decisions, one system per process: the config module is this run's
        for name, value in decisions.items():
            setattr(megatrain.config, name, value)
        step_fn, to_device = torch.compile(model, backend="megatrain", options=options), False
        autocast = torch.autocast(device.type, enabled=False)  # the backend's precision
    else:
        raise SystemExit(f"unknown system {args.system!r}; choose from {', '.join(SYSTEMS)}")

    def run_steps(count: int, first: bool, at: int = 0) -> tuple[list[float], list[float]]:
        """`count` steps on batches at..: their times and losses; the host time in each call
        into `calls` (the host runs ahead of the GPU until something waits)."""
        times, losses = [], []
        for i in range(count):
            tag = " (compiling)" if first and i == 0 else ""
            x = data[(at + i) % len(data)]
            if to_device:
                x = x.to(device, non_blocking=True)
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            child_phase.phase = f"step {at + i} forward{tag}"
            with autocast:
                loss = step_fn(input_ids=x, labels=x).loss
            t1 = time.perf_counter()
            child_phase.phase = f"step {at + i} backward{tag}"
            loss.backward()
            t2 = time.perf_counter()
            child_phase.phase = f"step {at + i} optimizer"
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            calls.append({"forward_call_s": t1 - t0, "backward_call_s": t2 - t1, "optimizer_call_s": t3 - t2,
                          "final_sync_s": times[-1] - (t3 - t0)})
            losses.append(float(loss.detach()))
            print(f"  {args.system} {args.model} step {at + i}: {times[-1]:.3f} s, loss {losses[-1]:.4f}",
                  file=sys.stderr)
        return times, losses

    calls: list[dict] = []
    mark("set_up")
    with _PinnedWatch() as pinned_watch:  # the first step compiles: untimed
        times, losses = run_steps(1, first=True)
    first_step_s = time.perf_counter() - start
    mark("first_step")
    graphs = counters["stats"]["unique_graphs"]
    breaks = dict(counters["graph_break"])
    more, more_losses = run_steps(args.steps - 1, first=False, at=1)
    times, losses = times + more, losses + more_losses
    if args.profile:
        args.layers = cfg.num_hidden_layers  # names the profile's file
        _profile_step(args, lambda: run_steps(1, first=False))
    step = statistics.median(times[args.warmup:]) if len(times) > args.warmup else times[-1]
    timed = calls[args.warmup:args.steps] or calls[args.steps - 1:args.steps]
    row = {
        "system": args.system, "model": args.model, "family": hf_models.family(args.model),
        "layers": cfg.num_hidden_layers, "params": n_params, "tokens_per_step": args.tokens,
        "seq": args.seq, "step_s": step, "tokens_per_s": args.tokens / step,
        "tflops": flops_per_token * args.tokens / step / 1e12, "flops_per_token": flops_per_token,
        "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "host_rss_gib": _status("VmHWM") / 2**30,
        # peak RSS over the process's RSS before the model existed (CUDA context included)
        "host_bytes_per_param": (_status("VmHWM") - rss_base) / n_params,
        "host_rss_base_gib": rss_base / 2**30,
        "host_bytes_per_param_phases": _rss_phases(rss, rss_base, anon_base, n_params),
        "pinned_growth": pinned_watch.events,
        "gpu_memory": args.gpu_memory if args.system == "megatrain" else None,
        "outputs": options.get("outputs") if args.system == "megatrain" else None,
        "steps": times, "losses": losses, "final_loss": losses[-1],
        # wall time from the start of the model's build to the end of step 1 (compiling
        # included), the build's share of it and step 1's own
        "first_step_s": first_step_s, "build_s": build_s, "compile_step_s": times[0],
        # torch's compile timers over the whole process (dynamo, AOT, Inductor's stages)
        "compile_split_s": compile_split(),
        "attn_implementation": attn, "attn_sdpa_refused": attn_refused,
        "experts_implementation": getattr(cfg, "_experts_implementation", None)
        if getattr(cfg, "num_experts", None) else None,
        # dynamo's graphs and breaks over the first step (Hugging Face's gradient
        # checkpointing, a data-dependent expert loop, ...), by reason
        "dynamo_graphs": graphs, "graph_breaks": {k[:400]: v for k, v in list(breaks.items())[:4]},
        "smoke": bool(args.smoke),
        # what the row forced (readme_table leaves forced rows out of the README's table)
        "updates": forced.get("updates"), "prefetch": forced.get("prefetch"),
        "forced": forced or None,
        **{k: statistics.median(c[k] for c in timed) for k in timed[0]},
    }
    if args.system == "megatrain":
        row.update(_megatrain_stats(step_fn))
        if cuda:
            row["host_rates_after_run"] = host_rates_again(device)
        row["dynamo_graphs"] = row["dynamo_graphs"] or len(megatrain.explain(step_fn).graphs)
        # step 1 less the backend's phases and a steady step: dynamo's tracing, mostly
        row["compile_dynamo_s"] = times[0] - sum(row["compile_phases_s"].values()) - step
        row["pcie_gbs"] = (row["h2d_bytes"] + row["d2h_bytes"]) / times[-1] / 1e9
        row["h2d_copy_gbs"] = row["h2d_bytes"] / row["h2d_busy_s"] / 1e9 if row["h2d_busy_s"] else None
    if args.memory_peak and cuda:  # last: it resets the allocator's peak statistics
        try:
            row["memory_at_peak"] = _memory_at_peak(args, device, lambda: run_steps(1, first=False))
        except Exception as e:  # noqa: BLE001 -- a diagnostic must not cost the run its row
            row["memory_at_peak_error"] = repr(e)[:2000]
    return row
