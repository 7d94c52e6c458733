"""The backend's options: parsed and validated once, at entry, into a typed dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import torch

from ..errors import MegatrainTypeError, MegatrainValueError
from ..runtime.grad_slabs import check_max_slabs
from .update_sites import UPDATES

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2,
          "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str, name: str = "gpu_memory") -> int:
    """Bytes from an int or a string like '16GiB', '512 MB', '1.5e9'."""
    if isinstance(value, bool):
        raise MegatrainTypeError(f"{name}={value!r}: give bytes as an int or a string like '16GiB'")
    if isinstance(value, (int, float)):
        n = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise MegatrainValueError(
                f"{name}={value!r} is not a size: use bytes or a string like '16GiB', '512MB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise MegatrainTypeError(f"{name}={value!r}: give bytes as an int or a string like '16GiB'")
    if n <= 0:
        raise MegatrainValueError(f"{name}={value!r} must be positive")
    return n


@dataclass(frozen=True)
class Options:
    """What `torch.compile(model, backend="megatrain", options={...})` accepts.

    device: where compute runs ("cuda", "cuda:1", "cpu"); the model and inputs stay on the CPU.
    gpu_memory: hard budget, in bytes, for megatrain's device memory (weights in flight,
        saved activations, one region's working set). Default: the device's free memory
        (CUDA) or 4 GiB (CPU device).
    precision: "bf16" computes in bfloat16 from the fp32 host master; "fp32" computes in fp32
        and matches eager training to float tolerance.
    prefetch: the most regions fetched ahead of the one computing (1 = double buffering);
        the planner picks the fastest depth up to it that fits gpu_memory.
    lowering: "inductor" compiles each graph with Inductor (Triton on GPU, C++ on CPU);
        "eager" runs the scheduled FX graphs as they are (debugging, fast tests).
    kernels: which eager patterns to replace with megatrain's Triton kernels (names from
        `megatrain.compiler.fusions.PATTERNS`; True = all; False or () = none). Not given
        (None): none, because on the H200 none beats Inductor's own code for its pattern in
        forward+backward yet (bench/results/kernels.jsonl; a kernel that loses is not used
        by default), except that a graph whose plan does not fit gpu_memory is planned again
        with the fused linear-cross-entropy loss, which never holds the [tokens, vocab]
        logits (backend.py; `megatrain.explain(...)` notes it). An explicit value is kept
        exactly: no retry.
    updates: where each region's megatrain.AdamW update runs: "auto" lets the cost model
        choose per region (megatrain.compiler.update_sites), "host" keeps every update on
        the host, "device" runs every region's update on the compute device where its
        buffers fit the memory the plan leaves free. `megatrain.explain(...)` shows the
        choice (GraphPlan.update_sites). Default "host": on the H200 "auto" was 10% faster
        at 8 layers of the 1.3B width (bench/results/NOTES.md, session 11), and no faster
        than "host" runs there at full depth (0.595 s, session 13). Its cost model
        (megatrain.optim.device_update.update_site) counts both resources a device update
        loads, the link (12 B/param each way) and host memory (its 24 B/param of DMA),
        against the host update's 28 B/param plus the gradient's copy; host memory is what
        bounds the step at 1.3B (bench/results/NOTES.md).
        "resident" first keeps the AdamW state (fp32 master, m, v: 12 B/param) of as many
        regions as that free memory holds on the device for good, the regions the next
        forward needs first, then places the rest like "auto": those regions cost no
        host memory traffic and no link bytes at all (megatrain.optim.resident). Their
        host copies are current only after `opt.synchronize()` (or `state_dict()`), which
        brings the state home until the next step adopts it again. Inside
        `accumulate()`, with clipping or the non-finite check their gradients wait in a
        device buffer (4 B/param more, from the same free memory) for `step()`. On the
        H200 at 1.3B/16k, 12 GiB: 46% of the parameters resident, 0.408 s/step with two
        gradient slabs, 0.365 with more (0.78x / 0.88x GPU-resident compiled); at 3B/16k
        nothing fit beside the 10.2 GiB the plan really used (bench/results/NOTES.md,
        session 14; 0.78x again on an H100 host with the fused loss and backlog="host",
        session 21). Opt-in although its CUDA tests pass (sessions 19-21): between
        synchronize() calls the host copies of resident parameters are stale, which code
        that reads `model.parameters()` on the host would not expect.
    backlog: the order in which regions reach a host optimizer that lags behind backward.
        None (default): arrival order (last layer first), and backward's end waits for
        every update, so the next forward, which needs region 0 (updated last) first,
        starts when the host is done. "host": earliest deadline first, the deadline being
        the region's first fetch in the forward; at backward's end the regions not yet
        updated are deferred (megatrain.AdamW.defer) and the next forward runs beside their
        updates, each fetch waiting for its own region (megatrain.runtime.deadlines); their
        gradients wait in host slabs, which grow into spare host RAM (see grad_slabs).
        "device": the same, but gradients that find no free slab wait on the device
        (within the memory the plan leaves free; beyond it backward waits for a slab) and
        the slabs stay two (megatrain.runtime.grad_backlog). Same results, bitwise; where
        the optimizer needs every gradient first (clipping, the non-finite check,
        accumulate()) backward's end waits as with None. Default None: "device" made the
        step 55% slower on the H200 at 1.3B/16k (0.929 s against 0.601; the host's update
        time nearly doubled, cause unknown; bench/results/NOTES.md, session 11); "host"
        made it 12% faster on an H100 host at 3B/16k with updates="resident" (0.867 s
        against 0.982, session 19), where the host sets the pace, and changed nothing at
        1.3B/16k and 14 GiB, where compute does (0.353 against 0.349 s, session 22): it
        pays only where the host lags, and there its slabs take spare host RAM.
    offload: let the planner park boundary activations in host memory between the passes
        (copied out in the forward, back ahead of their first backward reader) where that
        is what fits gpu_memory, or is predicted faster; the longest-lived go first. The
        planner keeps them on the device whenever that fits as fast. Default True: on the
        H200 (3B, 32k tokens, gpu_memory=12GiB, which refuses without it) it ran at 0.92x
        GPU-resident compiled training, peak 9.6 GiB (runtime/activation_offload.py).
        False: every boundary activation stays on the device.
    grad_chunk: with megatrain.AdamW and no backlog, send gradients to the host through
        a ring of 4 chunks of this many bytes (e.g. "64MiB"), each handed to the optimizer
        as it fills, instead of two slabs of the largest region's gradients
        (runtime/grad_ring.py): host memory for gradients becomes 4 x grad_chunk, not
        2 x the embedding's fp32 gradient (0.52 GB at 1.3B, 4.2 GB at Llama-3-8B). Same
        results, bitwise. Default None (region slabs): on the H200 at 1.3B/16k 64 MiB
        chunks lower the host peak from 12.60 to 12.41 bytes per parameter and cost 8% of
        step time (bench/results/NOTES.md, session 11).
    grad_slabs: the most host slabs (each the size of the largest region's gradients)
        that gradients wait in for megatrain.AdamW; past it the backward waits for the host
        optimizer. None (default): two, and more only while the optimizer lags behind the
        backward, some regions' updates bypass the host (resident state, device sites),
        and the host's RAM keeps 1/8 of itself (at least 2 GiB) available
        (runtime/grad_slabs.py): a lagging host then works through those regions' backward
        and the next forward instead of holding the GPU idle. Measured on the H200 at
        1.3B/16k, `updates="resident"`, 12 GiB: 0.426 s/step with two slabs, 0.365 with up
        to sixteen (13 used, 3.4 GB of host memory, 2.5 B/param); with every update on
        the host more slabs bought nothing (3B/16k: 26 slabs, 10.4 GB, 1.39 s against
        1.31; bench/results/NOTES.md, session 14). With backlog="host" they grow past two
        for it too (the deferred updates overlap the next forward). An int bounds the host
        memory they take. With backlog="device", None means two: the waiting gradients
        stay on the device instead.
    keep_weights: let the planner keep the forward's weight buffers of the regions whose
        backward comes first on the device for that backward, as many as fit gpu_memory
        beside the chosen schedule, instead of fetching them a second time: each saves its
        weights' PCIe bytes and a read of their fp32 masters from host memory, which bounds
        the step at 1.3B (bench/results/NOTES.md). Same results, bitwise (the masters do
        not change between a forward and its backward). Default False: on the H200 at
        1.3B/16k it kept 20 regions and cut the H2D bytes from 10.5 to 6.4 GB per step at
        the same step time (0.592 s against 0.582): the host's updates bound that step,
        not the link; it is for steps the link bounds (bench/results/NOTES.md, session 11).
    weight_shadow: with megatrain.AdamW and precision="bf16", keep a page-locked bf16 copy
        of every streamed parameter in host memory, which the optimizer writes as it
        updates each chunk (still in cache), and fetch weights from it: the H2D moves 2
        bytes a parameter instead of the fp32 master's 4, and the device casts nothing.
        Same values, bitwise (both casts round to nearest even). Costs 2 B/param of host
        memory and 2 B/param more written by the host per update. A shadow written by
        anything but the optimizer's update (load_state_dict, an in-place write under
        no_grad, a device-site update's copy back) is stale until the next update, and
        those fetches read the master; a write through ``p.data`` is not seen. Default
        False: measured slower where built for. On an H100 host at 3B/16k it removed the
        forward's wait for fp32 weights (0.095 -> 0.004 s a step) but the bf16 write cut
        the host's update rate by a third, and the host sets that step's pace: 0.991 s
        against 0.885 (bench/results/NOTES.md, session 20).
    """

    device: torch.device
    gpu_memory: int
    precision: str = "bf16"
    prefetch: int = 1
    lowering: str = "inductor"
    kernels: tuple[str, ...] | None = None  # None: not given (see above)
    updates: str = "host"
    backlog: str | None = None
    offload: bool = True
    grad_chunk: int | None = None
    grad_slabs: int | None = None
    keep_weights: bool = False
    weight_shadow: bool = False

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32


_PRECISIONS = ("bf16", "fp32")
_MIN_GRAD_CHUNK = 4096  # bytes: room for an aligned piece (grad_ring.py), tests use tiny chunks
_LOWERINGS = ("inductor", "eager")
_BACKLOGS = ("host", "device")


def parse_options(options: dict | None) -> Options:
    options = dict(options or {})
    known = {f.name for f in fields(Options)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise MegatrainValueError(
            f"unknown megatrain option(s) {unknown}; the options are {sorted(known)}")

    raw_device = options.get("device", "cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(raw_device)
    except (RuntimeError, TypeError) as e:
        raise MegatrainValueError(f"device={raw_device!r} is not a device: use 'cuda' or 'cpu'") from e
    if device.type not in ("cuda", "cpu"):
        raise MegatrainValueError(f"device={raw_device!r}: megatrain computes on 'cuda' or 'cpu'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise MegatrainValueError(
                f"device={raw_device!r} but this torch sees no CUDA GPU: use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())

    if "gpu_memory" in options and options["gpu_memory"] is not None:
        gpu_memory = parse_bytes(options["gpu_memory"])
    elif device.type == "cuda":
        gpu_memory = torch.cuda.mem_get_info(device)[0]
    else:
        gpu_memory = 4 * 1024**3
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if gpu_memory > total:
            raise MegatrainValueError(
                f"gpu_memory={gpu_memory} bytes exceeds the {total} bytes of {device}: "
                f"give at most the device's memory")

    precision = options.get("precision", "bf16")
    if precision not in _PRECISIONS:
        raise MegatrainValueError(f"precision={precision!r}: use one of {_PRECISIONS}")

    prefetch = options.get("prefetch", 1)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise MegatrainValueError(
            f"prefetch={prefetch!r}: give the number of regions fetched ahead, an int >= 0")

    lowering = options.get("lowering", "inductor")
    if lowering not in _LOWERINGS:
        raise MegatrainValueError(f"lowering={lowering!r}: use one of {_LOWERINGS}")
    kernels = _parse_kernels(options.get("kernels"))
    updates = options.get("updates", "host")
    if not isinstance(updates, str) or updates not in UPDATES:
        raise MegatrainValueError(
            f"updates={updates!r}: use one of {UPDATES} (where each region's megatrain.AdamW "
            f"update runs: chosen by the cost model, always the host, or the compute device)")
    backlog = options.get("backlog")
    if backlog is not None and (not isinstance(backlog, str) or backlog not in _BACKLOGS):
        raise MegatrainValueError(
            f"backlog={backlog!r}: give 'host' (gradients the host optimizer has not reached "
            f"wait in host slabs, updated earliest deadline first, the rest deferred into the "
            f"next forward), 'device' (the same, waiting on the device while no slab is free), "
            f"or None (arrival order; backward's end waits for every update)")
    offload = _flag(options, "offload", True, "boundary activations may wait in host memory "
                    "between the passes when the plan needs it")
    grad_chunk = options.get("grad_chunk")
    if grad_chunk is not None:
        grad_chunk = parse_bytes(grad_chunk, "grad_chunk")
        if grad_chunk < _MIN_GRAD_CHUNK:
            raise MegatrainValueError(
                f"grad_chunk={options['grad_chunk']!r} is {grad_chunk} bytes: give at least "
                f"{_MIN_GRAD_CHUNK} (a few MiB or more keeps the hand-offs few), or None")
        if backlog is not None:
            raise MegatrainValueError(
                f"grad_chunk={options['grad_chunk']!r} with backlog={backlog!r}: the backlog "
                f"orders and sends whole regions through region slabs; drop one of the two")
    grad_slabs = check_max_slabs(options.get("grad_slabs"), "grad_slabs")
    if backlog == "device" and grad_slabs is None:
        grad_slabs = 2
    keep_weights = _flag(options, "keep_weights", False, "the forward's weights of the regions "
                         "whose backward comes first stay on the device for it, where the budget has room")
    weight_shadow = _flag(options, "weight_shadow", False, "weights stream from a bf16 copy "
                          "the host optimizer keeps current, 2 bytes a parameter instead of 4")
    if weight_shadow and precision != "bf16":
        raise MegatrainValueError(
            f"weight_shadow=True with precision={precision!r}: the shadow is the bf16 copy the "
            f"device computes with; an fp32 step already streams the masters as they are. "
            f"Use precision='bf16' or drop weight_shadow")
    return Options(device=device, gpu_memory=gpu_memory, precision=precision,
                   prefetch=prefetch, lowering=lowering, kernels=kernels, updates=updates,
                   backlog=backlog, offload=offload, grad_chunk=grad_chunk, grad_slabs=grad_slabs,
                   keep_weights=keep_weights, weight_shadow=weight_shadow)


def _flag(options: dict, name: str, default: bool, meaning: str) -> bool:
    """A boolean option; anything else is refused with what True means."""
    value = options.get(name, default)
    if not isinstance(value, bool):
        raise MegatrainValueError(f"{name}={value!r}: give True ({meaning}) or False")
    return value


def _parse_kernels(value) -> tuple[str, ...] | None:
    from .fusions import PATTERNS

    if value is None:
        return None
    if value is True:
        return PATTERNS
    if value is False:
        return ()
    if isinstance(value, str):
        value = [value]
    names = tuple(value)
    bad = [n for n in names if n not in PATTERNS]
    if bad:
        raise MegatrainValueError(f"kernels={value!r}: unknown {bad}; choose from {sorted(PATTERNS)} "
                                  f"or True for the default set")
    return names
