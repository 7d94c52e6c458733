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
import collections
import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]

MODELS = {"1.3b": "1b", "3b": "3b", "8b": "8b", "tiny": "tiny"}  # bench name -> preset
SYSTEMS = ("resident-compiled", "resident", "fsdp2-offload", "zero3-offload", "megatrain", "eager")
HOST_BYTES_PER_PARAM = 34  # DESIGN.md / issue 6: fp32 master+m+v read+write, bf16 w and g
# Host RAM a system holds per parameter, checked against MemAvailable before the model is
# built, so a model that cannot fit is refused with numbers instead of OOM-killed minutes in.
# FSDP2: fp32 param + grad + m + v (16 B) plus the pinned allocator's power-of-two rounding:
# ~18 B/param at 1.3B (baseline row, RSS less the CUDA context). megatrain: fp32 master, m,
# v (12 B) plus gradient slabs: 12.5-13 predicted in NOTES.md (17.4 measured before the
# pinned-rounding fixes), so the check is a floor: passing it does not promise a fit.
# ZeRO-3 offload: fp32 master, m, v and gradients (16 B) plus the bf16 parameters it offloads.
HOST_STATE_BYTES_PER_PARAM = {"fsdp2-offload": 18, "zero3-offload": 18, "megatrain": 13}
# megatrain --grad-ring without a size: the chunk size (4 chunks: 256 MiB of host memory for
# gradients). A size picks another: --grad-ring=128MiB, or the variant megatrain+grad-ring=128MiB.
GRAD_RING_CHUNK = "64MiB"
GPU_STATE_BYTES_PER_PARAM = 16  # resident: fp32 weight, grad, AdamW m and v on the GPU
MEMORY_PEAK_ENTRIES = 1_000_000  # --memory-peak: the allocator's ring buffer, events (a few KB each)
_phase = "setup"  # what the child was doing, for the out-of-memory line


def _tokens(n: int, vocab: int):
    import numpy as np
    import torch

    raw = (REPO / "megatrain/data/shakespeare.txt").read_bytes()
    ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int64) % vocab
    reps = -(-n // len(ids))
    return torch.from_numpy(np.tile(ids, reps)[:n].copy())


def _config(name: str, layers: int | None = None):
    """The preset's config; `layers` overrides its depth at the same width (depth sweep)."""
    import dataclasses

    from megatrain.models import PRESETS

    cfg = PRESETS[MODELS[name]]
    return dataclasses.replace(cfg, layers=layers) if layers else cfg


def _model(name: str, layers: int | None = None):
    import torch

    from megatrain.models import Llama

    torch.manual_seed(0)
    return Llama(_config(name, layers))


def _param_count(name: str, layers: int | None = None) -> int:
    """Parameters of the model, counted on the meta device: no memory, no init time (8B)."""
    import torch

    from megatrain.models import Llama

    with torch.device("meta"):
        return sum(p.numel() for p in Llama(_config(name, layers)).parameters())


def _refuse_if_unfit(system: str, n_params: int, device) -> None:
    """SystemExit with the numbers when the system's state alone exceeds host RAM or, for
    the resident systems, the GPU: cheaper than building an 8B model to find out."""
    import torch

    g = 2**30
    if system in HOST_STATE_BYTES_PER_PARAM:
        need, have = HOST_STATE_BYTES_PER_PARAM[system] * n_params, _mem_available()
        if need > have:
            raise SystemExit(f"{system}: host state {HOST_STATE_BYTES_PER_PARAM[system]} B/param x "
                             f"{n_params / 1e9:.2f} G params = {need / g:.1f} GiB needed, "
                             f"{have / g:.1f} GiB host RAM available (MemAvailable)")
    if system in ("resident-compiled", "resident", "eager") and device.type == "cuda":
        need = GPU_STATE_BYTES_PER_PARAM * n_params
        have = torch.cuda.get_device_properties(device).total_memory
        if need > have:
            raise SystemExit(f"{system}: fp32 weights, grads and AdamW m, v alone are "
                             f"{GPU_STATE_BYTES_PER_PARAM} B/param x {n_params / 1e9:.2f} G params = "
                             f"{need / g:.1f} GiB, more than the GPU's {have / g:.1f} GiB")


def _out_of_memory(e: BaseException | None) -> tuple[str, BaseException] | None:
    """("gpu" or "host", the allocation failure) when `e` is one or wraps one (Dynamo wraps
    errors raised while compiling); else None."""
    import torch

    for _ in range(10):
        if e is None:
            return None
        if isinstance(e, torch.OutOfMemoryError) or "CUDA out of memory" in str(e):
            return "gpu", e
        if isinstance(e, MemoryError) or "can't allocate memory" in str(e):
            return "host", e
        e = e.__cause__ or e.__context__
    return None


def _oom_line(kind: str, e: BaseException, args) -> str:
    """One line for the row: where it ran out, what it asked for, what it had and needed."""
    import torch

    g = 2**30
    n = _param_count(args.model, args.layers)
    asked = re.search(r"(?:[Tt]ried to allocate|Unable to allocate) ([\d.]+ ?[KMGT]?i?B|\d+ bytes)", str(e))
    asked = f"asked for {asked.group(1)}, " if asked else ""
    if kind == "host":
        return (f"{args.system}: out of host memory in {_phase} ({asked}peak RSS "
                f"{_status('VmHWM') / g:.1f} GiB, MemAvailable now {_mem_available() / g:.1f} GiB; "
                f"{n / 1e9:.3g} G params)")
    device = torch.device(args.device)
    total = torch.cuda.get_device_properties(device).total_memory
    if args.system == "megatrain":
        need = f"gpu_memory={args.gpu_memory}"
    else:
        need = (f"weights, grads and AdamW m, v alone are {GPU_STATE_BYTES_PER_PARAM} B/param x "
                f"{n / 1e9:.3g} G params = {GPU_STATE_BYTES_PER_PARAM * n / g:.1f} GiB")
    return (f"{args.system}: out of GPU memory in {_phase} ({asked}peak allocated "
            f"{torch.cuda.max_memory_allocated(device) / g:.1f} GiB of {total / g:.1f} GiB; {need})")


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


def _checkpoint_layers(model) -> None:
    import torch.utils.checkpoint as ckpt

    for layer in model.layers:
        forward = layer.forward
        layer.forward = lambda *a, _f=forward: ckpt.checkpoint(_f, *a, use_reentrant=False)


def _rss_phases(rss: dict[str, tuple[int, int, int, int, int]], base: int, anon_base: int,
                n_params: int) -> dict[str, dict[str, float]]:
    """B/param over the baseline at each marked point: the peak RSS so far, the RSS then, and
    its anonymous part (RssAnon: without the file-backed pages of the libraries and code the
    process maps, and without shared memory, which is where cudaHostAlloc's pinned pages
    count: _largest_mappings names both); then the shared part (RssShmem) and the bytes
    torch's pinned allocator holds, in GiB, to tell whose the shared pages are; at the end
    also after glibc's malloc_trim, which shows how much is freed heap the process keeps."""
    rss = dict(rss, end=_memory_now())
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        rss["end_trimmed"] = _memory_now()
    except (OSError, AttributeError):  # not glibc
        pass
    return {k: {"peak": round((hwm - base) / n_params, 3), "now": round((cur - base) / n_params, 3),
                "anon": round((anon - anon_base) / n_params, 3), "shmem_gib": round(shmem / 2**30, 3),
                "pinned_gib": round(pinned / 2**30, 3)}
            for k, (hwm, cur, anon, shmem, pinned) in rss.items()}


def _largest_mappings(n: int = 6) -> list[str]:
    """The process's `n` largest mappings by resident bytes other than plain anonymous
    memory, from /proc/self/smaps: what the RSS beyond RssAnon is (library images, pinned
    memory the CUDA driver maps, shared memory)."""
    rows, name, anonymous = [], None, False
    try:
        for line in open("/proc/self/smaps"):
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:  # a mapping's header line
                name = head[5] if len(head) > 5 else "[anon]"
                anonymous = len(head) <= 5 or name in ("[heap]", "[stack]")
            elif head and head[0] == "Rss:" and not anonymous:
                rows.append((int(head[1]) * 1024, name))
    except OSError:
        return []
    merged: dict[str, int] = {}
    for nbytes, nm in rows:
        merged[nm] = merged.get(nm, 0) + nbytes
    return [f"{b / 2**20:.0f} MiB {nm}" for nm, b in sorted(merged.items(), key=lambda kv: -kv[1])[:n]]


def _memory_now() -> tuple[int, int, int, int, int]:
    """This process's peak RSS so far, RSS, anonymous and shared RSS, and the bytes torch's
    pinned allocator holds (cached blocks included), in bytes."""
    return _status("VmHWM"), _status("VmRSS"), _status("RssAnon"), _status("RssShmem"), _pinned_bytes()


def _pinned_bytes() -> int:
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    return int(stats.get("allocated_bytes.current", 0))


class _PinnedWatch:
    """Who takes blocks from torch's pinned allocator (issue 4: 1 GiB of it appears in the
    first backward, and none of megatrain's buffers come from it): a thread polls its bytes
    every millisecond and, each time they grow, keeps the Python stacks of the other threads
    then. A copy into a fresh pinned block takes ~20 ms per GB, so the allocating frame is
    still on its stack when the poll sees the bytes."""

    def __init__(self, most: int = 4):
        self.events: list[dict] = []
        self._most, self._stop = most, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        seen = _pinned_bytes()
        while not self._stop.wait(0.001) and len(self.events) < self._most:
            now = _pinned_bytes()
            if now > seen:
                frames = sys._current_frames()
                me = threading.get_ident()
                stacks = {str(t): [f"{fs.filename.rsplit('site-packages/', 1)[-1]}:{fs.lineno} {fs.name}"
                                   for fs in traceback.extract_stack(f)[-10:]]
                          for t, f in frames.items() if t != me}
                # Held past here, the frames keep their locals alive: the autotuner's pinned
                # copy among them, which is what kept a 1 GiB block in use (session 10).
                del frames
                self.events.append({"phase": _phase, "from_bytes": seen, "to_bytes": now, "stacks": stacks})
                seen = now


def _pinned_holders(least: int = 256 << 20) -> dict:
    """Who still holds torch's pinned blocks at the end (issue 4: after the first backward
    megatrain gives back what the allocator caches unused, yet one 1 GiB block of Inductor's
    autotuner stayed in use on the H200): the pinned bytes before and after a garbage
    collection and an empty-cache, and for each pinned tensor of at least `least` bytes
    still alive, the types of what refers to it."""
    import gc

    import torch

    from megatrain.memory.host_store import release_cached_pinned_blocks

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    before = _pinned_bytes()
    holders = []
    for obj in gc.get_objects():
        try:
            big = isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.is_pinned() \
                and obj.untyped_storage().nbytes() >= least
        except Exception:  # objects that half-exist during collection
            continue
        if big:
            holders.append({"bytes": obj.untyped_storage().nbytes(), "shape": list(obj.shape),
                            "referrers": [type(r).__qualname__ + (f" {_dict_keys(r)}" if isinstance(r, dict) else "")
                                          for r in gc.get_referrers(obj)][:8]})
    release_cached_pinned_blocks()
    return {"before": before, "after_gc_and_empty_cache": _pinned_bytes(), "tensors": holders[:6]}


def _dict_keys(d: dict) -> list[str]:
    """A referring dict's first keys, for the log: strings as they are, anything else (a
    tensor-keyed optimizer state, which cannot be sorted or printed briefly) by its type."""
    return sorted(k if isinstance(k, str) else type(k).__name__ for k in list(d)[:64])[:8]


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


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _smaps_rollup(key: str) -> int:
    """A field of /proc/self/smaps_rollup in bytes (0 where the kernel has none)."""
    try:
        with open("/proc/self/smaps_rollup") as fh:
            return next((int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":")), 0)
    except OSError:
        return 0


def _mem_available() -> int:
    from megatrain.memory.host_store import available_host_bytes

    return available_host_bytes() or 0


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

    cfg = _config(args.model)
    rows = min(args.tokens, 16384)
    a = torch.randn(rows, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(cfg.hidden, cfg.ffn, device="cuda", dtype=torch.bfloat16)
    a @ b
    mm = _median_s(lambda: a @ b, 10)
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    h2d = _median_s(lambda: dst.copy_(src, non_blocking=True))
    n = 1 << 27
    from megatrain.memory.host_store import host_zeros

    rates = {}
    # torch's allocator (what adamw_gbs, the issue's bound, always measured) and megatrain's
    # host_zeros (transparent huge pages: session 16), each alone and beside both DMAs
    for name, alloc in (("adamw", lambda k: torch.empty(k)), ("adamw_huge_pages", lambda k: host_zeros(k, torch.float32))):
        rates.update(_adamw_rates(name, _fused_adamw_step(n, alloc), n, src, dst, {"dma": ("h2d", "d2h")}))
    try:
        rates.update(_adamw_at_training_threads(n, src, dst))
    except Exception as e:  # noqa: BLE001
        rates["adamw_training_threads_error"] = repr(e)
    return {"system": "probe", "matmul_tflops": 2 * rows * cfg.hidden * cfg.ffn / mm / 1e12,
            "h2d_gbs": (1 << 30) / h2d / 1e9, **rates,
            "threads": torch.get_num_threads(), "host": host_facts()}


def _fused_adamw_step(n: int, alloc):
    """One fused AdamW step over fresh n-element param, grad and moments from `alloc`, as
    torch.optim.AdamW(fused=True) runs it on the CPU."""
    import torch

    p, g, m, v = (alloc(n) for _ in range(4))
    for t in (p, g, m):
        t.normal_()
    v.copy_(g).mul_(g)
    count = torch.zeros(())

    def step() -> None:
        torch._fused_adamw_([p], [g], [m], [v], [], [count], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    return step


def _adamw_rates(prefix: str, step, n: int, pinned, device_buf, sides: dict) -> dict:
    """AdamW's rate over `n` elements alone (`{prefix}_gbs`), then beside each set of DMA
    directions in `sides` (label -> directions): its rate, how many steps ran and the
    copies' own rates meanwhile. A failure beside the DMA is a diagnostic, recorded as
    `{prefix}_beside_{label}_error`: it must not cost the run its probe."""
    step()  # first touch
    rates = {f"{prefix}_gbs": 28 * n / _median_wall_s(step, 3) / 1e9}
    for label, directions in sides.items():
        try:
            beside = _adamw_beside_dma(step, pinned, device_buf, directions)
        except Exception as e:  # noqa: BLE001
            rates[f"{prefix}_beside_{label}_error"] = repr(e)
            continue
        rates[f"{prefix}_beside_{label}_gbs"] = 28 * n / beside["seconds"] / 1e9
        rates[f"{prefix}_adamw_steps_beside_{label}"] = beside["steps"]
        rates[f"{prefix}_{label}_beside_adamw_gbs"] = beside["dma_gbs"]
    return rates


def _adamw_beside_dma(adamw_step, pinned, device_buf, directions) -> dict:
    """The host AdamW step's median time while DMA copies pinned host memory flat out in
    `directions` ("h2d", "d2h"), as in a streamed step (lent hosts with the same rate alone
    differed 2x inside training), and the copies' rates meanwhile: AdamW steps run until
    the copies are done."""
    import torch

    back = torch.empty(pinned.shape, dtype=pinned.dtype, pin_memory=True)
    out = torch.empty_like(device_buf)
    pairs = {"h2d": (device_buf, pinned), "d2h": (back, out)}
    copies = 40  # 40 GiB a direction, ~0.9 s with both directions at once
    marks, streams = [], [torch.cuda.Stream() for _ in directions]
    for direction, stream in zip(directions, streams):
        a, b = pairs[direction]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            for _ in range(copies):
                a.copy_(b, non_blocking=True)
            end.record()
        marks.append((start, end))
    times = []
    while not all(end.query() for _, end in marks):
        t0 = time.perf_counter()
        adamw_step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return {"seconds": statistics.median(times), "steps": len(times),
            "dma_gbs": [copies * pinned.numel() / (s.elapsed_time(e) / 1e3) / 1e9 for s, e in marks]}


def _adamw_at_training_threads(n: int, pinned, device_buf) -> dict:
    """Huge-page AdamW at the thread count training gives the optimizer (half the cores,
    compiler/backend.py), alone and beside each DMA direction and both: whether the
    in-training update rate is bound by its threads or by the copies' share of DRAM."""
    import torch

    from megatrain.memory.host_store import host_zeros

    before = torch.get_num_threads()
    threads = max(1, before // 2)
    torch.set_num_threads(threads)
    try:
        step = _fused_adamw_step(n, lambda k: host_zeros(k, torch.float32))
        sides = {"h2d": ("h2d",), "d2h": ("d2h",), "dma": ("h2d", "d2h")}
        return {"adamw_training_threads": threads,
                **_adamw_rates("adamw_training_threads", step, n, pinned, device_buf, sides)}
    finally:
        torch.set_num_threads(before)


def _median_wall_s(fn, repeats: int) -> float:
    """Median host wall time of `fn` (host work: `_median_s` times the device's)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_facts() -> dict:
    """What may tell lent hosts apart: CPU model, NUMA layout, transparent huge pages."""
    def read(path: str) -> str | None:
        try:
            return open(path).read().strip()
        except OSError:
            return None

    nodes = sorted(glob.glob("/sys/devices/system/node/node[0-9]*"))
    model = next((line.split(":", 1)[1].strip() for line in (read("/proc/cpuinfo") or "").splitlines()
                  if line.startswith("model name")), None)
    return {"cpu": model, "cpus_allowed": len(os.sched_getaffinity(0)),
            "numa_cpus": [read(f"{n}/cpulist") for n in nodes],
            "l3": read("/sys/devices/system/cpu/cpu0/cache/index3/size"),
            "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "kernel": os.uname().release}


def _streamers(plan) -> list:
    """The runtime streamer of each graph in `megatrain.explain(...)`'s plan that has one."""
    return [g.streamer for g in plan.graphs if g.streamer is not None]


def _megatrain_stats(step_fn) -> dict:
    import megatrain
    from megatrain.memory import host_store

    plan = megatrain.explain(step_fn)
    streamers = _streamers(plan)
    stats = [s.last_stats for s in streamers if s.last_stats is not None]
    # as the runtime runs them: with the update sites in effect (resident regions move nothing)
    schedules = [g.predicted_schedule for g in plan.graphs if g.schedule is not None]

    def per_step(stream: str) -> float:  # the cost model's busy seconds of one stream
        return sum(sum(s.end[t] - s.start[t] for t in s.streams[stream]) / s.steps for s in schedules)

    def measured(pairs: str) -> float:  # seconds covered by the last step's CUDA event pairs
        return sum(s.event_seconds(pairs) for s in stats)

    return {"predicted_step_s": plan.predicted_step_s,
            # regions whose forward weights the plans keep for the backward (keep_weights)
            "kept_regions": sum(len(s.config.kept) for s in schedules),
            "predicted_compute_s": per_step("compute"), "predicted_h2d_s": per_step("h2d"),
            "predicted_d2h_s": per_step("d2h"), "predicted_host_s": per_step("host"),
            "measured_compute_s": measured("computes"), "measured_d2h_s": measured("grad_copies"),
            "grad_slab_bytes": sum(s._slabs.allocated * s._slabs.slab_bytes for s in streamers),
            "grad_own_buffers": sum(s._slabs.own_buffers for s in streamers),
            "grad_ring_bytes": sum(s._ring.allocated * s._ring.chunk_bytes for s in streamers if s._ring),
            # the device memory the plan leaves free (device-site updates, the backlog) and
            # how many regions' gradients waited there over the whole run (backlog="device")
            "update_reserve_bytes": sum(s.reserve.nbytes for s in streamers if s.reserve is not None),
            # ... as the compile planned it (updates="resident" grows it from a measured step)
            "update_reserve_planned_bytes": sum(g.update_reserve for g in plan.graphs),
            "backlogged_regions_total": sum(s.backlog.backlogged for s in streamers if s.backlog is not None),
            # updates="resident": regions whose AdamW state lives on the GPU, its bytes, and
            # the regions sent home (why) over the run
            "resident_regions": sum(len(s.resident.regions) for s in streamers if s.resident is not None),
            "resident_bytes": sum(sum(s.resident.held.values()) for s in streamers if s.resident is not None),
            "resident_params": sum(s.params[p].numel() for s in streamers if s.resident is not None
                                   for pids in s.resident.regions.values() for p in pids),
            "resident_demoted": {r: why for s in streamers if s.resident is not None
                                 for r, why in s.resident.demoted.items()},
            "device_update_sites": sum(list(g.update_sites.values()).count("device") for g in plan.graphs),
            "page_lock_failures": list(host_store.register_failures),
            "planned_with": sorted({g.schedule.rates.device for g in plan.graphs if g.schedule is not None}),
            "planned_rates": next((g.schedule.rates.to_json() for g in plan.graphs if g.schedule is not None), None),
            "h2d_bytes": sum(s.h2d_bytes for s in stats), "d2h_bytes": sum(s.d2h_bytes for s in stats),
            "transfer_stall_s": sum(s.transfer_stall_s() for s in stats),
            "optimizer_wait_s": sum(s.optimizer_wait_s for s in stats),
            "slab_wait_s": sum(s.slab_wait_s for s in stats),
            # backlog: regions whose update the last backward's end deferred into the forward
            "deferred_regions": sum(s.deferred_regions for s in stats),
            # the last step's host updates by the phase they began in (does the host's rate
            # fall beside the forward's weight copies?)
            "host_updates_by_phase": _merge_phases(s.host_updates_by_phase() for s in stats),
            "cast_wait_s": sum(s.cast_wait_s for s in stats),
            "fetch_paths": dict(sum((s.fetch_paths for s in stats), collections.Counter())),
            "h2d_busy_s": sum(s.h2d_busy_s() for s in stats),
            "stall_by_region": [{r: round(t, 4) for r, t in s.stall_by_region().items() if t > 1e-4}
                                for s in stats]}


def _merge_phases(per_streamer) -> dict:
    out: dict = {}
    for phases in per_streamer:
        for phase, row in phases.items():
            into = out.setdefault(phase, {"updates": 0, "params": 0, "busy_s": 0.0})
            for k, v in row.items():
                into[k] += v
    return out


def run_system(args) -> dict:
    global _phase
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
    _phase = "building the model"
    model = _model(args.model, args.layers)
    _phase = "setting up"
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
    if args.system in ("resident-compiled", "resident", "eager"):
        model = model.to(device)
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
        forced = {"prefetch": args.prefetch, "updates": args.updates}
        if args.backlog:
            forced["backlog"] = args.backlog
        if args.grad_ring:
            forced["grad_chunk"] = args.grad_ring
        if args.no_offload:
            forced["offload"] = False
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
        global _phase
        times, phases, loss = [], [], None
        host_busy = getattr(opt, "host_busy_s", None)  # megatrain.AdamW's measured update time
        for i in range(count):
            compiling = first and start + i == 0 and args.system in ("resident-compiled", "megatrain")
            _phase = f"step {i} forward" + (" (compiling)" if compiling else "")
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
            _phase = f"step {i} backward" + (" (compiling)" if compiling else "")
            backward(loss)
            t2 = time.perf_counter()
            if compiling:  # the backward compiled, gradients through the slabs
                mark("first_backward")
            _phase = f"step {i} optimizer"
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
        "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "host_rss_gib": _status("VmHWM") / 2**30, "gpu_memory": args.gpu_memory, "steps": times,
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
        "keep_weights": args.keep_weights if args.system == "megatrain" else None,
        "weight_shadow": args.weight_shadow if args.system == "megatrain" else None,
        **{k: statistics.median(p[k] for p in timed) for k in timed[0]},
    }
    if sweep:
        row["threads_sweep"] = sweep
    if slabs_sweep:
        row["slabs_sweep"] = slabs_sweep
    if args.system == "megatrain":
        row.update(_megatrain_stats(step_fn))
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


def _memory_at_peak(args, device, step) -> dict:
    """Run `step` once under the CUDA allocator's history (bench/memory_peak.py): the bytes
    live at its allocated-bytes peak, replayed from the trace, beside max_memory_allocated()
    for the same step, and the live blocks grouped by where they were allocated; blocks
    allocated before the step are named by the tensor that owns them. The same at the
    active-bytes peak (frees still waiting on record_stream events count)."""
    import torch

    from memory_peak import BEFORE, group_by_origin, live_at_peak, recording, tensor_labels

    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)  # the streamer's begin_step resets it too
    with recording(MEMORY_PEAK_ENTRIES):
        step()
        torch.cuda.synchronize(device)
        max_allocated = torch.cuda.max_memory_allocated(device)
        max_active = torch.cuda.memory_stats(device).get("active_bytes.all.peak")
        snapshot = torch.cuda.memory._snapshot()  # inside: turning recording off clears the trace
    if args.memory_peak_snapshot:  # for pytorch.org/memory_viz
        import pickle

        Path(args.memory_peak_snapshot).parent.mkdir(parents=True, exist_ok=True)
        Path(args.memory_peak_snapshot).write_bytes(pickle.dumps(snapshot))
    traces = snapshot["device_traces"]
    entries = len(traces[index]) if index < len(traces) else 0
    peak, blocks = live_at_peak(snapshot, index)
    active_peak, active_blocks = live_at_peak(snapshot, index, freed_at="free_completed")
    before = [b for b in blocks + active_blocks if b.get("origin") == BEFORE]
    labels = tensor_labels({b["addr"]: b["size"] for b in before}) if before else {}
    for b in before:
        if b["addr"] in labels:
            b["origin"] = f"{BEFORE}: {labels[b['addr']]}"
    return {"peak_bytes": peak, "max_memory_allocated": max_allocated, "groups": group_by_origin(blocks),
            "active_peak_bytes": active_peak, "max_active_bytes": max_active,
            "active_groups": group_by_origin(active_blocks, top=10),
            # a full ring buffer dropped the step's first events: the peak may precede them
            "trace_entries": entries, "trace_full": entries >= MEMORY_PEAK_ENTRIES}


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
    layers = args.layers or _config(args.model).layers
    (out / f"profile_{args.system}_{args.model}_L{layers}_{args.tokens}.txt").write_text(
        f"{args.system} {args.model} {args.tokens} tokens: by GPU time\n"
        + events.table(sort_by=sort, row_limit=40, max_name_column_width=70)
        + "\nby host self time\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))


def _bound(row: dict, probe: dict, compiled_step: float | None) -> dict:
    """The step-time bound of issue 6: max(compute, host memory traffic, PCIe). Parameters
    whose AdamW state stays on the GPU (updates="resident") cross no host memory, so the
    host term counts only the others."""
    host_params = row["params"] - (row.get("resident_params") or 0)
    # the faster allocation's rate: megatrain's state sits on huge pages where they help
    adamw_gbs = max(probe["adamw_gbs"], probe.get("adamw_huge_pages_gbs") or 0)
    host_s = HOST_BYTES_PER_PARAM * host_params / (adamw_gbs * 1e9)
    pcie_s = max(row.get("h2d_bytes", 0), row.get("d2h_bytes", 0)) / (probe["h2d_gbs"] * 1e9)
    terms = {"bound_compute_s": compiled_step, "bound_host_s": host_s, "bound_pcie_s": pcie_s}
    bound = max(v for v in terms.values() if v is not None)
    return {**terms, "bound_s": bound, "fraction_of_bound": bound / row["step_s"]}


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
    try:
        # the repo first; a PYTHONPATH already set (carried wheels: deepspeed) stays after it
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                           env={**os.environ, "PYTHONPATH": path})
    except subprocess.TimeoutExpired:
        return {"system": base, "error": f"timed out after {args.timeout} s"}
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
    p.add_argument("--prefetch", type=int, default=1, help="megatrain regions fetched ahead")
    p.add_argument("--updates", default="host", choices=("host", "auto", "device", "resident"),
                   help="megatrain: where AdamW updates run (compile option `updates`)")
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
    progress = lambda msg: print(f"[{time.perf_counter() - start:5.0f} s] {msg}", flush=True)  # noqa: E731
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
    compiled_at = {r["layers"]: r["step_s"] for r in rows if r["system"] == "resident-compiled" and "step_s" in r}
    print(f"probe: {probe}")
    print(f"{'system':18s} {'tok/s':>8s} {'TFLOP/s':>7s} {'MFU':>5s} {'step s':>6s} {'GPU GiB':>7s} "
          f"{'RSS GiB':>7s} {'B/par':>5s} {'vs comp':>7s} {'stall s':>7s} {'optw s':>6s} {'PCIe':>5s} {'bound':>5s}")
    for r in rows:
        name = r.get("variant", r["system"])
        name = f"{name} L{r['layers']}" if len(depths) > 1 else name
        if "error" in r:
            print(f"{name:18s} error: {r['error']}")
            continue
        compiled = compiled_at.get(r["layers"])
        b = _bound(r, probe, compiled) if probe and "error" not in probe else {}
        f = lambda k, fmt: format(r[k], fmt) if r.get(k) is not None else "-"  # noqa: E731
        print(f"{name:18s} {r['tokens_per_s']:8.0f} {r['tflops']:7.1f} {f('mfu', '5.2f')} "
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
            print(f"{'':18s} per step predicted/measured: compute {r['predicted_compute_s']:.3f}/"
                  f"{r['measured_compute_s']:.3f} s, host updates {r['predicted_host_s']:.3f}/"
                  f"{r.get('host_busy_s') or 0:.3f} s, gradient copies {r['predicted_d2h_s']:.3f}/"
                  f"{r['measured_d2h_s']:.3f} s, weight copies {r['predicted_h2d_s']:.3f}/{r['h2d_busy_s']:.3f} s")
        if r.get("h2d_copy_gbs"):
            print(f"{'':18s} host blocked: on gradient slabs {r.get('slab_wait_s', 0):.3f} s, on host casts "
                  f"{r.get('cast_wait_s', 0):.3f} s; weight fetch paths {r.get('fetch_paths')}; "
                  f"reserve beside the plan {r.get('update_reserve_bytes', 0) / 2**30:.2f} GiB "
                  f"(planned {(r.get('update_reserve_planned_bytes') or 0) / 2**30:.2f}), "
                  f"regions backlogged over the run {r.get('backlogged_regions_total')}, "
                  f"deferred at the last backward's end {r.get('deferred_regions')}; "
                  f"resident regions {r.get('resident_regions')} "
                  f"({(r.get('resident_bytes') or 0) / 2**30:.2f} GiB, sent home {r.get('resident_demoted')}), "
                  f"device-update sites {r.get('device_update_sites')}")
            phases = r.get("host_updates_by_phase") or {}
            if phases:
                print(f"{'':18s} host updates by phase (G params/s): " + ", ".join(
                    f"{k} {v['updates']} in {v['busy_s']:.3f} s ({v['params'] / max(v['busy_s'], 1e-9) / 1e9:.2f})"
                    for k, v in phases.items()))
            print(f"{'':18s} weight copies: {r['h2d_busy_s']:.3f} s busy at {r['h2d_copy_gbs']:.1f} GB/s; "
                  f"stall by region: {r.get('stall_by_region')}")
        if r.get("host_bytes_per_param_phases"):
            print(f"{'':18s} host B/param (peak/now/anon), GiB (shmem/pinned allocator): " + ", ".join(
                f"{k} {v['peak']:.2f}/{v['now']:.2f}/{v.get('anon', float('nan')):.2f}"
                f" ({v.get('shmem_gib', float('nan')):.2f}/{v.get('pinned_gib', float('nan')):.2f})"
                for k, v in r["host_bytes_per_param_phases"].items()))
        if r.get("host_anon_huge_gib") is not None:
            print(f"{'':18s} anonymous memory on huge pages at the end: {r['host_anon_huge_gib']:.1f} GiB")
        if r.get("host_largest_mappings"):
            print(f"{'':18s} RssFile/RssShmem GiB {r['host_rss_file_shmem_gib']}, largest "
                  f"non-anonymous mappings: {r['host_largest_mappings']}; torch pinned allocator "
                  f"{r.get('pinned_allocator')}; gradients outside the slabs "
                  f"{r.get('grad_own_buffers')}, page-lock failures {r.get('page_lock_failures')}; "
                  f"gradient slabs {r.get('grad_slab_bytes')} B, ring {r.get('grad_ring_bytes')} B")
        if r.get("pinned_holders"):
            print(f"{'':18s} pinned blocks held at the end: {r['pinned_holders']}")
        for ev in r.get("pinned_growth") or []:
            print(f"{'':18s} pinned allocator {ev['from_bytes']} -> {ev['to_bytes']} B in {ev['phase']}; stacks:")
            for tid, frames in ev["stacks"].items():
                print(f"{'':20s}thread {tid}: " + " <- ".join(reversed(frames[-6:])))
        print(f"{'':18s} host time in calls: " + ", ".join(
            f"{k[:-2]}={r[k]:.3f}" for k in ("forward_call_s", "backward_call_s", "optimizer_call_s",
                                               "final_sync_s") if k in r))
    if args.memory_peak and not args.device.startswith("cuda"):
        print(f"--memory-peak: records the CUDA caching allocator; nothing recorded on {args.device}")
    return 0


def _print_memory_at_peak(m: dict) -> None:
    """A row's memory_at_peak (_memory_at_peak) as two tables: by allocated bytes, then by
    active bytes (frees waiting on record_stream events still count)."""
    from memory_peak import summary_table

    g = 2**30
    print(f"{'':18s} memory at the extra step's peak: replayed {m['peak_bytes'] / g:.2f} GiB allocated, "
          f"max_memory_allocated {m['max_memory_allocated'] / g:.2f} GiB; replayed "
          f"{m['active_peak_bytes'] / g:.2f} GiB active, peak active {(m['max_active_bytes'] or 0) / g:.2f} GiB; "
          f"{m['trace_entries']} events" + (" (ring buffer full: the peak may be older)" if m["trace_full"] else ""))
    for title, total, groups in (("allocated at the peak", m["peak_bytes"], m["groups"]),
                                 ("active at the active peak (frees waiting on record_stream count)",
                                  m["active_peak_bytes"], m["active_groups"])):
        print("\n".join(f"{'':20s}{line}" for line in summary_table(total, groups, title).splitlines()))


if __name__ == "__main__":
    raise SystemExit(main())
