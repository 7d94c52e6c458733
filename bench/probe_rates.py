"""The `probe` child of bench/train.py: this machine's rates, measured in the same run as
the systems it judges (lent machines of one kind differ, so rates from another run would
not do): bf16 matmul at the model's MLP shape for MFU, pinned host-to-device bandwidth and
host memory bandwidth as fused AdamW uses it (alone and beside the DMA a streamed step
runs) for the step bound, and the host facts that may tell lent machines apart."""

from __future__ import annotations

import glob
import os
import statistics
import time

from presets import _config


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
    # torch's allocator (what adamw_gbs, the bound, always measured) and megatrain's
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
