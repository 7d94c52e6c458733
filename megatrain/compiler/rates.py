"""The rates the cost model reads while compiling: this machine's probe, else defaults.

A probe takes seconds and its numbers belong to the hardware, so it runs once per machine,
at the first compile that finds no cache (`measure_once`, under `config.probe_rates`), and
every plan after reads the cache. Without one (probing turned off) the defaults stand in
(plan/costs.py's plausible GPU rates for CUDA, a modest CPU for the CPU device);
`Rates.device` names which one a plan used.
"""

from __future__ import annotations

import json

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import config
from ..runtime import probe
from ..plan.costs import CPU, GPU_DEFAULT, Rates


def cached_rates(device: torch.device) -> Rates | None:
    name = probe.device_name(device)
    try:
        rates = Rates.from_json(json.loads(probe.cache_path(name).read_text())["rates"])
        return rates if rates.device == name else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no cache, or an unreadable or older one


def measure_once(device: torch.device) -> None:
    """Probe the machine into the cache unless one holds its rates (or probing is off). Runs
    outside any fake-tensor mode of the compile that asks, and hands the caching allocator's
    probe blocks back, so the device memory a budget sees is what it was before."""
    if not config.probe_rates or cached_rates(device) is not None:
        return
    with unset_fake_temporarily(), torch.no_grad():
        probe.load_or_probe(device)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def compile_rates(device: torch.device) -> Rates:
    rates = cached_rates(device)
    if rates is not None:
        return rates
    return GPU_DEFAULT if torch.device(device).type == "cuda" else CPU
