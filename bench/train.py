"""Training throughput, side by side: GPU-resident torch, FSDP2 CPU offload, megatrain (issue 6).

Every system trains the same Llama shape on the same real tokens (the shipped corpus, byte
ids) with the same batch; each runs in its own subprocess so memory, pinned pools and
compile caches never leak between them. A first `probe` child measures, in the same run,
the bf16 matmul rate at the model's shapes (for MFU), pinned H2D bandwidth and the host's
fused-AdamW memory bandwidth (for the bound). Reported per system: tokens/s (median step
after warm-up), model TFLOP/s = (6 N + 12 L H S) T / step (N: matmul parameters, no
embedding; recompute not counted), MFU, peak GPU memory, peak host RSS; for megatrain also
PCIe GB/s, the compute stream's time stalled on weights and the host time blocked on
optimizer updates (runtime CUDA events / timers), and the step bound
max(compute = resident-compiled step, host memory = 34 B/param / AdamW bandwidth,
PCIe = bytes / H2D rate) with the achieved fraction of it. Host bytes per parameter are
the peak RSS over the RSS before the model was built (CUDA context already up), divided by
the parameter count.

    python bench/train.py --model 1.3b --tokens 16384 --seq 2048 \
        --systems resident-compiled,resident,fsdp2-offload,megatrain --gpu-memory 12GiB
    python bench/train.py --smoke        # CPU: tiny model, eager vs megatrain, checks the script

Systems:
  resident-compiled / resident  model, fp32 master and AdamW on the GPU, bf16 autocast,
                           per-layer checkpointing, torch.compile or not
  fsdp2-offload            fully_shard(CPUOffloadPolicy(pin_memory=True)) at world size 1
  zero3-offload            DeepSpeed ZeRO-3 param+optimizer offload, when deepspeed imports
  megatrain                torch.compile(backend="megatrain") + megatrain.AdamW, bf16
A system that cannot run (out of memory, missing package) is recorded with its error; a
system whose host state cannot fit in host RAM is refused up front with the numbers.
Rows are appended to --out (default bench/results/train.jsonl) as each system finishes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

MODELS = {"1.3b": "1b", "3b": "3b", "8b": "8b", "tiny": "tiny"}  # bench name -> preset
SYSTEMS = ("resident-compiled", "resident", "fsdp2-offload", "zero3-offload", "megatrain", "eager")
HOST_BYTES_PER_PARAM = 34  # DESIGN.md / issue 6: fp32 master+m+v read+write, bf16 w and g
FSDP_HOST_BYTES_PER_PARAM = 16  # fp32 param + grad + m + v, all in host RAM


def _tokens(n: int, vocab: int):
    import numpy as np
    import torch

    raw = (REPO / "megatrain/data/shakespeare.txt").read_bytes()
    ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int64) % vocab
    reps = -(-n // len(ids))
    return torch.from_numpy(np.tile(ids, reps)[:n].copy())


def _model(name: str):
    import torch

    from megatrain.models import PRESETS, Llama

    torch.manual_seed(0)
    return Llama(PRESETS[MODELS[name]])


def _checkpoint_layers(model) -> None:
    import torch.utils.checkpoint as ckpt

    for layer in model.layers:
        forward = layer.forward
        layer.forward = lambda *a, _f=forward: ckpt.checkpoint(_f, *a, use_reentrant=False)


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _median_s(fn, repeats: int = 5) -> float:
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def run_probe(args) -> dict:
    """Rates of this machine, measured in this run: bf16 matmul at the model's MLP shape,
    pinned host-to-device copy, and host memory bandwidth as torch's fused AdamW uses it."""
    import torch

    from megatrain.models import PRESETS

    cfg = PRESETS[MODELS[args.model]]
    rows = min(args.tokens, 16384)
    a = torch.randn(rows, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(cfg.hidden, cfg.ffn, device="cuda", dtype=torch.bfloat16)
    a @ b
    mm = _median_s(lambda: a @ b, 10)
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    h2d = _median_s(lambda: dst.copy_(src, non_blocking=True))
    n = 1 << 27
    p, g, m, v = (torch.randn(n) for _ in range(4))
    opt = torch.optim.AdamW([torch.nn.Parameter(p)], fused=True)
    opt.param_groups[0]["params"][0].grad = g
    opt.step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"system": "probe", "matmul_tflops": 2 * rows * cfg.hidden * cfg.ffn / mm / 1e12,
            "h2d_gbs": (1 << 30) / h2d / 1e9, "adamw_gbs": 28 * n / statistics.median(times) / 1e9,
            "threads": torch.get_num_threads()}


def _megatrain_stats(step_fn) -> dict:
    import megatrain

    stats = [g.streamer.last_stats for g in megatrain.explain(step_fn).graphs
             if g.streamer is not None and g.streamer.last_stats is not None]
    plan = megatrain.explain(step_fn)
    return {"predicted_step_s": plan.predicted_step_s,
            "planned_with": sorted({g.schedule.rates.device for g in plan.graphs if g.schedule is not None}),
            "h2d_bytes": sum(s.h2d_bytes for s in stats), "d2h_bytes": sum(s.d2h_bytes for s in stats),
            "transfer_stall_s": sum(s.transfer_stall_s() for s in stats),
            "optimizer_wait_s": sum(s.optimizer_wait_s for s in stats),
            "slab_wait_s": sum(s.slab_wait_s for s in stats),
            "cast_wait_s": sum(s.cast_wait_s for s in stats),
            "fetch_paths": dict(sum((s.fetch_paths for s in stats), collections.Counter())),
            "h2d_busy_s": sum(s.h2d_busy_s() for s in stats),
            "stall_by_region": [{r: round(t, 4) for r, t in s.stall_by_region().items() if t > 1e-4}
                                for s in stats]}


def run_system(args) -> dict:
    import torch

    from megatrain.train.plan import model_flops_per_token

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.empty(1, device=device)  # the CUDA context's host memory is not the model's
    rss_base = _status("VmRSS")
    model = _model(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    batch = args.tokens // args.seq
    data = _tokens(args.tokens * (args.steps + 1), model.config.vocab_size).view(-1, batch, args.seq)
    flops_per_token = model_flops_per_token(model, args.seq)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    if args.system in ("resident-compiled", "resident", "eager"):
        model = model.to(device)
        _checkpoint_layers(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        step_fn = torch.compile(model) if args.system == "resident-compiled" else model
        to_device = True
    elif args.system == "fsdp2-offload":
        need, have = FSDP_HOST_BYTES_PER_PARAM * n_params, _mem_available()
        if need > have:
            raise SystemExit(f"FSDP2 CPU offload keeps fp32 params, grads and both moments in host "
                             f"RAM: {need / 2**30:.1f} GiB needed, {have / 2**30:.1f} GiB available")
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        dist.init_process_group("nccl" if cuda else "gloo", init_method="tcp://127.0.0.1:29533",
                                rank=0, world_size=1)
        _checkpoint_layers(model)
        policy = CPUOffloadPolicy(pin_memory=cuda)
        for layer in model.layers:
            fully_shard(layer, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step_fn, to_device = model, True
    elif args.system == "zero3-offload":
        try:
            import deepspeed  # noqa: F401
        except ImportError as e:
            raise SystemExit(f"deepspeed is not importable here ({e}); carry its wheel to run it")
        raise SystemExit("zero3-offload: deepspeed imports, but this bench has no ZeRO-3 driver yet")
    elif args.system == "megatrain":
        import megatrain

        if cuda:  # the cost model plans with this machine's rates (probed once, cached)
            from megatrain.runtime.probe import load_or_probe

            load_or_probe(device)
        opt = megatrain.AdamW(model.parameters(), lr=1e-4, threads=args.optim_threads)
        options = {"device": args.device, "precision": args.precision, "prefetch": args.prefetch}
        if args.gpu_memory:
            options["gpu_memory"] = args.gpu_memory
        step_fn, to_device = torch.compile(model, backend="megatrain", options=options), False
        autocast = torch.autocast(device.type, enabled=False)
    else:
        raise SystemExit(f"unknown system {args.system!r}")

    times, phases = [], []
    for i in range(args.steps):
        x, y = data[i], data[i + 1]
        if to_device:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with autocast:
            loss = step_fn(x, labels=y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        # Host time in each call: the host runs ahead of the GPU until something waits, so
        # for megatrain backward ends when the last gradient is handed over, and step() is
        # the optimizer's tail after backward.
        phases.append({"forward_call_s": t1 - t0, "backward_call_s": t2 - t1,
                       "optimizer_call_s": t3 - t2, "final_sync_s": times[-1] - (t3 - t0)})
        print(f"  {args.system} step {i}: {times[-1]:.3f} s loss {float(loss):.3f} "
              f"{ {k: round(v, 3) for k, v in phases[-1].items()} }", file=sys.stderr)
    if args.profile:
        _profile_step(args, lambda: _train_step(step_fn, opt, autocast, data[0], data[1], to_device, device))
    step = statistics.median(times[args.warmup:]) if len(times) > args.warmup else times[-1]
    timed = phases[args.warmup:] or phases[-1:]
    row = {
        "system": args.system, "model": args.model, "params": n_params,
        "tokens_per_step": args.tokens, "seq": args.seq, "step_s": step,
        "tokens_per_s": args.tokens / step, "tflops": flops_per_token * args.tokens / step / 1e12,
        "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "host_rss_gib": _status("VmHWM") / 2**30, "gpu_memory": args.gpu_memory, "steps": times,
        # peak RSS over the process's RSS before the model existed (CUDA context included)
        "host_bytes_per_param": (_status("VmHWM") - rss_base) / n_params,
        "final_loss": float(loss), "optim_threads": args.optim_threads, "prefetch": args.prefetch,
        **{k: statistics.median(p[k] for p in timed) for k in timed[0]},
    }
    if args.system == "megatrain":
        row.update(_megatrain_stats(step_fn))
        row["pcie_gbs"] = (row["h2d_bytes"] + row["d2h_bytes"]) / times[-1] / 1e9
        # the rate weight copies reached while they ran (contention with the optimizer's
        # host memory traffic and the gradient copies shows here)
        row["h2d_copy_gbs"] = row["h2d_bytes"] / row["h2d_busy_s"] / 1e9 if row["h2d_busy_s"] else None
    return row


def _train_step(step_fn, opt, autocast, x, y, to_device, device) -> None:
    if to_device:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    with autocast:
        loss = step_fn(x, labels=y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _profile_step(args, step) -> None:
    """One step under torch.profiler: the ops that take the GPU's time and the host's, as
    text tables (a whole trace is too large to bring back from the device machine)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.key_averages()
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    sort = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
    (out / f"profile_{args.system}_{args.model}_{args.tokens}.txt").write_text(
        f"{args.system} {args.model} {args.tokens} tokens: by GPU time\n"
        + events.table(sort_by=sort, row_limit=40, max_name_column_width=70)
        + "\nby host self time\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))


def _bound(row: dict, probe: dict, compiled_step: float | None) -> dict:
    """The step-time bound of issue 6: max(compute, host memory traffic, PCIe)."""
    host_s = HOST_BYTES_PER_PARAM * row["params"] / (probe["adamw_gbs"] * 1e9)
    pcie_s = max(row.get("h2d_bytes", 0), row.get("d2h_bytes", 0)) / (probe["h2d_gbs"] * 1e9)
    terms = {"bound_compute_s": compiled_step, "bound_host_s": host_s, "bound_pcie_s": pcie_s}
    bound = max(v for v in terms.values() if v is not None)
    return {**terms, "bound_s": bound, "fraction_of_bound": bound / row["step_s"]}


def _child(args, argv, system: str) -> dict:
    cmd = [sys.executable, __file__, "--system", system] + [a for a in argv if a != "--smoke"]
    if args.smoke:
        cmd += ["--model", "tiny", "--device", "cpu", "--precision", "fp32", "--tokens", "512",
                "--seq", "64", "--steps", "4", "--warmup", "1"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired:
        return {"system": system, "error": f"timed out after {args.timeout} s"}
    if r.returncode == 0:
        return json.loads(r.stdout.strip().splitlines()[-1])
    print(r.stderr[-3000:], file=sys.stderr)
    lines = r.stderr.strip().splitlines()
    return {"system": system, "error": lines[-1] if lines else f"exit {r.returncode}"}


def main(argv=None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.3b", choices=sorted(MODELS))
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--systems", default="resident-compiled,resident,fsdp2-offload,megatrain")
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--gpu-memory", default=None)
    p.add_argument("--optim-threads", type=int, default=None, help="megatrain.AdamW threads")
    p.add_argument("--prefetch", type=int, default=1, help="megatrain regions fetched ahead")
    p.add_argument("--timeout", type=int, default=600, help="seconds per system")
    p.add_argument("--profile", default=None,
                   help="directory: profile one more step per system, write its op tables there")
    p.add_argument("--out", default=str(REPO / "bench/results/train.jsonl"))
    p.add_argument("--system", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, eager vs megatrain")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.device, args.precision, args.tokens, args.seq = "tiny", "cpu", "fp32", 512, 64
        args.systems, args.steps, args.warmup = "eager,megatrain", 4, 1
    if args.system:
        print(json.dumps(run_probe(args) if args.system == "probe" else run_system(args)))
        return 0
    from _results import append_rows, run_metadata

    meta = run_metadata()
    probe = None if args.smoke else _child(args, argv, "probe")
    rows = []
    for system in args.systems.split(","):
        if system not in SYSTEMS:
            raise SystemExit(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
        row = _child(args, argv, system)
        row.update(model=args.model, tokens_per_step=args.tokens, seq=args.seq, **meta)
        if probe and "error" not in probe and "error" not in row:
            row["mfu"] = row["tflops"] / probe["matmul_tflops"]
            row["probe"] = probe
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("steps", "probe")}), file=sys.stderr)
        append_rows(args.out, [row])  # row by row: a later system's crash loses nothing
    compiled = next((r["step_s"] for r in rows if r["system"] == "resident-compiled" and "step_s" in r), None)
    print(f"probe: {probe}")
    print(f"{'system':18s} {'tok/s':>8s} {'TFLOP/s':>7s} {'MFU':>5s} {'step s':>6s} {'GPU GiB':>7s} "
          f"{'RSS GiB':>7s} {'B/par':>5s} {'vs comp':>7s} {'stall s':>7s} {'optw s':>6s} {'PCIe':>5s} {'bound':>5s}")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:18s} error: {r['error']}")
            continue
        b = _bound(r, probe, compiled) if probe and "error" not in probe else {}
        f = lambda k, fmt: format(r[k], fmt) if r.get(k) is not None else "-"  # noqa: E731
        print(f"{r['system']:18s} {r['tokens_per_s']:8.0f} {r['tflops']:7.1f} {f('mfu', '5.2f')} "
              f"{r['step_s']:6.3f} {f('peak_gpu_gib', '7.1f')} {r['host_rss_gib']:7.1f} "
              f"{f('host_bytes_per_param', '5.1f')} {(compiled / r['step_s']) if compiled else float('nan'):7.2f} {f('transfer_stall_s', '7.3f')} "
              f"{f('optimizer_wait_s', '6.3f')} {f('pcie_gbs', '5.1f')} "
              f"{b.get('fraction_of_bound', float('nan')):5.2f}")
        if b:
            print(f"{'':18s} bound terms: " + ", ".join(f"{k[6:]}={v:.3f}" for k, v in b.items()
                                                         if k.startswith("bound_") and v is not None))
        if r.get("predicted_step_s"):
            print(f"{'':18s} planner predicted {r['predicted_step_s']:.3f} s/step "
                  f"(measured/predicted {r['step_s'] / r['predicted_step_s']:.2f}, rates of {r.get('planned_with')})")
        if r.get("h2d_copy_gbs"):
            print(f"{'':18s} host blocked: on gradient slabs {r.get('slab_wait_s', 0):.3f} s, on host casts "
                  f"{r.get('cast_wait_s', 0):.3f} s; weight fetch paths {r.get('fetch_paths')}")
            print(f"{'':18s} weight copies: {r['h2d_busy_s']:.3f} s busy at {r['h2d_copy_gbs']:.1f} GB/s; "
                  f"stall by region: {r.get('stall_by_region')}")
        print(f"{'':18s} host time in calls: " + ", ".join(
            f"{k[:-2]}={r[k]:.3f}" for k in ("forward_call_s", "backward_call_s", "optimizer_call_s",
                                               "final_sync_s") if k in r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
