"""Training throughput, side by side: GPU-resident torch, FSDP2 CPU offload, megatrain (issue 6).

Every system trains the same Llama shape on the same real tokens (the shipped corpus, byte
ids) with the same batch; each runs in its own subprocess so memory, pinned pools and
compile caches never leak between them. Reported per system: tokens/s (median step after
warm-up), model TFLOP/s = (6 N + 12 L H S) T / step (N: matmul parameters, no embedding;
recompute not counted), peak GPU bytes, host RSS, step seconds.

    python bench/train.py --model 1b --tokens 16384 --seq 2048 \
        --systems gpu_compile,gpu_eager,fsdp2,megatrain --out bench/results/train.jsonl
    python bench/train.py --smoke        # CPU: tiny model, eager vs megatrain, checks the script

Systems:
  gpu_compile / gpu_eager  model, fp32 master and AdamW on the GPU, bf16 autocast, per-layer
                           checkpointing (torch.utils.checkpoint), torch.compile or not
  fsdp2                    fully_shard(CPUOffloadPolicy(pin_memory=True)) at world size 1
  megatrain                torch.compile(backend="megatrain") + megatrain.AdamW, bf16
A system that cannot run (out of memory, missing package) is recorded with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
    return Llama(PRESETS[name])


def _checkpoint_layers(model) -> None:
    import torch.utils.checkpoint as ckpt

    for layer in model.layers:
        forward = layer.forward
        layer.forward = lambda *a, _f=forward: ckpt.checkpoint(_f, *a, use_reentrant=False)


def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run_system(args) -> dict:
    import torch

    from megatrain.train.plan import model_flops_per_token

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = _model(args.model)
    batch = args.tokens // args.seq
    data = _tokens(args.tokens * (args.steps + 1), model.config.vocab_size).view(-1, batch, args.seq)
    flops_per_token = model_flops_per_token(model, args.seq)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    if args.system in ("gpu_compile", "gpu_eager", "eager"):
        model = model.to(device)
        _checkpoint_layers(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        step_fn = torch.compile(model) if args.system == "gpu_compile" else model
        to_device = True
    elif args.system == "fsdp2":
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
    elif args.system == "megatrain":
        import megatrain

        opt = megatrain.AdamW(model.parameters(), lr=1e-4)
        options = {"device": args.device, "precision": args.precision}
        if args.gpu_memory:
            options["gpu_memory"] = args.gpu_memory
        step_fn, to_device = torch.compile(model, backend="megatrain", options=options), False
        autocast = torch.autocast(device.type, enabled=False)
    else:
        raise SystemExit(f"unknown system {args.system!r}")

    times = []
    for i in range(args.steps):
        x = data[i]
        y = data[i + 1]
        if to_device:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with autocast:
            loss = step_fn(x, labels=y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        print(f"  {args.system} step {i}: {times[-1]:.3f} s loss {float(loss):.3f}", file=sys.stderr)
    step = statistics.median(times[args.warmup:]) if len(times) > args.warmup else times[-1]
    return {
        "system": args.system, "model": args.model, "tokens_per_step": args.tokens, "seq": args.seq,
        "step_s": step, "tokens_per_s": args.tokens / step,
        "model_tflops": flops_per_token * args.tokens / step / 1e12,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "host_rss_bytes": _rss(), "steps": times,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--systems", default="gpu_compile,gpu_eager,fsdp2,megatrain")
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--gpu-memory", default=None)
    p.add_argument("--timeout", type=int, default=600, help="seconds per system")
    p.add_argument("--out", default=str(REPO / "bench/results/train.jsonl"))
    p.add_argument("--system", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, eager vs megatrain")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.device, args.precision, args.tokens, args.seq = "tiny", "cpu", "fp32", 512, 64
        args.systems, args.steps, args.warmup = "eager,megatrain", 4, 1
    if args.system:
        print(json.dumps(run_system(args)))
        return 0
    rows = []
    for system in args.systems.split(","):
        cmd = [sys.executable, __file__, "--system", system] + [
            a for a in (argv if argv is not None else sys.argv[1:]) if a != "--smoke"]
        if args.smoke:
            cmd += ["--model", "tiny", "--device", "cpu", "--precision", "fp32", "--tokens", "512",
                    "--seq", "64", "--steps", "4", "--warmup", "1"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
            row = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
                {"system": system, "error": r.stderr.strip().splitlines()[-1:] or [f"exit {r.returncode}"]}
        except subprocess.TimeoutExpired:
            row = {"system": system, "error": f"timed out after {args.timeout} s"}
        row.update(model=args.model, tokens_per_step=args.tokens, seq=args.seq, time=time.strftime("%FT%T%z"))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "steps"}), file=sys.stderr)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{'system':12s} {'tok/s':>9s} {'TFLOP/s':>8s} {'step s':>7s} {'peak GPU GiB':>12s}")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:12s} error: {r['error']}")
            continue
        gpu = f"{r['peak_gpu_bytes'] / 2**30:.1f}" if r.get("peak_gpu_bytes") else "-"
        print(f"{r['system']:12s} {r['tokens_per_s']:9.0f} {r['model_tflops']:8.1f} {r['step_s']:7.3f} {gpu:>12s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
