"""The memory plan printed before training: the host RAM a run needs, refused up front.

Computed from the model's parameters alone (works on a meta-device model, so an 8B plan
costs nothing) and the shape of a step. The accounting: host keeps the fp32 master and
AdamW moments (12 B/param), plus gradients in compatibility mode and a few pinned staging
slabs. Device bytes are the backend planner's to decide inside `--gpu-memory`: its plan
(predicted step and peak, `megatrain.explain`) is printed once the first step compiled it
(`plan_summary`), and no second, coarser guess is printed beside it. Only where there is
no planner (`--compile eager`) or the device is host memory (the CPU) does this module
estimate the device's bytes, and there only to hold them to the RAM available.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from torch import nn

from . import RefusedError

GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: str | int | None, what: str = "--gpu-memory") -> int | None:
    """'16GiB', '16GB', '16g', '1.5TiB', 17179869184 -> bytes; None -> None."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise RefusedError(f"{what} {value!r}: not a size; write it like 16GiB, 80GB or 1500MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


@dataclass
class PlanConfig:
    tokens: int                   # tokens in one micro-batch (one forward/backward)
    seq: int
    grad_accum: int = 1
    precision: str = "bf16"       # compute dtype: "bf16" | "fp32"
    device: str = "cuda"
    compile: str = "megatrain"    # "megatrain" streams; "eager" keeps everything on the device
    optimizer: str = "megatrain"  # "megatrain" (no persistent grads) | "torch" (p.grad on host)
    clip: float = 0.0             # global-norm clipping makes megatrain.AdamW keep p.grad
    gpu_memory: int | None = None
    slots: int = 3                # weight slots on the device (double buffer + one in use)
    data_bytes: int = 0
    checkpoint_shard_bytes: int = 4 * GiB
    saves: bool = True            # False (--no-save): no checkpoint shard buffer


@dataclass
class MemoryPlan:
    n_params: int
    n_matmul_params: int
    n_layers: int
    largest_unit: int
    host: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)
    host_total: int = 0
    device_total: int = 0
    host_needed: int = 0          # host RAM the run needs (adds the device pool when it is the CPU)
    cfg: PlanConfig | None = None

    def table(self, available: int | None = None) -> str:
        c = self.cfg
        lines = [f"memory plan: {self.n_params / 1e6:,.2f} M params, {self.n_layers} layers, "
                 f"largest streamed unit {self.largest_unit / 1e6:,.2f} M params "
                 f"[{c.compile}, {c.precision}, device {c.device}, {c.tokens} tokens x "
                 f"{c.grad_accum} micro-batches]"]
        w = max(len(k) for k in [*self.host, *self.device]) + 4
        lines.append("  host RAM")
        lines += [f"    {k:<{w}}{fmt_bytes(v):>12}" for k, v in self.host.items()]
        lines.append(f"    {'total host':<{w}}{fmt_bytes(self.host_total):>12}")
        budget = fmt_bytes(c.gpu_memory) if c.gpu_memory else (
            "the backend's default budget of 4 GiB" if c.device.startswith("cpu")
            else "the free device memory")
        if c.compile == "megatrain":
            lines.append(f"  device ({c.device}): the planner fits the step into {budget}; "
                         f"its plan is printed after the first step")
        else:
            lines.append(f"  device ({c.device}), estimated")
            lines += [f"    {k:<{w}}{fmt_bytes(v):>12}" for k, v in self.device.items()]
            lines.append(f"    {'total device':<{w}}{fmt_bytes(self.device_total):>12}")
        if self.host_needed != self.host_total:
            lines.append(f"  host RAM needed with the device's, which is host RAM too: "
                         f"{fmt_bytes(self.host_needed)}")
        if available is not None:
            lines.append(f"  host RAM available now: {fmt_bytes(available)}"
                         f" -> {'fits' if self.host_needed <= available else 'DOES NOT FIT'}")
        return "\n".join(lines)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _attr(config, *names: str) -> int:
    """The first of ``names`` the config has: megatrain's Llama and Hugging Face configs
    spell the same size differently (``hidden`` / ``hidden_size``); 0 when none."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return 0


def _units(model: nn.Module) -> tuple[list[int], list[int]]:
    """Parameter counts of the blocks (the children of every outermost ModuleList, at any
    depth: a Hugging Face model holds them under ``model.layers``) and of the leaf modules
    outside them (embedding, final norm, head): what streams as one unit."""
    layers: list[int] = []
    others: list[int] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                layers.extend(_numel(c) for c in child)
            else:
                own = sum(p.numel() for p in child.parameters(recurse=False))
                if own:
                    others.append(own)
                visit(child)

    visit(model)
    own = sum(p.numel() for p in model.parameters(recurse=False))
    return layers, others + ([own] if own else [])


def model_flops_per_token(model: nn.Module, seq: int) -> float:
    """Training FLOPs per token: 6 x matmul params + 12 L h seq (attention), no recompute."""
    cfg = getattr(model, "config", None)
    n_matmul = sum(m.weight.numel() for m in _unique_linears(model))
    layers = _attr(cfg, "layers", "num_hidden_layers")
    hidden = _attr(cfg, "hidden", "hidden_size")
    return 6.0 * n_matmul + 12.0 * layers * hidden * seq


def _unique_linears(model: nn.Module) -> list[nn.Linear]:
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            out.append(m)
    return out


def plan_memory(model: nn.Module, cfg: PlanConfig) -> MemoryPlan:
    """Host bytes (and a device estimate, module docstring) for training `model` with `cfg`."""
    n = sum(p.numel() for p in model.parameters())
    n_matmul = sum(m.weight.numel() for m in _unique_linears(model))
    layers, others = _units(model)
    unit = max(layers + others + [1])
    mc = getattr(model, "config", None)
    hidden = _attr(mc, "hidden", "hidden_size") or int(math.sqrt(max(unit, 1) / 12))
    ffn = _attr(mc, "ffn", "intermediate_size") or 4 * hidden
    vocab = getattr(mc, "vocab_size", 0)
    heads = _attr(mc, "heads", "num_attention_heads") or 1
    L = len(layers) or _attr(mc, "layers", "num_hidden_layers") or 1

    cb = 2 if cfg.precision == "bf16" else 4
    T = cfg.tokens
    on_cpu = cfg.device.startswith("cpu")
    per_layer_act = T * (8 * hidden + 4 * ffn) * cb
    scores = T * heads * cfg.seq * 4 * 2 if on_cpu else 0   # math SDPA materialises T x T
    logits = T * vocab * (cb + 4 + 4)
    plan = MemoryPlan(n_params=n, n_matmul_params=n_matmul, n_layers=L, largest_unit=unit, cfg=cfg)
    shard = min(cfg.checkpoint_shard_bytes, 4 * n) if cfg.saves else 0

    if cfg.compile == "eager":
        dev = {"fp32 weights": 4 * n, "gradients (fp32)": 4 * n, "AdamW moments m, v": 8 * n}
        if cb == 2:
            dev["bf16 weight copies (autocast)"] = 2 * n
        dev["activations, all layers"] = L * (per_layer_act + scores)
        dev["logits + loss"] = logits
        host = {"data (tokens in RAM)": cfg.data_bytes, "checkpoint shard buffer": shard}
    else:
        host = {"fp32 master weights": 4 * n, "AdamW moments m, v (fp32)": 8 * n}
        if cfg.optimizer != "megatrain" or cfg.grad_accum > 1:
            host["gradients p.grad (fp32)"] = 4 * n
        elif cfg.clip:   # held for the global norm in the dtype they arrive in (exact)
            host[f"gradients held for the clip ({cfg.precision})"] = cb * n
        # gradient slabs: two, more only from spare RAM while the optimizer lags (grad_slabs.py)
        host["pinned staging slabs (more from spare RAM if the optimizer lags)"] = \
            cfg.slots * unit * cb + 2 * unit * 4
        host["data (tokens in RAM)"] = cfg.data_bytes
        host["checkpoint shard buffer"] = shard
        dev = {f"weight slots ({cfg.slots} x largest unit)": cfg.slots * unit * cb,
               "gradient slots (2 x largest unit)": 2 * unit * cb,
               "layer-boundary activations": L * T * hidden * cb,
               "one layer's working set": per_layer_act + scores,
               "logits + loss": logits}
    plan.host = {k: int(v) for k, v in host.items() if v}
    plan.device = {k: int(v) for k, v in dev.items() if v}
    plan.host_total = sum(plan.host.values())
    plan.device_total = sum(plan.device.values())
    plan.host_needed = plan.host_total + (plan.device_total if on_cpu else 0)

    return plan


def check_fits(plan: MemoryPlan, available: int | None) -> None:
    """Refuse (RefusedError, exit 2) when host RAM available now cannot hold the run."""
    if available is None or plan.host_needed <= available:
        return
    items = list(plan.host.items())
    if plan.host_needed != plan.host_total:        # the compute device is the CPU: same RAM
        items += [(f"{k} (on {plan.cfg.device})", v) for k, v in plan.device.items()]
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(items, key=lambda kv: -kv[1]))
    raise RefusedError(
        f"host RAM: this run needs {fmt_bytes(plan.host_needed)} ({plan.host_needed} bytes: "
        f"{parts}) but only {fmt_bytes(available)} ({available} bytes) is available now; "
        f"use a smaller --model, fewer --batch-tokens or more --grad-accum, or free host memory"
    )


def plan_summary(step_fn, device: str) -> tuple[str, float | None]:
    """The backend's plan for the compiled step, in one line, and its predicted seconds per
    step, what the run is measured against. None on the CPU device: there the step is
    bound by neither FLOPs nor memory bandwidth, as the cost model assumes, but by kernel
    and dispatch overheads it does not model, so no prediction is printed rather than a
    wrong one."""
    import megatrain

    info = megatrain.explain(step_fn)
    kept = len(info.kept_regions)
    peak = f"planned peak device {fmt_bytes(info.predicted_peak_bytes)}" + (
        f" ({kept} of {len(info.regions)} regions keep their activations, no recompute)" if kept else "")
    phases = info.compile_seconds
    compiled = ("; compile " + ", ".join(f"{k} {v:.1f} s" for k, v in
                                         sorted(phases.items(), key=lambda kv: -kv[1]))
                if phases else "")
    step_s = _predicted_step_s(info, device)
    if step_s is None:
        return f"plan: {peak}{compiled}", None
    waits = info.waits
    waited = (f", GPU waits {fmt_seconds(sum(w.seconds for w in waits))} (most on "
              f"{_WAITED_ON[waits[0].reason]})" if waits else "")
    return f"plan: predicted step {fmt_seconds(step_s)}{waited}, {peak}{compiled}", step_s


def _predicted_step_s(info, device: str) -> float | None:
    """explain's predicted step, where the cost model holds (compiler.rates.calibrated)."""
    from ..compiler.rates import calibrated

    return info.predicted_step_s if calibrated(device) else None


_WAITED_ON = {"host": "the host optimizer", "h2d": "weights coming in", "d2h": "gradients going out",
              "other": "the streams' order"}


def plan_at_end(step_fn, device: str, n_params: int) -> tuple[str, float | None, int]:
    """The plan as the run ended, in a phrase for the last line: the predicted step with the
    update sites in effect now (the set of regions whose AdamW state is on the device grows
    once a measured step shows room, so the first step's prediction can be stale), and how
    many parameters' state the device holds."""
    import megatrain

    info = megatrain.explain(step_fn)
    resident = info.resident_params
    step_s = _predicted_step_s(info, device)
    words = [f"plan: {fmt_seconds(step_s)}"] if step_s is not None else []
    if resident:
        words.append(f"AdamW state of {resident / 1e6:,.0f} M params "
                     f"({resident / max(n_params, 1):.0%}) on the device")
    return ", ".join(words), step_s, resident

