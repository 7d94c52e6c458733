"""One system of bench/train.py in a child process: build it (GPU-resident torch with or
without torch.compile, FSDP2 CPU offload, DeepSpeed ZeRO-3 offload, megatrain), train the
same model on the same tokens for the timed steps (plus the thread and slab sweeps), and
return its row. Kept apart from the parent so that each system's memory, pinned pools and
compile state live and die in its own process."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import child_phase
from fit_check import _refuse_if_unfit
from host_memory import (
    _largest_mappings,
    _memory_now,
    _pinned_holders,
    _PinnedWatch,
    _rss_phases,
    _smaps_rollup,
    _status,
)
from megatrain_stats import _megatrain_stats, _streamers, host_rates_again
from presets import _config, _model, _param_count, _tokens
from step_diagnostics import _memory_at_peak, _profile_step, compile_split


def _zero3_offload(model, batch: int, cuda: bool):
    """DeepSpeed ZeRO-3 at world size 1 with parameters and optimizer state offloaded to
    pinned host memory (ZeRO-Infinity's CPU offload): bf16 compute, fp32 master weights and
    AdamW moments in DeepSpeed's CPU Adam, the same learning rate and weight decay as the
    other systems, per-layer checkpointing. Returns (engine, optimizer shim, backward): the
    engine runs backward and the step itself (gradient partitioning and offload hooks)."""
    try:
        import deepspeed
    except ImportError as e:
        raise SystemExit(f"deepspeed is not importable here ({e}); carry its wheels to run it "
                         "(bench/results/NOTES.md, session 10, says which)")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29534"), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    _checkpoint_layers(model)
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        # torch.optim.AdamW's defaults but the rate, as the other systems here use
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    class EngineStep:
        """opt.step() / opt.zero_grad() for the bench's loop: the engine's step zeroes."""

        def step(self):
            engine.step()

        def zero_grad(self, set_to_none: bool = True):
            pass

    return engine, EngineStep(), engine.backward


def layer_forward_flops_per_token(model, seq: int) -> float:
    """A per-layer checkpointed backward's recompute: every decoder layer's forward again,
    2 FLOPs per matmul parameter of the layers and attention's 4 L h seq (the forward's
    third of model_flops_per_token's 12 L h seq)."""
    import torch

    layers = model.layers
    matmul = sum(m.weight.numel() for layer in layers for m in layer.modules()
                 if isinstance(m, torch.nn.Linear))
    return 2.0 * matmul + 4.0 * len(layers) * model.config.hidden * seq


def _checkpoint_layers(model) -> None:
    import torch.utils.checkpoint as ckpt

    for layer in model.layers:
        forward = layer.forward
        layer.forward = lambda *a, _f=forward: ckpt.checkpoint(_f, *a, use_reentrant=False)


def _load_cuda_libraries(device) -> None:
    """Create the CUDA context and load the kernels every system here uses (cuBLAS GEMMs,
    SDPA, forward and backward) before the host-memory baseline: the host memory they take
    (the context, library images) is the process's, not the model's."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(256, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    (x @ x).float().sum().backward()
    q = torch.randn(1, 4, 256, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).float().sum().backward()
    torch.cuda.synchronize(device)


def run_system(args) -> dict:
    """Train `args.system` for the timed steps in this (child) process and return its row:
    step times and rates, peak GPU and host memory (host bytes per parameter by phase),
    losses, the sweeps asked for and, for megatrain, its runtime's own figures."""
    import torch

    from megatrain.train.plan import model_flops_per_token

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    # "16,8,8/bf16": thread counts, each optionally with the gradients' transfer dtype
    threads = [(int(t.split("/")[0]), t.partition("/")[2] or "default")
               for t in args.optim_threads.split(",")] if args.optim_threads else []
    if cuda:
        _load_cuda_libraries(device)
    _refuse_if_unfit(args.system, _param_count(args.model, args.layers), device)
    rss_base, anon_base = _status("VmRSS"), _status("RssAnon")
    child_phase.phase = "building the model"
    model = _model(args.model, args.layers)
    child_phase.phase = "setting up"
    # Host memory at named points (_memory_now), to split the bytes per parameter
    # between the model, the probe and compiling, the slabs and the optimizer's state.
    rss = {}

    def mark(point: str) -> None:
        rss[point] = _memory_now()

    mark("built")
    n_params = sum(p.numel() for p in model.parameters())
    batch = args.tokens // args.seq
    data = _tokens(args.tokens * (args.steps + 1), model.config.vocab_size).view(-1, batch, args.seq)
    flops_per_token = model_flops_per_token(model, args.seq)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    backward = torch.Tensor.backward  # DeepSpeed's engine runs its own (zero3-offload)
    resident = args.system in ("resident-compiled", "resident", "eager")
    if resident:
        model = model.to(device)
        if args.checkpoint == "layers":
            _checkpoint_layers(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        step_fn = torch.compile(model) if args.system == "resident-compiled" else model
        to_device = True
    elif args.system == "fsdp2-offload":
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        dist.init_process_group("nccl" if cuda else "gloo", init_method="tcp://127.0.0.1:29533",
                                rank=0, world_size=1)
        _checkpoint_layers(model)
        policy = CPUOffloadPolicy(pin_memory=cuda)
        for layer in model.layers:
            fully_shard(layer, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        # fused: torch's fastest CPU AdamW, which runs on FSDP2's offloaded DTensors (3.5x
        # the default's for-loop on the CPU; session 14 had timed FSDP2 with the default)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step_fn, to_device = model, True
    elif args.system == "zero3-offload":
        step_fn, opt, backward = _zero3_offload(model, batch, cuda)
        to_device = True
    elif args.system == "megatrain":
        import megatrain

        if cuda:  # the cost model plans with this machine's rates (probed once, cached)
            from megatrain.runtime.probe import load_or_probe

            load_or_probe(device)
        opt = megatrain.AdamW(model.parameters(), lr=1e-4, threads=threads[0][0] if threads else None)
        options = {"device": args.device, "precision": args.precision}
        if args.gpu_memory:
            options["gpu_memory"] = args.gpu_memory
        # A variant's flags force megatrain's decisions (one system per process, so the
        # config module is this run's): diagnostics beside the planner's defaults.
        forced = {name: value for name, value in (("prefetch", args.prefetch), ("updates", args.updates))
                  if value is not None}
        if args.backlog:
            forced["backlog"] = args.backlog
        if args.grad_ring:
            forced["grad_chunk"] = args.grad_ring
        if args.no_offload:
            forced["offload"] = False
        if args.keep_activations:
            forced["keep_activations"] = args.keep_activations == "on"
        if args.keep_weights:
            forced["keep_weights"] = True
        if args.weight_shadow:
            forced["weight_shadow"] = True
        if args.kernels:
            forced["kernels"] = True if args.kernels == "all" else args.kernels.split(",")
        for name, value in forced.items():
            setattr(megatrain.config, name, value)
        step_fn, to_device = torch.compile(model, backend="megatrain", options=options), False
        autocast = torch.autocast(device.type, enabled=False)
    else:
        raise SystemExit(f"unknown system {args.system!r}")

    def run_steps(count: int, first: bool, start: int = 0) -> tuple[list[float], list[dict], float]:
        """`count` timed steps on batches start.. : step times, host time per call, last loss."""
        times, phases, loss = [], [], None
        host_busy = getattr(opt, "host_busy_s", None)  # megatrain.AdamW's measured update time
        for i in range(count):
            compiling = first and start + i == 0 and args.system in ("resident-compiled", "megatrain")
            child_phase.phase = f"step {i} forward" + (" (compiling)" if compiling else "")
            x, y = data[start + i], data[start + i + 1]
            if to_device:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with autocast:
                loss = step_fn(x, labels=y)
            t1 = time.perf_counter()
            if compiling:  # weights homed, the forward compiled; no optimizer state yet
                mark("first_forward")
            child_phase.phase = f"step {i} backward" + (" (compiling)" if compiling else "")
            backward(loss)
            t2 = time.perf_counter()
            if compiling:  # the backward compiled, gradients through the slabs
                mark("first_backward")
            child_phase.phase = f"step {i} optimizer"
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            # Host time in each call: the host runs ahead of the GPU until something waits,
            # so for megatrain backward ends when the last gradient is handed over, and
            # step() is the optimizer's tail after backward.
            phases.append({"forward_call_s": t1 - t0, "backward_call_s": t2 - t1,
                           "optimizer_call_s": t3 - t2, "final_sync_s": times[-1] - (t3 - t0),
                           "loss": float(loss.detach())})
            if host_busy is not None:
                phases[-1]["host_busy_s"] = opt.host_busy_s - host_busy
                host_busy = opt.host_busy_s
            print(f"  {args.system} step {start + i}: {times[-1]:.3f} s "
                  f"{ {k: round(v, 3) for k, v in phases[-1].items()} }", file=sys.stderr)
        return times, phases, float(loss.detach())

    def set_grad_transfer(dtype: str) -> None:
        from megatrain.runtime.streamer import GRAD_TRANSFER_DTYPE

        for streamer in _streamers(megatrain.explain(step_fn)):
            streamer.grad_transfer_dtype = {
                "default": GRAD_TRANSFER_DTYPE, "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]

    if threads and threads[0][1] != "default":
        raise SystemExit("--optim-threads: the first entry runs before compiling; give it no /dtype")
    mark("set_up")  # the probe ran (megatrain on CUDA), the optimizer exists
    with _PinnedWatch() as pinned_watch:  # the first step, compiling: untimed
        times, phases, loss = run_steps(1, first=True)
    mark("first_step")  # the optimizer's state exists
    more, more_phases, loss = run_steps(args.steps - 1, first=False, start=1)
    times, phases = times + more, phases + more_phases
    # The thread sweep: the same compiled model and optimizer state, the host worker
    # rebuilt with each further thread count (one warm-up step, then the timed ones).
    sweep = []
    if args.system == "megatrain" and len(threads) > 1:
        sweep.append({"threads": opt.threads, "grads": threads[0][1],
                      "step_s": statistics.median(times[args.warmup:] or times[-1:])})
        for n, dtype in threads[1:]:
            opt.set_threads(n)
            set_grad_transfer(dtype)
            ts, _, _ = run_steps(max(args.steps - args.warmup, 1) + 1, first=False)
            sweep.append({"threads": n, "grads": dtype, "step_s": statistics.median(ts[1:])})
    # The slab sweep: the gradient slabs' bound changed between runs of timed steps on the
    # same compiled model (the first step allocated the default's; extra slabs come lazily).
    slabs_sweep = []
    for n in ((None if v == "auto" else int(v)) for v in args.grad_slabs.split(",")) \
            if args.grad_slabs and args.system == "megatrain" else ():
        for streamer in _streamers(megatrain.explain(step_fn)):
            streamer._slabs.set_max_slabs(n)
        ts, _, _ = run_steps(max(args.steps - args.warmup, 1) + 1, first=False)
        slabs_sweep.append({"grad_slabs": n, "step_s": statistics.median(ts[1:])})
    if args.profile:
        _profile_step(args, lambda: run_steps(1, first=False))
        if args.system == "megatrain":  # predicted and measured schedule, for Perfetto
            layers = args.layers or _config(args.model).layers
            plan = megatrain.explain(step_fn)
            plan.timeline(Path(args.profile) / f"timeline_{args.model}_L{layers}_{args.tokens}.json")
            # the planner's inputs and choice, to re-predict offline with another cost model
            import pickle

            (Path(args.profile) / f"schedules_{args.model}_L{layers}_{args.tokens}.pkl").write_bytes(pickle.dumps(
                [(g.predicted_schedule.problem, g.predicted_schedule.config, g.schedule.rates)
                 for g in plan.graphs if g.schedule is not None]))
    step = statistics.median(times[args.warmup:]) if len(times) > args.warmup else times[-1]
    timed = phases[args.warmup:] or phases[-1:]
    row = {
        "system": args.system, "model": args.model, "layers": model.config.layers, "params": n_params,
        "tokens_per_step": args.tokens, "seq": args.seq, "step_s": step,
        "tokens_per_s": args.tokens / step, "tflops": flops_per_token * args.tokens / step / 1e12,
        "checkpoint": args.checkpoint if resident else None,
        "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "host_rss_gib": _status("VmHWM") / 2**30, "gpu_memory": args.gpu_memory, "steps": times,
        # torch's compile timers over the whole process (dynamo, AOT, Inductor's stages)
        "compile_split_s": compile_split(),
        # peak RSS over the process's RSS before the model existed (CUDA context included)
        "host_bytes_per_param": (_status("VmHWM") - rss_base) / n_params,
        "host_rss_base_gib": rss_base / 2**30,
        # where it goes: peak, current and anonymous RSS at each marked point (_rss_phases)
        "host_bytes_per_param_phases": _rss_phases(rss, rss_base, anon_base, n_params),
        "host_rss_file_shmem_gib": (_status("RssFile") / 2**30, _status("RssShmem") / 2**30),
        # anonymous memory on transparent huge pages (host state streamed at DRAM speed)
        "host_anon_huge_gib": _smaps_rollup("AnonHugePages") / 2**30,
        # torch's pinned allocator (cudaHostAlloc: shared anonymous pages, RssShmem)
        "pinned_allocator": {k: v for k, v in torch.cuda.host_memory_stats().items()
                             if k.startswith(("allocations.", "allocated_bytes.", "active_requests."))
                             and k.endswith((".current", ".peak"))} if cuda and hasattr(torch.cuda, "host_memory_stats") else None,
        "host_largest_mappings": _largest_mappings(),
        "pinned_growth": pinned_watch.events,
        "pinned_holders": _pinned_holders() if cuda else None,
        # every system's per-step losses, to compare their training side by side (same data)
        "final_loss": loss, "losses": [p["loss"] for p in phases], "optim_threads": threads[0][0] if threads else None, "prefetch": args.prefetch,
        "updates": args.updates if args.system == "megatrain" else None,
        "kernels": args.kernels if args.system == "megatrain" else None,
        "backlog": args.backlog if args.system == "megatrain" else None,
        "huge_pages": args.huge_pages if args.system == "megatrain" else None,
        "grad_chunk": args.grad_ring if args.system == "megatrain" else None,
        "offload": not args.no_offload if args.system == "megatrain" else None,
        "keep_activations": args.keep_activations if args.system == "megatrain" else None,
        "keep_weights": args.keep_weights if args.system == "megatrain" else None,
        "weight_shadow": args.weight_shadow if args.system == "megatrain" else None,
        **{k: statistics.median(p[k] for p in timed) for k in timed[0]},
    }
    if sweep:
        row["threads_sweep"] = sweep
    if slabs_sweep:
        row["slabs_sweep"] = slabs_sweep
    if resident:
        row["recompute_flops_per_step"] = (layer_forward_flops_per_token(model, args.seq) * args.tokens
                                           if args.checkpoint == "layers" else 0.0)
    if args.system == "megatrain":
        row.update(_megatrain_stats(step_fn))
        if cuda:
            row["host_rates_after_run"] = host_rates_again(device)
        row["pcie_gbs"] = (row["h2d_bytes"] + row["d2h_bytes"]) / times[-1] / 1e9
        # the rate weight copies reached while they ran (contention with the optimizer's
        # host memory traffic and the gradient copies shows here)
        row["h2d_copy_gbs"] = row["h2d_bytes"] / row["h2d_busy_s"] / 1e9 if row["h2d_busy_s"] else None
    # last, after every figure above is read: one more step, untimed, under the allocator's
    # history (its stats would otherwise be this step's, not the timed ones')
    if args.memory_peak and cuda:
        try:
            row["memory_at_peak"] = _memory_at_peak(args, device, lambda: run_steps(1, first=False))
        except Exception as e:  # noqa: BLE001 -- a diagnostic must not cost the run its row
            row["memory_at_peak_error"] = repr(e)[:2000]
    return row

