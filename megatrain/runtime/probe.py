"""Measure this machine's rates once and cache them: what the planner's cost model reads.

Measured: pinned H2D, D2H, both at once (separate streams), matmul FLOP/s in the compute
dtype (a Linear's forward and backward products: the layouts training runs), device memory
bandwidth (a copy within the device), and the host AdamW update (parameters/s) as
megatrain.AdamW runs it in a streamed step: its kernel (torch's fused CPU AdamW) on memory
allocated as its state is (huge pages where the host allows), at its threads
(optim.engine.streaming_threads), with gradients in the dtype they reach the host in
(grad_copies.GRAD_TRANSFER_DTYPE from a GPU, the parameters' fp32 on the CPU), and, on a GPU,
while both directions of the link copy (the weights' fetches read host memory and the
gradients' copies write it, through the bandwidth the update is bound by).
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

from ..optim.engine import streaming_threads
from ..plan.costs import Rates
from ..memory.host_store import host_buffer, host_zeros, huge_pages_enabled
from ..optim.functional import adamw_
from .grad_copies import GRAD_TRANSFER_DTYPE


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


def grad_dtype(device: torch.device) -> torch.dtype:
    """The dtype gradients reach the host update in on `device`: the dtype they cross the
    link in from a GPU (grad_copies.GRAD_TRANSFER_DTYPE), the parameters' fp32 on the CPU."""
    return GRAD_TRANSFER_DTYPE if device.type == "cuda" else torch.float32


def _adamw_rates(device: torch.device, numel: int, repeats: int, threads: int,
                 copy_bytes: int, grads: torch.dtype | None = None) -> tuple[float, float | None, str, bool]:
    """Parameters/s of the host update as megatrain.AdamW runs it (optim.functional.adamw_:
    torch's fused CPU kernel) at `threads` intra-op threads, on buffers allocated as the
    optimizer's are (memory.host_store.host_zeros: huge pages where the host allows them):
    beside a busy link on a CUDA `device` (the weights' fetches and the gradients' copies
    share host memory bandwidth with the update), and alone (None on a CPU device: nothing
    copies beside it there, so the one rate is both). Also a name of what was timed, and
    whether the link stayed busy for every timed update (the copies are queued ahead for
    three times the update's time alone; a False says the busy rate was partly taken on a
    quiet link). `grads`: the gradients' dtype, grad_dtype(device) unless given."""
    param, exp_avg, exp_avg_sq = (host_zeros(numel, torch.float32) for _ in range(3))
    grad = host_zeros(numel, grads or grad_dtype(device))
    grad.fill_(1e-3)
    step = torch.zeros((), dtype=torch.float32)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)

    def update() -> None:
        adamw_([param], [grad], [exp_avg], [exp_avg_sq], [step], **hyper)

    impl = _update_timed(grad.dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        update()  # first touch of the moments' pages, untimed
        cpu = torch.device("cpu")
        alone = _best(lambda: _timed(cpu, update), repeats)
        if device.type != "cuda":
            return numel / alone, None, impl, True
        with _BusyLink(device, copy_bytes) as link:
            t = _best(lambda: link.around(lambda: _timed(cpu, update), 3 * alone), repeats)
        return numel / t, numel / alone, impl, link.busy_throughout
    finally:
        torch.set_num_threads(before)


class _BusyLink:
    """Both directions of a CUDA device's link copying pinned host buffers while the host
    times something: `around(fn, seconds)` queues enough copies to outlast `seconds` on two
    side streams, runs `fn`, notes whether the copies were still running when it returned,
    and waits them out (untimed)."""

    def __init__(self, device: torch.device, nbytes: int):
        self.device, self.nbytes = device, nbytes
        self.busy_throughout = True

    def __enter__(self) -> "_BusyLink":
        n = max(self.nbytes // 2, 1)
        self.host_src = host_buffer(n, torch.bfloat16, True)
        self.host_dst = host_buffer(n, torch.bfloat16, True)
        self.dev_src = torch.ones(n, dtype=torch.bfloat16, device=self.device)
        self.dev_dst = torch.empty_like(self.dev_src)
        self.up, self.down = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        self.seconds_per_copy = _best(lambda: _timed(self.device, self._one_copy), 1)
        return self

    def _one_copy(self) -> None:
        self.dev_dst.copy_(self.host_src, non_blocking=True)

    def around(self, fn: Callable[[], float], seconds: float) -> float:
        copies = max(2, int(seconds / self.seconds_per_copy) + 1)
        done = torch.cuda.Event()
        for _ in range(copies):
            with torch.cuda.stream(self.up):
                self.dev_dst.copy_(self.host_src, non_blocking=True)
            with torch.cuda.stream(self.down):
                self.host_dst.copy_(self.dev_src, non_blocking=True)
        done.record(self.up)
        result = fn()
        self.busy_throughout &= not done.query()
        self.up.synchronize()
        self.down.synchronize()
        return result

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)
        del self.host_src, self.host_dst, self.dev_src, self.dev_dst


def _update_timed(grads: torch.dtype) -> str:
    """What `_adamw_rates` times, as the cache records it: a cache from a probe that timed
    something else (torch.optim.AdamW on torch's own pages, fp32 gradients where training
    hands bf16 ones) is measured again."""
    pages = "huge pages" if huge_pages_enabled() else "4 KiB pages"
    return f"megatrain.adamw_ {pages} {str(grads).removeprefix('torch.')} grads"


# What ran beside the timed host update, by whether the device is a GPU.
_ADAMW_BESIDE = {True: "duplex copies", False: "nothing"}


def probe(device: torch.device | str = "cuda", sizes: ProbeSizes | None = None) -> tuple[Rates, dict]:
    """Measure now (seconds); returns the rates and metadata about how they were taken."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = sizes or ProbeSizes.for_device(device)
    h2d, d2h, duplex = _copy_rates(device, sizes.copy_bytes, sizes.repeats)
    flops = _matmul_rate(device, sizes.matmul_n, sizes.repeats)
    memory = _memory_rate(device, sizes.copy_bytes, sizes.repeats)
    adamw_threads = streaming_threads(device.type)
    adamw, adamw_quiet, impl, link_busy = _adamw_rates(device, sizes.adamw_params, sizes.repeats,
                                                       adamw_threads, sizes.copy_bytes)
    rates = Rates(device_name(device), h2d=h2d, d2h=d2h, duplex=duplex, flops=flops, adamw=adamw,
                  memory=memory, adamw_quiet=adamw_quiet)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "adamw_impl": impl,
            "adamw_threads": adamw_threads, "adamw_beside": _ADAMW_BESIDE[device.type == "cuda"],
            "adamw_link_busy_throughout": link_busy, "sizes": sizes.__dict__,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
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
            # the update rate belongs to a thread count and to what ran beside it: a cache
            # taken otherwise (another process default, an older probe, a GPU's without the
            # quiet-link rate) is measured again
            meta, kind = data["meta"], torch.device(device).type
            if (rates.device == name and meta.get("adamw_beside") == _ADAMW_BESIDE[kind == "cuda"]
                    and meta.get("adamw_threads") == streaming_threads(kind)
                    and meta.get("adamw_impl") == _update_timed(grad_dtype(torch.device(device)))
                    and (kind != "cuda" or rates.adamw_quiet is not None)):
                return rates
        except (OSError, ValueError, KeyError, TypeError):
            pass
    rates, meta = probe(device, sizes)
    write_cache(path, {"rates": rates.to_json(), "meta": meta})
    return rates


def write_cache(path: Path, data: dict) -> None:
    """Write a rates cache file atomically: a concurrent reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


__all__ = ["ProbeSizes", "cache_dir", "cache_path", "device_name", "grad_dtype", "load_or_probe", "probe",
           "write_cache"]
