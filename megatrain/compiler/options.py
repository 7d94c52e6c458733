"""The backend's options: parsed and validated once, at entry, into a typed dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .. import config
from ..errors import MegatrainTypeError, MegatrainValueError
from ..memory import host_store
from ..runtime.grad_slabs import check_max_slabs
from .outputs import OUTPUTS
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


# The default CUDA budget (the free memory) is rounded down to this step: the budget is part
# of the warm-start caches' keys (decision_cache.py, aot_cache.py), and the free memory
# moves by a few MiB between processes that allocated a little differently before compiling.
DEFAULT_BUDGET_STEP = 256 << 20


@dataclass(frozen=True)
class Options:
    """What the backend runs with: the user's options, validated, and the decisions.

    A user sets (`torch.compile(model, backend="megatrain", options={...})`):
    device: where compute runs ("cuda", "cuda:1", "cpu"); the model and inputs stay on the CPU.
    gpu_memory: hard budget, in bytes or a string like "16GiB", for megatrain's device memory
        (weights in flight, saved activations, one region's working set). Default: the
        device's free memory (CUDA), rounded down to DEFAULT_BUDGET_STEP, or 4 GiB (CPU device).
    precision: "bf16" computes in bfloat16 from the fp32 host master; "fp32" computes in fp32
        and matches eager training to float tolerance.
    host_memory: the host RAM megatrain may add for training, in bytes or like "64GiB": the
        optimizer's moments it creates, gradient slabs, activations waiting in host memory,
        weight shadows. Default: the RAM available at compile time, less a margin (an
        eighth of the host's RAM, at least 2 GiB); None where the host does not say.
    outputs: the one consent option. "all" (default): every tensor a graph returns comes
        back to the CPU with its values, like eager. "loss": a graph that returns a 0-dim
        tensor (the loss) returns its 0-dim tensors only, every other tensor output as a
        meta tensor of its shape and dtype that raises when read, so megatrain neither
        copies the logits to the host nor makes them where the fused loss can stand in
        (compiler/outputs.py says when all outputs come back anyway).

    The other fields are megatrain's decisions, read from `megatrain.config` (which
    documents each); tests and benchmarks force them there, never through `options`.
    """

    device: torch.device
    gpu_memory: int
    precision: str = "bf16"
    host_memory: int | None = None
    outputs: str = "all"
    prefetch: int = 1
    lowering: str = "inductor"
    kernels: tuple[str, ...] | None = None  # None: not given (see above)
    updates: str = "host"
    backlog: str | None = None
    offload: bool = True
    token_chunks: bool | None = None  # None: only where the step does not fit otherwise
    # None: the planner's choice (compiler/keep.py); True/False: every region or none; or
    # the names of the regions that keep
    keep_activations: bool | frozenset[str] | None = None
    grad_chunk: int | None = None
    grad_slabs: int | None = None
    keep_weights: bool = False
    weight_shadow: bool = False

    @property
    def fused_lowering(self) -> bool:
        """Inductor lowers the graphs to fused GPU kernels, whose working sets the planner
        counts (compiler/problem.py)."""
        return self.lowering == "inductor" and self.device.type == "cuda"

    @property
    def inductor_walk(self) -> bool:
        """The planner's liveness walk leaves out the pointwise results Inductor computes
        inside their readers' kernels and never writes (compiler/op_costs.py `inlined`):
        where the graphs lower to fused GPU kernels, whose working sets the walk already
        pads with each region's largest transient (a fused kernel may hold several of its
        nodes' results at once, in another order than the graph's), unless
        megatrain.config.memory_walk says "nodes"."""
        if config.memory_walk not in ("inductor", "nodes"):
            raise MegatrainValueError(f"megatrain.config.memory_walk={config.memory_walk!r}: use \"inductor\" "
                                      f"(the default) or \"nodes\"")
        return self.fused_lowering and config.memory_walk == "inductor"

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32


_PRECISIONS = ("bf16", "fp32")
_MIN_GRAD_CHUNK = 4096  # bytes: room for an aligned piece (grad_ring.py), tests use tiny chunks
_LOWERINGS = ("inductor", "eager")
_BACKLOGS = ("host", "device", "arrival")


USER_OPTIONS = ("device", "gpu_memory", "host_memory", "precision", "outputs")


def parse_options(options: dict | None) -> Options:
    """The user's `options` validated, with the decisions of `megatrain.config` beside them."""
    options = dict(options or {})
    retired = sorted(set(options) & set(config.DECISIONS))
    if retired:
        name = retired[0]
        raise MegatrainValueError(
            f"option {name}={options[name]!r} is not a backend option any more: megatrain decides it "
            f"(the options are {list(USER_OPTIONS)}). To force it for a test or a benchmark, "
            f"compile and call under `with megatrain.config.patch({name}={options[name]!r}):`")
    unknown = sorted(set(options) - set(USER_OPTIONS))
    if unknown:
        raise MegatrainValueError(
            f"unknown megatrain option(s) {unknown}; the options are {list(USER_OPTIONS)}")
    options = {**config.decisions(), **options}

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
        gpu_memory = torch.cuda.mem_get_info(device)[0] // DEFAULT_BUDGET_STEP * DEFAULT_BUDGET_STEP
    else:
        gpu_memory = 4 * 1024**3
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if gpu_memory > total:
            raise MegatrainValueError(
                f"gpu_memory={gpu_memory} bytes exceeds the {total} bytes of {device}: "
                f"give at most the device's memory")

    host_memory = _host_memory(options.get("host_memory"))

    precision = options.get("precision", "bf16")
    if precision not in _PRECISIONS:
        raise MegatrainValueError(f"precision={precision!r}: use one of {_PRECISIONS}")

    outputs = options.get("outputs", "all")
    if outputs not in OUTPUTS:
        raise MegatrainValueError(
            f"outputs={outputs!r}: use 'all' (every output comes back with its values, like "
            f"eager) or 'loss' (a training graph's 0-dim outputs only; the others come back as "
            f"meta tensors, never copied to the host)")

    prefetch = options.get("prefetch", 1)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise MegatrainValueError(
            f"prefetch={prefetch!r}: give the number of regions fetched ahead, an int >= 0")

    lowering = options.get("lowering", "inductor")
    if lowering not in _LOWERINGS:
        raise MegatrainValueError(f"lowering={lowering!r}: use one of {_LOWERINGS}")
    kernels = _parse_kernels(options.get("kernels"))
    updates = options.get("updates")
    if updates is None:
        updates = "resident" if device.type == "cuda" else "host"
    if not isinstance(updates, str) or updates not in UPDATES:
        raise MegatrainValueError(
            f"updates={updates!r}: use one of {UPDATES} (where each region's megatrain.AdamW "
            f"update runs: chosen by the cost model, always the host, the compute device with "
            f"streamed state, or state kept on the device), or None for megatrain's choice")
    backlog = options.get("backlog")
    if backlog is not None and (not isinstance(backlog, str) or backlog not in _BACKLOGS):
        raise MegatrainValueError(
            f"backlog={backlog!r}: give 'host' (gradients the host optimizer has not reached "
            f"wait in host slabs, updated earliest deadline first, the rest deferred into the "
            f"next forward), 'device' (the same, waiting on the device while no slab is free), "
            f"'arrival' (arrival order; backward's end waits for every update), or None for "
            f"megatrain's choice")
    offload = _flag(options, "offload", True, "boundary activations may wait in host memory "
                    "between the passes when the plan needs it")
    token_chunks = options.get("token_chunks")
    if token_chunks is not None and not isinstance(token_chunks, bool):
        raise MegatrainValueError(
            f"token_chunks={token_chunks!r}: give True (token-wise modules such as an MLP run a chunk "
            f"of the sequence at a time), False (never), or None for megatrain's choice (only where "
            f"the step does not fit otherwise)")
    keep_activations = _keep_activations(options.get("keep_activations"))
    grad_chunk = options.get("grad_chunk")
    if grad_chunk is not None:
        grad_chunk = parse_bytes(grad_chunk, "grad_chunk")
        if grad_chunk < _MIN_GRAD_CHUNK:
            raise MegatrainValueError(
                f"grad_chunk={options['grad_chunk']!r} is {grad_chunk} bytes: give at least "
                f"{_MIN_GRAD_CHUNK} (a few MiB or more keeps the hand-offs few), or None")
        if backlog not in (None, "arrival"):
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
    return Options(device=device, gpu_memory=gpu_memory, precision=precision, host_memory=host_memory,
                   outputs=outputs,
                   prefetch=prefetch, lowering=lowering, kernels=kernels, updates=updates,
                   backlog=backlog, offload=offload, token_chunks=token_chunks,
                   keep_activations=keep_activations,
                   grad_chunk=grad_chunk, grad_slabs=grad_slabs,
                   keep_weights=keep_weights, weight_shadow=weight_shadow)


def _host_memory(value) -> int | None:
    """The host budget: the user's, no more than the host's RAM; by default what is
    available now less host_store.host_margin (None: the host does not say)."""
    mem = host_store.host_memory()
    if value is None:
        if mem is None:
            return None
        available, total = mem
        return max(0, available - host_store.host_margin(total))
    n = parse_bytes(value, "host_memory")
    if mem is not None and n > mem[1]:
        raise MegatrainValueError(
            f"host_memory={value!r} is {n} bytes, more than this host's {mem[1]} bytes of RAM: "
            f"give at most that, or leave host_memory unset for what is available now")
    return n


def _keep_activations(value) -> bool | frozenset[str] | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
        return frozenset(value)
    raise MegatrainValueError(
        f"keep_activations={value!r}: give True (every region saves its matmul and attention "
        f"outputs for its backward), False (every region recomputes its forward), region names "
        f"(as megatrain.explain lists them) or None for megatrain's choice")


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
