"""Training throughput, side by side: GPU-resident torch, FSDP2 CPU offload, megatrain (issue 6).

Every system trains the same Llama shape on the same real tokens (the shipped corpus, byte
ids) with the same batch; each runs in its own subprocess so memory, pinned pools and
in-memory compile state never leak between them (Inductor's on-disk cache is shared: a
later child compiling the same graphs loads them, which saves compile time, not step
time). A first `probe` child measures, in the same run, the bf16 matmul rate at the
model's shapes (for MFU), pinned H2D bandwidth and the host's fused-AdamW memory bandwidth
(for the bound). Reported per system: tokens/s (median step
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
    python bench/train.py --model 1.3b --layers 8,16,32,64 --systems megatrain ...  # depth
        sweep at the 1.3B width (bench/depth_sweep.sh wraps it and prints the depth table)

Systems:
  resident-compiled / resident  model, fp32 master and AdamW on the GPU, bf16 autocast,
                           per-layer checkpointing, torch.compile or not
  fsdp2-offload            fully_shard(CPUOffloadPolicy(pin_memory=True)) at world size 1
  zero3-offload            DeepSpeed ZeRO-3 param+optimizer offload, when deepspeed imports
  megatrain                torch.compile(backend="megatrain") + megatrain.AdamW, bf16
A system that cannot run (out of memory, missing package) is recorded with its error, one
line with the bytes it needed and had; a system whose state cannot fit in host RAM (or, for
the resident systems, in GPU memory) is refused up front with the numbers, before the model
is built. Rows are appended to --out (default bench/results/train.jsonl) as each system
finishes; `bench/readme_table.py` renders them as the README's table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]

# This file is the entry point: arguments, the parent's loop and one child process per
# system. A child runs systems.run_system (or probe_rates.run_probe); the parent prints
# train_report's table. bench/ is sys.path[0]; none of these imports torch at import time
# (bench/readme_table.py imports MODELS and SYSTEMS from here without it).
from fit_check import _oom_line, _out_of_memory
from presets import MODELS, _config  # plan_preview imports _config from here
from probe_rates import run_probe
from systems import run_system
from train_report import _print_memory_at_peak, print_table

SYSTEMS = ("resident-compiled", "resident", "fsdp2-offload", "zero3-offload", "megatrain", "eager")
# megatrain --grad-ring without a size: the chunk size (4 chunks: 256 MiB of host memory for
# gradients). A size picks another: --grad-ring=128MiB, or the variant megatrain+grad-ring=128MiB.
GRAD_RING_CHUNK = "64MiB"


def _error_text(stderr: str, returncode: int) -> str:
    """The child's error for its row: the last exception with its whole message (Dynamo and
    megatrain errors span lines), or the signal that killed it (SIGKILL: the OOM killer)."""
    lines = stderr.strip().splitlines()
    if returncode < 0:
        name = signal.Signals(-returncode).name
        why = " (most likely the host's OOM killer)" if name == "SIGKILL" else ""
        return f"killed by {name}{why}; last output: {lines[-1] if lines else '-'}"
    if not lines:
        return f"exit {returncode}"
    tb = max((i for i, line in enumerate(lines) if line.startswith("Traceback")), default=None)
    if tb is None:
        return lines[-1]
    start = next((i for i in range(tb + 1, len(lines)) if not lines[i].startswith(" ")), len(lines) - 1)
    return " ".join(line.strip() for line in lines[start:start + 20])[:2000]


def _child(args, argv, system: str, layers: int | None = None) -> dict:
    """Run one system in its own process; "megatrain+backlog=host" adds --backlog=host to its flags,
    "megatrain+grad-ring=128MiB" --grad-ring=128MiB (variants of one system, alternated in
    one run, compare side by side)."""
    base, *flags = system.split("+")
    cmd = [sys.executable, __file__, "--system", base] + [a for a in argv if a != "--smoke"] \
        + [f"--{flag}" for flag in flags]
    if args.smoke:
        cmd += ["--model", "tiny", "--device", "cpu", "--precision", "fp32", "--tokens", "512",
                "--seq", "64", "--steps", "4", "--warmup", "1"]
    if layers:
        cmd += ["--layers", str(layers)]  # argparse keeps the last: one depth per child
    return run_child_process(cmd, base, args.timeout)


def run_child_process(cmd: list[str], base: str, timeout: float) -> dict:
    """Run a benchmark child and return its row: the last JSON line it printed, or the
    system's name with the error (a timeout, or the child's own words) where it failed."""
    try:
        # the repo first; a PYTHONPATH already set (carried wheels: deepspeed) stays after it
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONPATH": path})
    except subprocess.TimeoutExpired:
        return {"system": base, "error": f"timed out after {timeout} s"}
    if r.returncode == 0:  # the row is the last JSON line (libraries may print after it)
        return json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    print(r.stderr[-3000:], file=sys.stderr)
    return {"system": base, "error": _error_text(r.stderr, r.returncode)}


def main(argv=None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.3b", choices=sorted(MODELS))
    p.add_argument("--layers", default=None,
                   help="layer count(s) at the preset's width, e.g. 8,16,32,64 (default: the preset's)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--systems", default="resident-compiled,resident,fsdp2-offload,megatrain",
                   help="comma-separated, run in order; a variant adds flags to one entry "
                        "(megatrain+backlog=host); repeat entries (A,B,A,B) to see drift")
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--gpu-memory", default=None)
    p.add_argument("--optim-threads", default=None,
                   help="megatrain.AdamW threads; a list (16,8,8/bf16) sweeps them in one process, "
                        "each optionally with the gradients' transfer dtype")
    p.add_argument("--grad-slabs", default=None,
                   help="megatrain: after the timed steps, time again with each bound on the gradient "
                        "slabs in this list (2,auto,2,auto: alternate to see drift; auto: the "
                        "default, more while the host lags and host memory has room)")
    p.add_argument("--prefetch", type=int, default=None,
                   help="megatrain: force the most regions fetched ahead (default: the planner's)")
    p.add_argument("--updates", default=None, choices=("host", "auto", "device", "resident"),
                   help="megatrain: force where AdamW updates run (megatrain.config.updates; "
                        "default: the planner's)")
    p.add_argument("--backlog", default=None, choices=("host", "device"),
                   help="megatrain: compile option `backlog` (EDF updates, the rest deferred into the "
                        "next forward; gradients wait in host slabs or on the device); variant "
                        "megatrain+backlog=host")
    p.add_argument("--grad-ring", nargs="?", const=GRAD_RING_CHUNK, default=None, metavar="SIZE",
                   help=f"megatrain: compile option grad_chunk=SIZE (default {GRAD_RING_CHUNK!r}): "
                        "gradients cross in a ring of fixed-size chunks instead of two region slabs")
    p.add_argument("--keep-weights", action="store_true",
                   help="megatrain: compile option `keep_weights` (the backward reuses the forward's "
                        "weights where the budget has room; variant megatrain+keep-weights)")
    p.add_argument("--weight-shadow", action="store_true",
                   help="megatrain: compile option `weight_shadow` (weights stream from bf16 copies the "
                        "host optimizer keeps current: 2 B/param of H2D instead of 4; variant "
                        "megatrain+weight-shadow)")
    p.add_argument("--huge-pages", default="on", choices=("on", "off"),
                   help="megatrain's host state on transparent huge pages (MEGATRAIN_HUGE_PAGES; "
                        "off: torch's allocator); variant megatrain+huge-pages=off")
    p.add_argument("--keep-activations", default=None, choices=("on", "off"),
                   help="megatrain: force megatrain.config.keep_activations (on: every region saves "
                        "its matmul outputs for its backward, off: every region recomputes; default "
                        "the planner's choice); variant megatrain+keep-activations=off")
    p.add_argument("--checkpoint", default="layers", choices=("layers", "none"),
                   help="resident systems: recompute every decoder layer's forward in the backward "
                        "(per-layer activation checkpointing, the anchors' setting) or keep every "
                        "activation (the upper bound where it fits); variant "
                        "resident-compiled+checkpoint=none")
    p.add_argument("--no-offload", action="store_true",
                   help="megatrain: compile option offload=False (every boundary activation stays "
                        "on the device; the default lets the planner park them in host memory)")
    p.add_argument("--kernels", default=None,
                   help="megatrain: compile option `kernels`, comma-separated patterns (e.g. rmsnorm) "
                        "or 'all'; default: the backend's")
    p.add_argument("--timeout", type=int, default=600, help="seconds per system")
    p.add_argument("--profile", default=None,
                   help="directory: profile one more step per system, write its op tables there")
    p.add_argument("--memory-peak", action="store_true",
                   help="CUDA: after the timed steps, one more untimed step under the caching "
                        "allocator's history; print and record (row key memory_at_peak) what was "
                        "live at its allocated-bytes peak, by where it was allocated (bench/memory_peak.py)")
    p.add_argument("--memory-peak-snapshot", default=None, metavar="PATH",
                   help="with --memory-peak: also write that step's allocator snapshot there (a pickle "
                        "for pytorch.org/memory_viz; large)")
    p.add_argument("--out", default=None,
                   help="JSONL to append rows to (default bench/results/train.jsonl; --smoke: none)")
    p.add_argument("--system", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, eager vs megatrain")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.device, args.precision, args.tokens, args.seq = "tiny", "cpu", "fp32", 512, 64
        args.systems, args.steps, args.warmup = "eager,megatrain", 4, 1
    if args.out is None and not args.smoke:  # a smoke run's rows are not results
        args.out = str(REPO / "bench/results/train.jsonl")
    if args.system:
        if args.huge_pages == "off":  # before anything allocates host state
            os.environ["MEGATRAIN_HUGE_PAGES"] = "0"
        # a run child gets one depth (appended last); the probe measures widths only
        args.layers = int(args.layers) if args.layers and args.system != "probe" else None
        try:
            row = run_probe(args) if args.system == "probe" else run_system(args)
        except Exception as e:
            oom = _out_of_memory(e)
            if oom is None:
                raise
            raise SystemExit(_oom_line(*oom, args)) from None
        print(json.dumps(row))
        return 0
    from _results import append_rows, run_metadata

    systems = args.systems.split(",")
    for system in systems:
        if system.split("+")[0] not in SYSTEMS:
            raise SystemExit(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)} "
                             "(a variant adds flags: megatrain+backlog=host)")
    depths = [int(n) for n in args.layers.split(",")] if args.layers else [None]
    meta = run_metadata()
    start = time.perf_counter()
    progress = lambda msg: print(f"[{time.perf_counter() - start:5.0f} s] {msg}", flush=True)
    probe = None if args.smoke else _child(args, argv, "probe")
    rows = []
    for layers in depths:
        for system in systems:
            progress(f"{system} {args.model}" + (f" at {layers} layers" if layers else "") + " ...")
            row = _child(args, argv, system, layers)
            if "+" in system:
                row["variant"] = system
            row.update(model=args.model, layers=row.get("layers") or _config(args.model, layers).layers,
                       tokens_per_step=args.tokens, seq=args.seq, **meta)
            row.setdefault("gpu_memory", args.gpu_memory)  # a failed child's row too
            if probe and "error" not in probe and "error" not in row:
                row["mfu"] = row["tflops"] / probe["matmul_tflops"]
                if row.get("recompute_flops_per_step") is not None:
                    # the compute bound's share with the recompute counted (issue 35)
                    row["recompute_tflops"] = row["recompute_flops_per_step"] / row["step_s"] / 1e12
                    row["hfu"] = (row["tflops"] + row["recompute_tflops"]) / probe["matmul_tflops"]
                row["probe"] = probe
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("steps", "probe", "memory_at_peak")}),
                  file=sys.stderr)
            if args.out:
                append_rows(args.out, [row])  # row by row: a later system's crash loses nothing
            progress(f"  error: {row['error']}" if "error" in row else
                     f"  {row['step_s']:.3f} s/step, {row['tokens_per_s']:.0f} tok/s, peak GPU "
                     + (f"{row['peak_gpu_gib']:.2f} GiB" if row.get("peak_gpu_gib") is not None else "-")
                     + f", host {row['host_bytes_per_param']:.1f} B/param"
                     + (f", threads sweep {[(str(t['threads']) + '/' + t['grads'], round(t['step_s'], 3)) for t in row['threads_sweep']]}"
                        if row.get("threads_sweep") else "")
                     + (f", slabs sweep {[(t['grad_slabs'], round(t['step_s'], 3)) for t in row['slabs_sweep']]}"
                        if row.get("slabs_sweep") else ""))
            if row.get("memory_at_peak"):  # now, not with the table: a later system may time out
                _print_memory_at_peak(row["memory_at_peak"])
            if row.get("memory_at_peak_error"):
                progress(f"  --memory-peak failed: {row['memory_at_peak_error']}")
    print_table(rows, probe, depths)
    if args.memory_peak and not args.device.startswith("cuda"):
        print(f"--memory-peak: records the CUDA caching allocator; nothing recorded on {args.device}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
