"""Hold the host update rate training reaches to the one the plan assumed, and feed it back.

The cost model charges the host's AdamW updates at the probe's rates (runtime/probe.py), a
few seconds of timing on a quiet machine. Training's own rate differs from it, by a fifth
either way between machines and runs: the weights' fetches and the gradients' copies share
host memory bandwidth with the updates in proportions no short probe reproduces. A plan
built on a rate the host does not reach leaves the backward waiting on the host (or keeps
more state on the device than it needed to).

So each streamed graph whose StepPlan names the rate its updates were charged at
(`StepPlan.host_update_rate`) watches the updates applied as their gradients arrive, from
its second step with such updates on; once `OBSERVED_STEPS` steps are in, the median
rate is compared with the plan's. Where they differ by more than `TOLERANCE`, the ratio is
written beside the probe's rates in its cache (`training_host_scale`), so the next compile
on this machine plans with the rate training reached, and a warning says so once. The
plan running now is not changed: its graphs are compiled.
"""

from __future__ import annotations

import json
import statistics
import warnings
from collections.abc import Sequence

import torch

from . import probe

# Steps with host updates not observed: the first (the compile's) creates the moments and
# touches their pages for the first time.
SKIPPED_STEPS = 1
OBSERVED_STEPS = 3
# A training rate within this fraction of the plan's leaves the cache as it is: run-to-run
# noise on one machine stays within it, and every rewrite changes the compile's cache key.
TOLERANCE = 0.10
_SCALE_BOUNDS = (0.2, 5.0)  # a ratio outside these says the measurement went wrong, not the rate

_settled: set[str] = set()  # devices whose rate this process already compared (one per process)


def training_host_scale(cache: dict) -> float:
    """The factor a probe cache's host update rates are scaled by: what training reached on
    this machine over what the probe timed (1.0 where no run recorded one)."""
    try:
        scale = float(cache["training"]["adamw_scale"])
    except (KeyError, TypeError, ValueError):
        return 1.0
    lo, hi = _SCALE_BOUNDS
    return scale if lo <= scale <= hi else 1.0


def record_training_rate(device: torch.device | str, observed: float, planned: float) -> float | None:
    """Write training's host update rate beside the probe's rates of `device`: the cached
    scale times observed / planned (`planned` was charged with the scale then cached).
    Returns the new scale, or None where there is no probe cache to write into (the plan
    then used default rates) or the ratio is implausible."""
    path = probe.cache_path(probe.device_name(device))
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    scale = training_host_scale(data) * observed / planned
    lo, hi = _SCALE_BOUNDS
    if not lo <= scale <= hi:
        return None
    data["training"] = {"adamw_scale": scale, "observed_params_per_s": observed,
                        "planned_params_per_s": planned}
    probe.write_cache(path, data)
    return scale


def update_rate(host_updates: Sequence[tuple]) -> float | None:
    """Parameters/s of one step's host updates applied as their gradients arrived
    (StepStats.host_updates rows whose last field says so); None without any."""
    params = seconds = 0.0
    for _, start, end, numel, at_once in host_updates:
        if at_once:
            params += numel
            seconds += end - start
    return params / seconds if params > 0 and seconds > 0 else None


class HostRateWatch:
    """One graph's comparison of training's host update rate with its plan's (see the
    module docstring). `observe` takes each finished step's host updates."""

    def __init__(self, device: torch.device, planned: float):
        self.device = torch.device(device)
        self.planned = planned
        self.steps = 0
        self.rates: list[float] = []
        self.observed: float | None = None  # the median, once OBSERVED_STEPS are in
        self.written_scale: float | None = None  # what went into the cache, if anything

    @property
    def done(self) -> bool:
        return self.observed is not None

    def observe(self, host_updates: Sequence[tuple]) -> None:
        if self.done:
            return
        rate = update_rate(host_updates)
        if rate is None:  # none applied at once (a micro-batch's, or a step with none)
            return
        self.steps += 1
        if self.steps <= SKIPPED_STEPS:
            return
        self.rates.append(rate)
        if len(self.rates) == OBSERVED_STEPS:
            self.observed = statistics.median(self.rates)
            self._settle()

    def _settle(self) -> None:
        name = probe.device_name(self.device)
        if name in _settled or abs(self.observed / self.planned - 1) <= TOLERANCE:
            return
        _settled.add(name)
        self.written_scale = record_training_rate(self.device, self.observed, self.planned)
        if self.written_scale is not None:
            warnings.warn(
                f"megatrain: the host optimizer updated {self.observed / 1e9:.2f} G params/s in "
                f"training against the {self.planned / 1e9:.2f} G params/s this plan assumed "
                f"(this machine's probe); later compiles here plan with the measured rate "
                f"({probe.cache_path(name)})", stacklevel=2)


__all__ = ["HostRateWatch", "OBSERVED_STEPS", "SKIPPED_STEPS", "TOLERANCE", "record_training_rate",
           "training_host_scale", "update_rate"]
