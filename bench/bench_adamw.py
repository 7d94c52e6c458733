"""Benchmark megatrain's host AdamW step against torch's fused CPU AdamW at the same threads.

Why: the host optimizer sets the step-time floor once transfers and compute overlap
(~34 B/param of host memory traffic per step), so megatrain.AdamW must
run at least at 90% of torch.optim.AdamW(fused=True) on the CPU, and hold 12 B/param.

Paths timed (one full optimizer step over all parameters; median over repeats, interleaved
so drift and noisy neighbours hit every path alike):
  torch fused   torch.optim.AdamW(fused=True), gradients in p.grad
  mt step       megatrain.AdamW.step() with gradients in p.grad (compatibility path)
  mt submit     megatrain.AdamW.submit() per region, then step() (the runtime's path)
  mt staging    the same, gradients in two reusable one-region slabs (as the runtime has
                them; small slabs may sit in cache, so this one can flatter megatrain)
  mt clipped    clipping on (the main job's default), bf16 gradients in the slabs, so every
                update waits for step() (held in bf16, their norms taken at submit)
G params/s = parameters / median seconds. The fused update reads param, grad, m, v and
writes param, m, v: 28 B/param, so GB/s = 28 x G params/s.

Memory: before the timed paths, the submit path runs alone with gradients in the staging
slabs, and the growth of the
process RSS over the parameters' allocation is divided by the parameter count: fp32
master 4 + m 4 + v 4 = 12 B/param, plus staging.

Usage: python bench/bench_adamw.py [--params N] [--regions 30] [--threads T]
       [--repeats 9] [--out bench/results/adamw.jsonl]
Default --params: 1e9 on a box with >= 16 cores and >= 48 GiB available (about a minute
there), else 64M so the script stays quick on a small machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import append_rows, run_metadata  # noqa: E402  (bench/ is sys.path[0])
from megatrain.optim import AdamW  # noqa: E402
from megatrain.memory.host_store import available_host_bytes  # noqa: E402


def rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read the process RSS (no psutil, no /proc/self/status)")


def default_params() -> int:
    big = (os.cpu_count() or 1) >= 16 and (available_host_bytes() or 0) >= 48 * 2**30
    return 1_000_000_000 if big else 64_000_000


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(threads: int) -> dict:
    return {"bench": "adamw", "cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads,
            **run_metadata()}


def make_regions(n_params: int, n_regions: int) -> list[list[torch.nn.Parameter]]:
    """``n_regions`` layers of four tensors each (like attention, MLP, norm and bias
    weights), values in [-1, 1) (no denormals to slow anything)."""
    per = n_params // n_regions
    fractions = (0.55, 0.3, 0.149, 0.001)
    regions = []
    for r in range(n_regions):
        size = per + (n_params - per * n_regions if r == n_regions - 1 else 0)
        sizes = [max(1, int(size * f)) for f in fractions[:-1]]
        sizes.append(size - sum(sizes))
        regions.append([torch.nn.Parameter(torch.empty(s).uniform_(-1, 1)) for s in sizes])
    return regions


def submit_step(opt: AdamW, regions, region_grads) -> None:
    for ps, gs in zip(regions, region_grads):
        opt.submit(ps, gs)
    opt.step()


def staged_grads(regions, dtype=torch.float32):
    """Per region, gradient views into one of two reusable slabs (the runtime's staging;
    its gradients arrive in the compute dtype, bf16 in mixed precision, and are upcast
    inside the update)."""
    biggest = max(sum(p.numel() for p in ps) for ps in regions)
    slabs = [torch.empty(biggest).uniform_(-1e-3, 1e-3).to(dtype) for _ in range(2)]
    out = []
    for r, ps in enumerate(regions):
        off, views = 0, []
        for p in ps:
            views.append(slabs[r % 2][off: off + p.numel()].view(p.shape))
            off += p.numel()
        out.append(views)
    return out, slabs


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=None, help="parameter count (e.g. 1e9)")
    p.add_argument("--regions", type=int, default=30)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--grad-dtype", default="fp32", choices=("fp32", "bf16"),
                   help="dtype of the staged gradients (mt staging path)")
    p.add_argument("--out", default=str(REPO / "bench/results/adamw.jsonl"))
    args = p.parse_args(argv)
    n = int(args.params) if args.params else default_params()
    torch.set_num_threads(args.threads)
    env = environment(args.threads)
    print(f"{env['cpu']}  {env['cores']} cores  threads {args.threads}  torch {env['torch']}  "
          f"commit {env['commit']}")
    print(f"{n / 1e9:.3f} G params in {args.regions} regions, {args.repeats} repeats")

    rss0 = rss_bytes()
    regions = make_regions(n, args.regions)
    params = [q for ps in regions for q in ps]
    lr = dict(lr=1e-4, weight_decay=0.1)

    # Memory: the runtime's path alone, gradients only in staging.
    ours = AdamW(params, threads=args.threads, **lr)
    grad_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.grad_dtype]
    staged, _slabs = staged_grads(regions, grad_dtype)
    submit_step(ours, regions, staged)  # warm-up: allocates m and v
    rss_per_param = (rss_bytes() - rss0) / n

    # Throughput: every path on the same parameters, interleaved.
    grads = [torch.empty_like(q).uniform_(-1e-3, 1e-3) for q in params]
    region_grads, k = [], 0
    for ps in regions:
        region_grads.append(grads[k: k + len(ps)])
        k += len(ps)
    ref = torch.optim.AdamW(params, fused=True, **lr)

    def with_grads(opt):
        for q, g in zip(params, grads):
            q.grad = g
        try:
            return timed(opt.step)
        finally:
            for q in params:
                q.grad = None

    staged16 = staged_grads(regions, torch.bfloat16)[0] if grad_dtype != torch.bfloat16 else staged

    def clipped():
        ours.max_grad_norm = 1.0
        try:
            return timed(lambda: submit_step(ours, regions, staged16))
        finally:
            ours.max_grad_norm = None

    paths = {
        "torch fused": lambda: with_grads(ref),
        "mt clipped": clipped,
        "mt step": lambda: with_grads(ours),
        "mt submit": lambda: timed(lambda: submit_step(ours, regions, region_grads)),
        "mt staging": lambda: timed(lambda: submit_step(ours, regions, staged)),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for name, run in paths.items():
        run()  # warm-up (the torch optimizer allocates its state here)
    for _ in range(args.repeats):
        for name, run in paths.items():
            times[name].append(run())

    base = statistics.median(times["torch fused"])
    rows = []
    print(f"{'path':12} {'median s':>9} {'G params/s':>11} {'GB/s':>7} {'vs torch':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        row = {**env, "path": name, "params": n, "regions": args.regions,
               "grad_dtype": {"mt staging": args.grad_dtype, "mt clipped": "bf16"}.get(name, "fp32"),
               "repeats": args.repeats, "median_s": med, "gparams_per_s": n / med / 1e9,
               "gbps_28B": 28 * n / med / 1e9, "ratio_vs_torch_fused": base / med}
        if name == "mt staging":
            row["rss_bytes_per_param"] = rss_per_param
        rows.append(row)
        print(f"{name:12} {med:9.4f} {row['gparams_per_s']:11.3f} {row['gbps_28B']:7.1f} "
              f"{row['ratio_vs_torch_fused']:9.3f}")
    print(f"host RSS growth with megatrain.AdamW, gradients in staging: "
          f"{rss_per_param:.2f} B/param (12 = fp32 master + m + v)")
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
