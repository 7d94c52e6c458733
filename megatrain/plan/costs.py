"""Cost model: seconds per planner task, from FLOP and byte counts over probed rates.

`Rates` is what `megatrain.runtime.probe` measures once per machine. Durations are pure
functions of (size, rates), and every one of them is non-increasing in every rate, so a
faster machine can never make a fixed schedule slower; the planner relies on that for its
"faster links never predict a slower step" guarantee.

Copies in opposite directions share the PCIe link: when a pass moves bytes both ways, each
direction is charged at most half of the probed both-at-once rate. The split is decided
per pass from which directions carry bytes, never from the simulated overlap, so a
duration does not depend on the schedule it sits in.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# Bytes of host memory traffic per parameter: fused AdamW reads param, grad, m, v and
# writes param, m, v (7 x fp32); accumulating a gradient reads two fp32 and writes one.
ADAMW_BYTES_PER_PARAM = 28
ACCUMULATE_BYTES_PER_PARAM = 12
# An optimizer that clips holds each final gradient until step() knows the global norm:
# holding copies it out of its staging slab and takes its norm (a 16-bit one through an
# fp32 upcast), and the update then scales it, a 16-bit one upcast chunk by chunk into a
# scratch (optim/functional.py). Bytes per parameter by the gradient's bytes per element.
FP32 = 4


def hold_bytes_per_param(grad_bytes: int) -> int:
    """Copy out (read and write) and the norm's reads (a narrow gradient read, upcast and
    written to the scratch, then read)."""
    norm = grad_bytes + 2 * FP32 if grad_bytes < FP32 else FP32
    return 2 * grad_bytes + norm


def clip_update_bytes_per_param(grad_bytes: int) -> int:
    """What scaling adds to the update: a narrow gradient's upcast into the scratch (the
    fused kernel then reads the scratch, in cache); an fp32 one multiplied in place."""
    return grad_bytes + FP32 if grad_bytes < FP32 else 2 * FP32
# An update on the device moves its state (fp32 master, m and v) over PCIe, each way.
DEVICE_LINK_BYTES = 12


@dataclass(frozen=True)
class Rates:
    """Measured (or assumed) speeds of one machine, in bytes/s, FLOP/s and params/s."""

    device: str
    h2d: float  # host (pinned) -> device, one direction alone
    d2h: float  # device -> host (pinned), one direction alone
    duplex: float  # h2d + d2h bytes/s when both run at once
    flops: float  # matmul FLOP/s in the compute dtype
    adamw: float  # host fused AdamW, parameters/s, while the link copies both ways
    # device memory bytes/s (read + write) of a large copy on the device; None: memory-bound
    # kernels are not charged (rates written by hand for a test of the other terms)
    memory: float | None = None
    # host fused AdamW, parameters/s, with the link idle; None: as `adamw` (a CPU device, or
    # rates written before it was measured)
    adamw_quiet: float | None = None

    def __post_init__(self):
        for name in ("h2d", "d2h", "duplex", "flops", "adamw", "memory", "adamw_quiet"):
            v = getattr(self, name)
            if v is None and name in ("memory", "adamw_quiet"):
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Rates.{name}={v!r}: rates must be finite and > 0")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Rates":
        """Strict: a cache from before a rate was measured is measured again, not guessed;
        only the quiet-link update rate may be missing (it then reads as `adamw`, and the
        probe's cache check measures a GPU again)."""
        return cls(**{k: data[k] for k in ("device", "h2d", "d2h", "duplex", "flops", "adamw",
                                           "memory")}, adamw_quiet=data.get("adamw_quiet"))

    def scaled(self, link: float = 1.0, compute: float = 1.0, host: float = 1.0) -> "Rates":
        """The same machine with faster (factor > 1) links, device or host."""
        return Rates(self.device, self.h2d * link, self.d2h * link, self.duplex * link,
                     self.flops * compute, self.adamw * host,
                     None if self.memory is None else self.memory * compute,
                     None if self.adamw_quiet is None else self.adamw_quiet * host)


# A recent GPU on a PCIe Gen5 host, order of magnitude: the CUDA default without a probe, and
# plausible numbers for examples and tests.
GPU_DEFAULT = Rates("GPU (default)", h2d=55e9, d2h=55e9, duplex=90e9, flops=700e12, adamw=3.8e9,
                    memory=2.5e12)
# A few-core CPU as the compute device (fp32 matmul, memcpy "transfers"), order of magnitude.
CPU = Rates("CPU (default)", h2d=10e9, d2h=10e9, duplex=15e9, flops=100e9, adamw=0.5e9,
            memory=10e9)


@dataclass(frozen=True)
class LinkRates:
    """Effective copy rates inside one pass, after sharing the link between directions."""

    h2d: float
    d2h: float


def link_rates(rates: Rates, moves_h2d: bool, moves_d2h: bool) -> LinkRates:
    """Each direction alone gets its own rate; both at once split `duplex` evenly (capped)."""
    if moves_h2d and moves_d2h:
        half = rates.duplex / 2
        return LinkRates(min(rates.h2d, half), min(rates.d2h, half))
    return LinkRates(rates.h2d, rates.d2h)


def copy_seconds(nbytes: int, rate: float) -> float:
    return nbytes / rate if nbytes > 0 else 0.0


def compute_seconds(flops: int, rates: Rates, traffic: int = 0) -> float:
    """Matmul FLOPs at the matmul rate plus memory-bound bytes at the memory rate: the two
    kinds of kernel take turns on the device, they do not overlap."""
    seconds = flops / rates.flops if flops > 0 else 0.0
    if traffic > 0 and rates.memory is not None:
        seconds += traffic / rates.memory
    return seconds


def host_bandwidth(rates: Rates, link_busy: float = 1.0) -> float:
    """Host memory bytes/s as the probe's fused AdamW achieved them at the host optimizer's
    threads (runtime/probe.py), when the link copies for a `link_busy` share of the time:
    the copies take host memory bandwidth from the update while they run, so the time per
    byte is the quiet rate's for the idle share and the busy rate's for the rest."""
    busy = rates.adamw * ADAMW_BYTES_PER_PARAM
    if rates.adamw_quiet is None or link_busy >= 1.0:
        return busy
    quiet = rates.adamw_quiet * ADAMW_BYTES_PER_PARAM
    share = max(link_busy, 0.0)
    return 1.0 / ((1.0 - share) / quiet + share / busy)


def link_busy_share(copy_seconds_total: float, compute_seconds_total: float) -> float:
    """The share of a step the link copies, both directions together (a copy in one
    direction is half of the link's duplex work), as the host update sees it: the planned
    copies over the planned compute, capped at 1."""
    if compute_seconds_total <= 0:
        return 1.0
    return min(1.0, copy_seconds_total / (2.0 * compute_seconds_total))


def host_step_seconds(numel: int, rates: Rates, link_busy: float = 1.0) -> float:
    """A region's AdamW update: bound by host memory bandwidth, 28 B/param at the probed
    rate for a link busy a `link_busy` share of the step."""
    if numel <= 0:
        return 0.0
    return numel * ADAMW_BYTES_PER_PARAM / host_bandwidth(rates, link_busy)


def host_hold_seconds(numel: int, grad_bytes: int, rates: Rates, link_busy: float = 1.0) -> float:
    """Holding a final gradient for a clipping optimizer (hold_bytes_per_param)."""
    if numel <= 0:
        return 0.0
    return numel * hold_bytes_per_param(grad_bytes) / host_bandwidth(rates, link_busy)


def host_clipped_step_seconds(numel: int, grad_bytes: int, rates: Rates, link_busy: float = 1.0) -> float:
    """host_step_seconds for a clipping optimizer: the update scales the held gradient."""
    if numel <= 0:
        return 0.0
    return host_step_seconds(numel, rates, link_busy) + (
        numel * clip_update_bytes_per_param(grad_bytes) / host_bandwidth(rates, link_busy))


def host_accumulate_seconds(numel: int, rates: Rates, link_busy: float = 1.0) -> float:
    """Summing a micro-batch gradient into the fp32 host buffer: memory-bound like AdamW."""
    if numel <= 0:
        return 0.0
    return numel * ACCUMULATE_BYTES_PER_PARAM / host_bandwidth(rates, link_busy)
