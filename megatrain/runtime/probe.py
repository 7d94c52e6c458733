"""Measure this machine's rates once and cache them: what the planner's cost model reads.

Measured: pinned H2D, D2H, both at once (separate streams), matmul FLOP/s in the compute
dtype (a Linear's forward and backward products: the layouts training runs), device memory
bandwidth (a copy within the device), and torch's fused AdamW on the CPU (parameters/s).
On a CPU-only machine the "device" is the CPU: copies are CPU-to-CPU copies of the same sizes (both at once: two
threads) and the matmul runs in fp32, so CI exercises the same code path.

The result is cached as JSON under $MEGATRAIN_CACHE or ~/.cache/megatrain, one file per
device name, because measuring takes seconds and the numbers belong to the hardware.
"""

from __future__ import annotations

import json
import os
import platform
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..plan.costs import Rates
from ..memory.host_store import host_buffer


@dataclass(frozen=True)
class ProbeSizes:
    """How big each measurement is: large enough to reach steady bandwidth, small enough
    to finish in seconds. Tests pass tiny sizes."""

    copy_bytes: int = 256 << 20
    matmul_n: int = 8192
    adamw_params: int = 64 << 20
    repeats: int = 5

    @classmethod
    def for_device(cls, device: torch.device) -> "ProbeSizes":
        if device.type == "cuda":
            return cls()
        return cls(copy_bytes=64 << 20, matmul_n=1024, adamw_params=8 << 20, repeats=3)


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
            if m:
                model = m.group(1).strip()
    except OSError:
        pass
    return f"cpu: {model} ({os.cpu_count()} cores)"


def cache_dir() -> Path:
    root = os.environ.get("MEGATRAIN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "megatrain"


def cache_path(name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "device"
    return cache_dir() / f"rates-{slug}.json"


def _best(fn: Callable[[], float], repeats: int) -> float:
    """Seconds of the fastest of `repeats` runs after one warm-up (noise only adds time)."""
    fn()
    return min(fn() for _ in range(repeats))


def _timed(device: torch.device, work: Callable[[], None]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        work()
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


def _copy_rates(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float, float]:
    n = max(nbytes // 2, 1)
    cuda = device.type == "cuda"
    # Page-locked in place, unlocked and freed on return: torch's pinned allocator would
    # keep these 2 x 256 MB cached (and resident) for the life of the process.
    host_src = host_buffer(n, torch.bfloat16, cuda)
    host_dst = host_buffer(n, torch.bfloat16, cuda)
    host_src.fill_(1)
    dev_src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dev_dst = torch.empty(n, dtype=torch.bfloat16, device=device)
    nb = n * 2

    def h2d():
        dev_dst.copy_(host_src, non_blocking=cuda)

    def d2h():
        host_dst.copy_(dev_src, non_blocking=cuda)

    t_h2d = _best(lambda: _timed(device, h2d), repeats)
    t_d2h = _best(lambda: _timed(device, d2h), repeats)
    if cuda:
        up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def both():
            cur = torch.cuda.current_stream(device)
            up.wait_stream(cur)
            down.wait_stream(cur)
            with torch.cuda.stream(up):
                h2d()
            with torch.cuda.stream(down):
                d2h()
            cur.wait_stream(up)
            cur.wait_stream(down)
    else:
        def both():
            t = threading.Thread(target=d2h)
            t.start()
            h2d()
            t.join()
    t_both = _best(lambda: _timed(device, both), repeats)
    return nb / t_h2d, nb / t_d2h, 2 * nb / t_both


def _matmul_rate(device: torch.device, n: int, repeats: int) -> float:
    """FLOP/s of a training step's GEMM mix: a Linear's forward (x @ W.T) and its two
    backward products (g @ W, g.T @ x), timed together: training runs the three layouts in
    equal FLOPs, and they differ in speed (a training step's GEMMs average noticeably less
    than one square x @ W product runs at)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, w, g = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))

    def linear_forward_and_backward():
        torch.mm(x, w.t())
        torch.mm(g, w)
        torch.mm(g.t(), x)

    t = _best(lambda: _timed(device, linear_forward_and_backward), repeats)
    return 3 * 2 * n ** 3 / t


def _memory_rate(device: torch.device, nbytes: int, repeats: int) -> float:
    """Device memory bytes/s (read + write) of a large copy within the device: the rate a
    fused elementwise kernel streams its tensors at."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = max(nbytes // dtype.itemsize, 1)
    src = torch.ones(n, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    t = _best(lambda: _timed(device, lambda: dst.copy_(src)), repeats)
    return 2 * n * dtype.itemsize / t


def _adamw_rate(numel: int, repeats: int) -> tuple[float, str]:
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.full_like(p, 1e-3)
    try:
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        opt.step()
        impl = "fused"
    except (RuntimeError, TypeError):  # a torch without fused CPU AdamW: say so in the cache
        opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
        impl = "foreach"
    t = _best(lambda: _timed(torch.device("cpu"), opt.step), repeats)
    return numel / t, impl


def probe(device: torch.device | str = "cuda", sizes: ProbeSizes | None = None) -> tuple[Rates, dict]:
    """Measure now (seconds); returns the rates and metadata about how they were taken."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = sizes or ProbeSizes.for_device(device)
    h2d, d2h, duplex = _copy_rates(device, sizes.copy_bytes, sizes.repeats)
    flops = _matmul_rate(device, sizes.matmul_n, sizes.repeats)
    memory = _memory_rate(device, sizes.copy_bytes, sizes.repeats)
    adamw, impl = _adamw_rate(sizes.adamw_params, sizes.repeats)
    rates = Rates(device_name(device), h2d=h2d, d2h=d2h, duplex=duplex, flops=flops, adamw=adamw,
                  memory=memory)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "adamw_impl": impl,
            "sizes": sizes.__dict__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return rates, meta


def load_or_probe(device: torch.device | str = "cuda", refresh: bool = False,
                  sizes: ProbeSizes | None = None) -> Rates:
    """The cached rates of this device, measuring (and caching) them on first use or when
    `refresh`. An unreadable cache file is measured over, never trusted."""
    name = device_name(device)
    path = cache_path(name)
    if not refresh and path.exists():
        try:
            data = json.loads(path.read_text())
            rates = Rates.from_json(data["rates"])
            if rates.device == name:
                return rates
        except (OSError, ValueError, KeyError, TypeError):
            pass
    rates, meta = probe(device, sizes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"rates": rates.to_json(), "meta": meta}, indent=2))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    return rates


__all__ = ["ProbeSizes", "cache_dir", "cache_path", "device_name", "load_or_probe", "probe"]
