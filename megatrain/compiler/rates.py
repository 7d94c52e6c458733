"""The rates the cost model reads while compiling: this machine's cached probe, else defaults.

Compiling never measures: a probe takes seconds and its numbers belong to the hardware, so
it runs once (`megatrain.runtime.probe.load_or_probe(device)`) and its cache is read here.
Without a cache the defaults stand in (plan/costs.py's plausible GPU rates for CUDA, a
modest CPU for the CPU device); `Rates.device` names which one a plan used.
"""

from __future__ import annotations

import json

import torch

from ..runtime import probe
from ..plan.costs import CPU, GPU_DEFAULT, Rates


def compile_rates(device: torch.device) -> Rates:
    name = probe.device_name(device)
    try:
        rates = Rates.from_json(json.loads(probe.cache_path(name).read_text())["rates"])
        if rates.device == name:
            return rates
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no cache, or an unreadable one: the defaults
    return GPU_DEFAULT if torch.device(device).type == "cuda" else CPU
