"""The speed of a graph's own matmuls and attention, measured at their shapes, cached.

The probe's one matmul rate (8192-square products) is what large, square GEMMs reach; a
model's products are narrower (a 2048-wide layer's projections, a [tokens, vocab] head)
and attention runs its own kernels, both slower by amounts that depend on the shape. So
before planning, each distinct product and attention shape of the graph pair is timed
once per machine with random inputs of its shapes, strides and dtype, and its FLOP/s is
cached beside the probe's rates. The cost model then charges each node its FLOPs at its
own rate.

A `KernelShape` says what to time: "mm" (a [m, k] @ [k, n] product, with which operands
are transposed in memory), "bmm" ([b, m, k] @ [b, k, n]) or "sdpa" (scaled dot-product
attention over [b, h, l, e] queries and [b, h_kv, s, e] keys, causal or not; its backward
is timed as the forward and backward together less the forward). A shape too large to
time whole (an operand or result over `MAX_OPERAND_BYTES`, or more FLOPs than the probe's
matmul rate does in `MAX_SECONDS`) is timed on a slice of its rows (a product) or batch
(attention) and scaled: the time is linear in them once they fill the device. So timing
a graph's shapes takes well under a second on a GPU and a few seconds on a CPU.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .probe import cache_path, device_name

MAX_OPERAND_BYTES = 1 << 30
MAX_SECONDS = 0.005
_REPEATS = 5


@dataclass(frozen=True)
class KernelShape:
    kind: str  # "mm" | "bmm" | "sdpa"
    shapes: tuple[tuple[int, ...], ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    flags: tuple[bool, ...] = ()  # mm/bmm: operands transposed in memory; sdpa: (causal,)
    backward: bool = False  # sdpa: its backward

    @property
    def key(self) -> str:
        return json.dumps([self.kind, self.shapes, self.dtype, self.flags, self.backward])


def cache_file(device: torch.device) -> Path:
    """Where `device`'s kernel timings are cached: beside the probe's rates."""
    rates = cache_path(device_name(device))
    return rates.with_name(rates.stem.replace("rates-", "kernels-") + ".json")


def measured_rates(device: torch.device, shapes: list[KernelShape],
                   flops: dict[KernelShape, int], probe_flops: float,
                   seen: dict[str, float | None] | None = None) -> dict[KernelShape, float]:
    """FLOP/s of each shape on `device` (`flops`: its FLOPs as the cost model counts them;
    `probe_flops`: the probe's matmul rate, which bounds how much of a shape is timed),
    from the cache or measured now and cached. A shape that cannot be timed here is left
    out (cached as 0 seconds): the cost model charges it at the probe's matmul rate. `seen`,
    if given, gets each shape's key and the seconds read or measured (None: the device ran
    out of memory timing it, so a later compile times it again)."""
    path = cache_file(device)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    out, new = {}, {}
    for s in dict.fromkeys(shapes):
        seconds = cached.get(s.key)
        if seconds is None:
            try:
                shrink = max(1.0, flops.get(s, 0) / (probe_flops * MAX_SECONDS))
                seconds = new[s.key] = _time(device, s, shrink)
            except torch.OutOfMemoryError:
                if seen is not None:   # the device was full this time: timed again next time
                    seen[s.key] = None
                continue
            except (RuntimeError, ValueError, TypeError):
                # An op or layout this machine cannot run alone: cached as 0 (charged at the
                # probe's rate), so every later compile plans it the same way.
                seconds = new[s.key] = 0.0
        if seen is not None:
            seen[s.key] = seconds
        if seconds > 0 and flops.get(s, 0) > 0:
            out[s] = flops[s] / seconds
    if new:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({**cached, **new}, indent=0))
        os.replace(tmp, path)
    return out


def _time(device: torch.device, s: KernelShape, shrink: float = 1.0) -> float:
    """Seconds of one run of `s`, timed on 1/`shrink` of its rows or batch (or fewer, to
    keep each operand under MAX_OPERAND_BYTES) and scaled back."""
    dtype = getattr(torch, s.dtype)
    if s.kind in ("mm", "bmm"):
        a_shape, b_shape = (list(x) for x in s.shapes)
        largest = max(_numel(a_shape), _numel(a_shape[:-1]) * b_shape[-1]) * dtype.itemsize
        rows = a_shape[-2]
        keep = max(1, min(int(rows / shrink), rows * MAX_OPERAND_BYTES // max(largest, 1)))
        a_shape[-2] = keep
        a = _operand(a_shape, s.flags[0], dtype, device)
        b = _operand(b_shape, s.flags[1], dtype, device)
        fn = (lambda: torch.mm(a, b)) if s.kind == "mm" else (lambda: torch.bmm(a, b))
        return _best(device, fn) * rows / keep
    if s.kind == "sdpa":
        q_shape, k_shape = (list(x) for x in s.shapes)
        batch = q_shape[0]
        keep = max(1, min(int(batch / shrink),
                          batch * MAX_OPERAND_BYTES // max(_numel(q_shape) * dtype.itemsize, 1)))
        q_shape[0] = k_shape[0] = keep
        q = torch.randn(q_shape, dtype=dtype, device=device, requires_grad=s.backward)
        k = torch.randn(k_shape, dtype=dtype, device=device, requires_grad=s.backward)
        v = torch.randn(k_shape, dtype=dtype, device=device, requires_grad=s.backward)
        gqa = q_shape[1] != k_shape[1]
        causal = bool(s.flags[0]) if s.flags else False

        def forward():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=gqa)

        if not s.backward:
            with torch.no_grad():
                return _best(device, forward) * batch / keep
        grad = torch.randn(q_shape, dtype=dtype, device=device)

        def forward_and_backward():
            torch.autograd.grad(forward(), (q, k, v), grad)

        both = _best(device, forward_and_backward)
        return max(both - _best(device, forward), 0.0) * batch / keep
    raise ValueError(f"unknown kernel kind {s.kind!r}")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _operand(shape, transposed: bool, dtype, device):
    """A random operand of `shape`, stored transposed (its last two dims swapped in memory)
    where the graph's is."""
    if not transposed:
        return torch.randn(shape, dtype=dtype, device=device)
    swapped = [*shape[:-2], shape[-1], shape[-2]]
    return torch.randn(swapped, dtype=dtype, device=device).transpose(-1, -2)


def _best(device: torch.device, fn) -> float:
    """Seconds of the fastest of a few runs after a warm-up (noise only adds time)."""
    fn()
    best = float("inf")
    for _ in range(_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best
