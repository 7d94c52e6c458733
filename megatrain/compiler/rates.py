"""The rates the cost model reads while compiling: this machine's probe, else defaults.

A probe takes seconds and its numbers belong to the hardware, so it runs once per machine,
at the first compile that finds no cache (`measure_once`, under `config.probe_rates`), and
every plan after reads the cache. Without one (probing turned off) the defaults stand in
(plan/costs.py's plausible GPU rates for CUDA, a modest CPU for the CPU device);
`Rates.device` names which one a plan used.
"""

from __future__ import annotations

import json
import warnings

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import config
from ..runtime import host_rate, kernel_probe, probe
from ..plan import inputs as plan_inputs
from ..plan.costs import CPU, GPU_DEFAULT, Rates
from . import op_costs
from .phases import phase

# Devices whose rates a probe calibrates, so a predicted step means something and the
# planner may trade memory for predicted time (plan/keep.py): on the CPU device the step is
# bound by dispatch overheads the cost model does not count.
CALIBRATED = ("cuda",)


def calibrated(device: torch.device | str) -> bool:
    """Whether the cost model's predictions hold on `device` (CALIBRATED)."""
    return torch.device(device).type in CALIBRATED


def cached_rates(device: torch.device) -> Rates | None:
    """The probe's cached rates of `device`, its host update rates scaled to what training
    reached on this machine where a run recorded that (runtime/host_rate.py)."""
    name = probe.device_name(device)
    try:
        data = json.loads(probe.cache_path(name).read_text())
        rates = Rates.from_json(data["rates"])
        if rates.device != name:
            return None
        return rates.scaled(host=host_rate.training_host_scale(data))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no cache, or an unreadable or older one


def probed_here(rates: Rates, device: torch.device) -> bool:
    """Whether `rates` are this machine's probe's (not defaults) on a calibrated device:
    the plans whose predicted host rate training is held to."""
    return calibrated(device) and rates.device == probe.device_name(device)


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


def kernel_flop_scales(graphs, device: torch.device, rates: Rates) -> dict:
    """Per product and attention node of `graphs` (FX graphs), the factor that turns its
    FLOPs into FLOPs at the probe's matmul rate: that rate over the one its own shape
    reaches here (runtime/kernel_probe.py, measured once per machine and shape). Empty
    with probing off (`config.probe_rates`): every node is charged at the probe's rate."""
    if not config.probe_rates:
        return {}
    shapes, flops = {}, {}
    for g in graphs:
        for n in g.nodes:
            s = op_costs.kernel_shape(n)
            f = op_costs.flops(n) if s is not None else 0
            if s is not None and isinstance(f, int) and f > 0:
                shapes[n] = s
                flops[s] = f
    if not shapes:
        return {}
    seen: dict[str, float | None] = {}
    try:
        with unset_fake_temporarily(), torch.enable_grad(), phase("kernel_timing"):
            measured = kernel_probe.measured_rates(torch.device(device), list(flops), flops,
                                                   rates.flops, seen=seen)
    except Exception as e:  # timing sharpens a prediction; it must never stop a compile
        plan_inputs.note_unrepeatable(f"timing the graph's products failed ({type(e).__name__})")
        warnings.warn(f"megatrain: timing the graph's products failed ({type(e).__name__}: {e}); "
                      f"the cost model charges them at the probe's matmul rate", stacklevel=2)
        return {}
    finally:
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    for key, seconds in seen.items():
        plan_inputs.note_kernel(key, seconds)
    return {n: rates.flops / measured[s] for n, s in shapes.items() if s in measured}
