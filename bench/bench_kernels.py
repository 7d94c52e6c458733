"""Benchmark megatrain's Triton kernels against eager torch and Inductor on one GPU.

Why: the lowering stage swaps these kernels in only where they win; this script is the
evidence (time, bandwidth, peak memory) at the shapes that matter, 7B-class layers.

Providers: `megatrain` (the custom op), `eager` (the op's `*_reference`, i.e. HF-style
fp32-internal torch), `inductor` (torch.compile of that reference, default mode).
Modes: `fwd` (under no_grad: pure forward work) and `fwd+bwd` (forward, then backward with
a random upstream gradient; for the fused CE the gradient is made in the forward).

Shapes (T tokens, default 16384 = batch 2 x seq 8192; bf16):
  rmsnorm  x [T, 4096], weight [4096]
  rope     q [2, 32, T/2, 128], k [2, 8, T/2, 128], cos/sin [1, T/2, 128] (GQA 32/8)
  swiglu   gate, up [T, 14336] (Llama-3-8B intermediate)
  flce     hidden [T, 4096], weight [V, 4096], labels [T], V in {32000, 128256}

Minimal bytes (each tensor read or written exactly once; e = bytes per element):
  rmsnorm  fwd (2TH + H)e               fwd+bwd (5TH + 3H)e
  rope     fwd 2(Q + K)e + 2TDe         fwd+bwd 4(Q + K)e + 4TDe, Q = T*32*128, K = T*8*128
  swiglu   fwd 3TIe                     fwd+bwd 8TIe
  flce     fwd (TH + VH)e + 8T          fwd+bwd 2(TH + VH)e + 8T
`ms` is the median wall time of a call between CUDA events (triton do_bench); `GPU ms` is
the summed duration of the call's kernels (torch.profiler). Where `ms` is well above `GPU ms`
the call is bound by Python dispatch on the host, not by its kernels.
GB/s = minimal bytes / median time. flce is matmul-bound, so it also reports TFLOP/s
(fwd 2THV, fwd+bwd 6THV). Peak memory is torch.cuda.max_memory_allocated over one call,
reset before it; `extra` subtracts what was allocated before the call (inputs, weights).

Usage: python bench/bench_kernels.py [--out bench/results/kernels.jsonl] [--tokens 16384]
       [--kernels rmsnorm,rope,swiglu,flce] [--no-inductor] [--smoke]
Runs in about 2-3 minutes on an H200, most of it Inductor compiling the baselines.
`--smoke` runs tiny shapes on whatever device exists (CPU needs TRITON_INTERPRET=1) to
check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import append_rows, run_metadata  # noqa: E402  (bench/ is sys.path[0])


@dataclass
class Case:
    """One kernel at one shape: how to make inputs and how many bytes/FLOPs it must move."""

    kernel: str
    shape: str
    make: Callable[[bool], list]  # requires_grad -> positional inputs
    grad_inputs: tuple[int, ...]  # indices of inputs that get gradients
    ours: Callable
    reference: Callable
    bytes: dict[str, float]
    flops: dict[str, float]


def _cases(tokens: int, kernels: set[str], device: str, dtype: torch.dtype, smoke: bool):
    from megatrain import kernels as K

    e = torch.tensor([], dtype=dtype).element_size()
    T = tokens
    H, I, HQ, HK, D = (4096, 14336, 32, 8, 128) if not smoke else (64, 96, 4, 2, 16)
    vocabs = (32000, 128256) if not smoke else (300,)

    def rnd(*shape, grad=False, scale=1.0):
        return (torch.randn(shape, device=device, dtype=dtype) * scale).requires_grad_(grad)

    out = []
    if "rmsnorm" in kernels:
        out.append(Case(
            "rmsnorm", f"x[{T},{H}]", lambda g: [rnd(T, H, grad=g), rnd(H, grad=g), 1e-6], (0, 1),
            K.rms_norm, K.rms_norm_reference,
            {"fwd": (2 * T * H + H) * e, "fwd+bwd": (5 * T * H + 3 * H) * e}, {}))
    if "rope" in kernels:
        S = T // 2
        Q, Kb = T * HQ * D, T * HK * D

        def make_rope(g):
            pos = torch.arange(S, device=device, dtype=torch.float32)
            inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))
            emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)[None]
            return [rnd(2, HQ, S, D, grad=g), rnd(2, HK, S, D, grad=g),
                    emb.cos().to(dtype), emb.sin().to(dtype)]

        out.append(Case(
            "rope", f"q[2,{HQ},{S},{D}] k[2,{HK},{S},{D}]", make_rope, (0, 1),
            K.apply_rotary, K.apply_rotary_reference,
            {"fwd": 2 * (Q + Kb) * e + 2 * T * D * e, "fwd+bwd": 4 * (Q + Kb) * e + 4 * T * D * e},
            {}))
    if "swiglu" in kernels:
        out.append(Case(
            "swiglu", f"gate[{T},{I}]", lambda g: [rnd(T, I, grad=g, scale=3.0), rnd(T, I, grad=g)],
            (0, 1), K.swiglu, K.swiglu_reference,
            {"fwd": 3 * T * I * e, "fwd+bwd": 8 * T * I * e}, {}))
    if "flce" in kernels:
        for V in vocabs:
            def make_ce(g, V=V):
                labels = torch.randint(0, V, (T,), device=device)
                labels[: T // 50] = -100
                return [rnd(T, H, grad=g), rnd(V, H, grad=g, scale=H ** -0.5), labels]

            out.append(Case(
                "flce", f"h[{T},{H}] W[{V},{H}]", make_ce, (0, 1),
                K.fused_linear_cross_entropy, K.fused_linear_cross_entropy_reference,
                {"fwd": (T * H + V * H) * e + 8 * T, "fwd+bwd": 2 * (T * H + V * H) * e + 8 * T},
                {"fwd": 2 * T * H * V, "fwd+bwd": 6 * T * H * V}))
    return out


def _timer(device: str):
    """Median milliseconds of fn: triton's do_bench on CUDA, a plain loop elsewhere."""
    if device == "cuda":
        import triton.testing

        return lambda fn, grads: triton.testing.do_bench(
            fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")

    def cpu_bench(fn, grads):
        times = []
        for _ in range(3):
            for g in grads:
                g.grad = None
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_bench


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _device_ms(step, leaves, calls: int = 5) -> float:
    """GPU time of one call: the sum of its kernels' durations (torch.profiler), host gaps
    left out. `ms` is the wall time between events and, for the sub-millisecond cases at
    8k tokens, mostly measures Python dispatch on the host; inside a training step the host
    runs ahead of the GPU and only this part costs time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for t in leaves:
                t.grad = None
            step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def _run_one(case: Case, provider: str, mode: str, device: str, bench, compiled: dict):
    torch.manual_seed(0)
    inputs = case.make(mode == "fwd+bwd")
    leaves = [inputs[i] for i in case.grad_inputs] if mode == "fwd+bwd" else []
    if provider == "megatrain":
        fn = case.ours
    elif provider == "eager":
        fn = case.reference
    else:
        fn = compiled.setdefault(case.kernel, torch.compile(case.reference, dynamic=False))

    t0 = time.perf_counter()  # the first call compiles (Inductor) or JITs (Triton)
    if mode == "fwd":
        def step():
            with torch.no_grad():
                fn(*inputs)
    else:
        outs = _as_tuple(fn(*inputs))
        upstream = [torch.randn_like(o) for o in outs]
        del outs

        def step():
            torch.autograd.backward(_as_tuple(fn(*inputs)), upstream)

    step()
    first_s = time.perf_counter() - t0
    row = {"first_call_s": round(first_s, 3)}
    if device == "cuda":
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        row |= {"peak_gib": peak / 2**30, "extra_gib": (peak - base) / 2**30}
    ms = bench(step, leaves)
    row |= {"ms": ms, "gbps": case.bytes[mode] / ms / 1e6}
    if device == "cuda":
        row["gpu_ms"] = _device_ms(step, leaves)
    if mode in case.flops:
        row["tflops"] = case.flops[mode] / ms / 1e9
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "bench/results/kernels.jsonl"))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--kernels", default="rmsnorm,rope,swiglu,flce")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, checks the script only")
    args = p.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("bench_kernels: no CUDA GPU here; nothing to measure (use --smoke to test the "
              "script on the CPU with TRITON_INTERPRET=1)")
        return 0
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("bench_kernels --smoke on the CPU needs TRITON_INTERPRET=1")
        return 0
    tokens = 64 if args.smoke else args.tokens
    torch.backends.cuda.matmul.allow_tf32 = False
    kernels = set(args.kernels.split(","))
    env = run_metadata()
    providers = ["eager", "megatrain"] + ([] if args.no_inductor else ["inductor"])
    bench, compiled, rows = _timer(device), {}, []

    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  commit {env['commit']}")
    header = f"{'kernel':8} {'shape':28} {'mode':8} {'provider':9} {'ms':>9} {'GPU ms':>8} " \
             f"{'GB/s':>7} {'TFLOP/s':>7} {'peak GiB':>8} {'extra':>7} {'vs eager':>8}"
    print(header)
    for case in _cases(tokens, kernels, device, torch.bfloat16, args.smoke):
        for mode in ("fwd", "fwd+bwd"):
            eager_ms = None
            for provider in providers:
                try:
                    res = _run_one(case, provider, mode, device, bench, compiled)
                except torch.cuda.OutOfMemoryError as exc:
                    res = {"error": f"OOM: {str(exc).splitlines()[0]}"}
                finally:
                    if device == "cuda":
                        torch.cuda.empty_cache()
                row = {**env, "kernel": case.kernel, "shape": case.shape, "dtype": "bfloat16",
                       "mode": mode, "provider": provider, **res}
                rows.append(row)
                if "error" in res:
                    print(f"{case.kernel:8} {case.shape:28} {mode:8} {provider:9} {res['error']}")
                    continue
                if provider == "eager":
                    eager_ms = res["ms"]
                speed = f"{eager_ms / res['ms']:.2f}x" if eager_ms else "-"
                print(f"{case.kernel:8} {case.shape:28} {mode:8} {provider:9} {res['ms']:9.3f} "
                      f"{res.get('gpu_ms', 0):8.3f} {res['gbps']:7.0f} {res.get('tflops', 0):7.1f} "
                      f"{res.get('peak_gib', 0):8.2f} {res.get('extra_gib', 0):7.2f} {speed:>8}")
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
