"""Training throughput on models nobody adapted: stock Hugging Face `transformers` models,
GPU-resident under torch.compile beside megatrain, in bench/train.py's row format.

bench/train.py trains megatrain's own Llama, written beside the backend. This bench trains
the models users bring: `transformers` classes built from configs at released shapes
(bench/hf_models.py; random init, nothing downloaded, SDPA attention where transformers
allows it), each computing its own loss from the labels passed in, bf16, on the shipped
corpus's bytes as tokens. Each system runs in its own subprocess (bench/hf_systems.py says
how each is built), so memory, pinned pools and in-memory compile state never leak between
them. Rows go to --out (bench/results/train.jsonl) as each system finishes, with the
model's `family`; `bench/readme_table.py` renders them.

    python bench/hf_train.py --model llama-1.3b --tokens 16384 \\
        --systems resident-compiled,megatrain --steps 7 --warmup 4
    python bench/hf_train.py --model qwen3-moe-6b --systems megatrain --gpu-memory 16GiB
    python bench/hf_train.py --smoke     # CPU: every model scaled down, megatrain only

megatrain's budget: --gpu-memory, or, without it, one third of the peak GPU memory of the
resident-compiled row of the same run and model (list resident-compiled first); with
neither, the run is refused before anything starts. A variant forces one megatrain.config
decision for one entry (megatrain+updates=host, megatrain+prefetch=2): diagnostics beside
the defaults, left out of the README's table. A probe child first measures this machine's
bf16 matmul rate at the model's MLP shape (MFU) and its link and host AdamW rates, as
bench/train.py's does. Per system the row also has `first_step_s`: wall time from the
start of the model's build to the end of step 1 (the compile included), with `build_s`
and `compile_step_s` (step 1 alone) beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]

# None of these imports torch at import time.
from hf_models import MODELS, family, layers
from hf_systems import SYSTEMS
from train import run_child_process

# --smoke: CPU, fp32, every model at bench/hf_models.py's SMOKE scale, megatrain only, with
# a budget that holds any smoke model's step
SMOKE = dict(device="cpu", precision="fp32", tokens=256, seq=64, steps=2, warmup=1, gpu_memory="256MiB")
RESIDENT_SHARE = 3  # megatrain's default budget: the resident run's peak over this


def _child_cmd(args, model: str, system: str, gpu_memory: str | None) -> list[str]:
    """The child's command line: one model, one system, a variant's decisions as --force."""
    base, *flags = system.split("+")
    cmd = [sys.executable, __file__, "--system", base, "--model", model, "--tokens", str(args.tokens),
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--device", args.device, "--precision", args.precision]
    cmd += ["--gpu-memory", gpu_memory] if gpu_memory else []
    cmd += [a for flag in flags for a in ("--force", flag)]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--profile", args.profile] if args.profile else []
    cmd += ["--memory-peak"] if args.memory_peak else []
    return cmd


def _child(args, model: str, system: str, gpu_memory: str | None = None) -> dict:
    return run_child_process(_child_cmd(args, model, system, gpu_memory), system.split("+")[0],
                             args.timeout)


def _check_budget(args, systems: list[str]) -> None:
    """Refuse, before any child starts, a megatrain entry with no budget to run at."""
    if args.gpu_memory or args.smoke:
        return
    for i, system in enumerate(systems):
        if system.split("+")[0] == "megatrain" and "resident-compiled" not in systems[:i]:
            raise SystemExit(f"{system}: no --gpu-memory, and no resident-compiled entry before it whose "
                             f"peak GPU memory / {RESIDENT_SHARE} would be its budget: give --gpu-memory "
                             "or list resident-compiled first")


def main(argv=None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"comma-separated, run in order: {', '.join(MODELS)} (--smoke: default all)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=7, help="steps per system, the first compiling")
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the median step time")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated, run in order per model: {', '.join(SYSTEMS)} (default "
                        "resident-compiled,megatrain; --smoke: megatrain); a variant "
                        "forces one megatrain.config decision (megatrain+updates=host); repeat "
                        "entries (A,B,A,B) to see drift")
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--gpu-memory", default=None,
                   help="megatrain's budget (e.g. 12GiB). Default: the peak GPU memory of the "
                        f"resident-compiled row of the same run and model / {RESIDENT_SHARE}, so "
                        "resident-compiled must come first; without it this is required")
    p.add_argument("--timeout", type=int, default=900, help="seconds per system")
    p.add_argument("--profile", default=None,
                   help="directory: profile one more step per system, write its op tables there")
    p.add_argument("--memory-peak", action="store_true",
                   help="CUDA: one more untimed step under the allocator's history; record what was "
                        "live at its peak (row key memory_at_peak)")
    p.add_argument("--out", default=None,
                   help="JSONL to append rows to (default bench/results/train.jsonl; --smoke: none)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, fp32: every model (or --model's) scaled down, 2 steps, megatrain only")
    p.add_argument("--system", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--force", action="append", help=argparse.SUPPRESS)  # child: a variant's decisions
    args = p.parse_args(argv)
    if args.system:  # child mode: --smoke here only scales the model down
        from hf_systems import run_child

        print(json.dumps(run_child(args)))
        return 0
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.systems = args.systems or "megatrain"
    elif args.model is None:
        p.error("--model is required (but with --smoke)")
    if args.out is None and not args.smoke:  # a smoke run's rows are not results
        args.out = str(REPO / "bench/results/train.jsonl")
    args.systems = args.systems or "resident-compiled,megatrain"
    models = args.model.split(",") if args.model else list(MODELS)
    systems = args.systems.split(",")
    for name in models:
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    for system in systems:
        if system.split("+")[0] not in SYSTEMS:
            raise SystemExit(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)} "
                             "(a variant forces a decision: megatrain+updates=host)")
        if "+" in system and not system.startswith("megatrain+"):
            raise SystemExit(f"{system}: variants force megatrain.config decisions; megatrain only")
    if args.tokens % args.seq:
        raise SystemExit(f"--tokens {args.tokens} is not a multiple of --seq {args.seq}")
    _check_budget(args, systems)
    return _run(args, models, systems)


def _run(args, models: list[str], systems: list[str]) -> int:
    from _results import append_rows, run_metadata
    from train_report import print_table

    meta = run_metadata()
    start = time.perf_counter()
    progress = lambda msg: print(f"[{time.perf_counter() - start:5.0f} s] {msg}", flush=True)
    failed = False
    for model in models:
        probe = None if args.smoke or not args.device.startswith("cuda") else _child(args, model, "probe")
        if probe and "error" in probe:
            progress(f"probe failed: {probe['error']}")
        rows, resident_peak = [], None
        for system in systems:
            budget = args.gpu_memory
            if system.startswith("megatrain") and budget is None and resident_peak is not None:
                budget = f"{resident_peak / RESIDENT_SHARE:.1f}GiB"
            progress(f"{system} {model}" + (f" at gpu_memory={budget}" if system.startswith("megatrain") else "")
                     + " ...")
            if system.startswith("megatrain") and budget is None:
                row = {"system": "megatrain", "error": "no --gpu-memory, and the resident-compiled row "
                       f"of this run failed, so there is no peak / {RESIDENT_SHARE} to budget with"}
            else:
                row = _child(args, model, system, budget)
            if "+" in system:
                row["variant"] = system
            row.update(model=model, family=family(model), layers=row.get("layers") or layers(model), tokens_per_step=args.tokens,
                       seq=args.seq, **meta)
            if system.startswith("megatrain"):
                row["gpu_memory"] = budget
                if not args.gpu_memory and not args.smoke:
                    row["gpu_memory_from"] = f"resident-compiled peak_gpu_gib / {RESIDENT_SHARE}"
            else:
                row.setdefault("gpu_memory", None)
            if probe and "error" not in probe and "error" not in row:
                row["mfu"] = row["tflops"] / probe["matmul_tflops"]
                row["probe"] = probe
            if system == "resident-compiled" and row.get("peak_gpu_gib"):
                resident_peak = row["peak_gpu_gib"]
            rows.append(row)
            failed |= "error" in row
            print(json.dumps({k: v for k, v in row.items() if k not in ("probe", "memory_at_peak")}),
                  file=sys.stderr)
            if args.out:
                append_rows(args.out, [row])  # row by row: a later system's crash loses nothing
            progress(f"  error: {row['error']}" if "error" in row else
                     f"  {row['step_s']:.3f} s/step, {row['tokens_per_s']:.0f} tok/s, first step after "
                     f"{row['first_step_s']:.1f} s, peak GPU "
                     + (f"{row['peak_gpu_gib']:.2f} GiB" if row.get("peak_gpu_gib") is not None else "-")
                     + f", host {row['host_bytes_per_param']:.1f} B/param, losses "
                     + ", ".join(f"{v:.3f}" for v in row["losses"]))
        print(f"\n{model} ({family(model)})")
        print_table(rows, probe, [None])
    return 1 if failed and args.smoke else 0


if __name__ == "__main__":
    raise SystemExit(main())
