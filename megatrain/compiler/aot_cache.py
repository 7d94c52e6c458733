"""A graph's plan cached beside AOTAutograd's cache entry, so a warm process skips the
joint trace, the partition, the planning and the lowering.

AOTAutograd's cache (torch/_functorch/_aot_autograd/autograd_cache.py) is consulted only
for a forward compiler wrapped as `SerializableAOTDispatchCompiler`, and saves an entry
only where every compiled function is Inductor's output with its FX-graph-cache key; on a
hit neither the partition function nor the compilers run. megatrain's compilers return
Inductor's output as it is (the step begins inside the forward graph: ops.begin_step),
and what the skipped partition decided (the GraphPlan's schedule, events, StepPlan) is
stored here, beside torch's entry in Inductor's cache folder, and restored on a hit.

The key. Torch's key holds the dynamo graph (its code: every megatrain op's streamer
index, region and parameter slot), the inputs' metadata and torch's configs, but not the
partition function or the compilers. So `cache_key_tag` carries a hash of what else the
plan is a function of: the graph's regions (node metadata, not in the code) and names,
the options (the host memory's value aside, see below), megatrain's knobs, the probe's
rates, what each parameter's optimizer tells the planner, the grad mode, torch's version
and megatrain's source. The plan file is named by that hash: a torch entry under a key
with this tag was compiled with exactly these inputs.

What the key cannot hold is checked before torch's cache is asked (plan/inputs.py): the
room for parked activations that host_memory leaves (its default follows the free RAM)
must admit the same schedules, the kernel timings the plan read must be the cached ones,
and a remembered kept-activations choice must still be the one remembered. Where one
does not hold, planning afresh might differ: the graph compiles as without the cache,
neither loading nor storing. The parts of the StepPlan that follow host_memory directly
(its budget, the gradient slabs' room) are recomputed on restore, and the host budget is
checked again.

A hit is used only where the plan file names the very FX graphs torch loaded (their
FX-graph-cache keys, which hash each graph's code with every transfer op and Inductor's
configs): a torch entry from another configuration under the same tag, or a plan file
written by another process in between, compiles afresh. Streamer indices are in torch's
key, so a cached graph drives the streamer this compile registered under the same index.
A plan whose state cannot all be stored (a GraphPlan field this module does not know, an
unpicklable value, a kernel that could not be timed) is not stored, and neither is
torch's entry for it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import config
from ..optim.registry import owner_of
from ..plan import inputs as plan_inputs
from ..runtime import kernel_probe
from ..runtime.probe import cache_path, device_name
from . import decide, decision_cache, host_budget
from .options import Options
from .plan import GraphPlan

_FORMAT = 1

# GraphPlan fields the partition and the compilers set, stored and restored; and those set
# before or after them (from the capture and the options, the same on a hit). A field in
# neither is state this module does not know how to restore: such a plan is not stored.
PLANNED = ("forward_code", "backward_code", "forward_events", "backward_events", "prefetch_count",
           "saved_activation_bytes", "saved_activations", "schedule", "keep_choice", "step_plan")
NOT_PLANNED = ("regions", "budget", "streamer", "kernels", "note", "token_chunks", "compile_seconds",
               "cached", "_sited")

# What happened, for tests and diagnostics: "off" (the cache not used), "no entry" (none
# stored under the tag), "stored", "reused", "stale: <what>" (an entry planning afresh
# might not repeat), "unmatched" (torch's entry is not the stored plan's graphs), "not
# stored: <why>" (also where torch's cache bypasses the graph).
counters: collections.Counter = collections.Counter()


@dataclass
class Entry:
    """What a hit restores: the planned GraphPlan fields, what planning read beyond the key,
    the FX-graph-cache keys of the graphs planned, and the warnings planning gave."""

    fields: dict
    inputs: plan_inputs.PlanInputs
    training: bool
    fx_keys: tuple[str, str | None]  # forward's, backward's (None: an inference graph)
    warnings: list[tuple[type, str, str, int]] = field(default_factory=list)


def enabled(opts: Options) -> bool:
    """Whether this compile may use the cache: `megatrain.config.aot_cache`, Inductor
    lowering (the eager lowering's callables are never saved) and torch's caches on."""
    if not config.aot_cache or opts.lowering != "inductor" or _serializable() is None:
        return False
    from torch._functorch import config as functorch_config

    return (hasattr(torch.compiler.config, "cache_key_tag") and not torch.compiler.config.force_disable_caches
            and bool(getattr(functorch_config, "enable_autograd_cache", False)))


def torch_refuses(gm: torch.fx.GraphModule) -> str | None:
    """Why AOTAutograd's cache would bypass `gm` (it then neither loads nor saves an entry,
    and says so only in its log and a counter), or None where it would not. Its check wants
    every node a method is called on to carry its fake value, as dynamo gives each node."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable
    except ImportError:
        return None
    try:
        check_cacheable(gm)
    except BypassAOTAutogradCache as e:
        return str(e).strip().splitlines()[0]
    return None


def _serializable():
    try:
        from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
        from torch._inductor.output_code import OutputCode
    except ImportError:
        return None
    return SerializableAOTDispatchCompiler, OutputCode


class GraphCache:
    """One compile attempt's use of the cache (module docstring)."""

    def __init__(self, tag: str, entry: Entry | None, ask: bool):
        self.tag = tag
        self.entry = entry   # a stored plan that still holds, if any
        self.ask = ask       # ask torch's cache (and store on a miss)
        self.user_tag = torch.compiler.config.cache_key_tag
        self.inputs: plan_inputs.PlanInputs | None = None
        self.warnings: list[tuple[type, str, str, int]] = []
        self.fw_key: str | None = None

    @classmethod
    def open(cls, cap, opts: Options, sid: int) -> GraphCache | None:
        """The cache for the capture `cap` (streamer `sid`) under `opts`; None where off."""
        if not enabled(opts):
            counters["off"] += 1
            return None
        tag = key_tag(cap, opts, sid)
        if (refused := torch_refuses(cap.gm)) is not None:   # before reading an entry it could not use
            counters[f"not stored: torch bypasses the graph: {refused}"] += 1
            return cls(tag, None, ask=False)
        entry = _load(tag)
        if entry is None:
            counters["no entry"] += 1
        elif (stale := _what_changed(entry, cap, opts)) is not None:
            counters["stale"] += 1
            counters[f"stale: {stale}"] += 1
            return cls(tag, None, ask=False)
        return cls(tag, entry, ask=True)

    def compiler(self, fn):
        """`fn` as a compiler torch's cache accepts, where it is asked."""
        if not self.ask:
            return fn
        wrapper, output_code = _serializable()
        return wrapper(output_code, fn)

    def asking(self):
        """The context torch's cache is asked in: its key carries this plan's tag."""
        if not self.ask:
            return contextlib.nullcontext()
        tag = f"{self.user_tag}|megatrain-plan-{self.tag}" if self.user_tag else f"megatrain-plan-{self.tag}"
        return torch.compiler.config.patch(cache_key_tag=tag)

    def lowering(self):
        """The context a graph is lowered in: the user's tag, so Inductor's own cache
        entries (keyed by the graph's code) are shared whatever the plan's inputs."""
        return torch.compiler.config.patch(cache_key_tag=self.user_tag)

    @contextlib.contextmanager
    def planning(self):
        """Record what planning reads and warns inside; the warnings still reach the user."""
        if not self.ask:
            yield
            return
        caught = []
        try:
            with plan_inputs.recording() as inputs, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.inputs = inputs
                yield
        finally:
            for w in caught:
                self.warnings.append((w.category, str(w.message), w.filename, w.lineno))
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def forgo(self) -> None:
        """Neither ask torch's cache nor store from now on (the compile goes on without)."""
        self.ask = False

    def lowered_forward(self, compiled) -> None:
        self.fw_key = getattr(compiled, "_fx_graph_cache_key", None)

    def lowered(self, plan: GraphPlan, last, training: bool = True) -> None:
        """Both graphs are lowered (`last`: Inductor's output for the backward, or for the
        forward of an inference graph, which torch saves its entry with next): store
        `plan` where all of it can be restored, else keep torch from saving an entry that
        no later process could use (each would load it only to compile afresh)."""
        if self.ask and not self._store(plan, getattr(last, "_fx_graph_cache_key", None) if training else None,
                                        training):
            last._fx_graph_cache_key = None   # what AOTAutograd saves an entry by

    def _why_not_storable(self, bw_key: str | None, training: bool) -> str | None:
        """Why this compile's plan cannot be stored, or None where it can."""
        if self.inputs is None:
            return "nothing recorded"
        if self.inputs.unrepeatable:
            return "unrepeatable"
        if self.fw_key is None:
            return "no forward key"
        if training and bw_key is None:
            return "no backward key"
        if {f.name for f in dataclasses.fields(GraphPlan)} != set(PLANNED) | set(NOT_PLANNED):
            return "unknown GraphPlan fields"
        return None

    def _store(self, plan: GraphPlan, bw_key: str | None, training: bool) -> bool:
        why = self._why_not_storable(bw_key, training)
        if why is not None:
            counters[f"not stored: {why}"] += 1
            return False
        entry = Entry({name: getattr(plan, name) for name in PLANNED}, self.inputs, training,
                      (self.fw_key, bw_key), self.warnings)
        try:
            blob = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
            pickle.loads(blob)
        except Exception:  # noqa: BLE001  (a plan that cannot travel is planned afresh)
            counters["not stored: unpicklable"] += 1
            return False
        if not _write(_path(self.tag), blob):
            counters["not stored: unwritable"] += 1
            return False
        counters["stored"] += 1
        return True

    def hit(self, compiled) -> Entry | None:
        """The stored plan of the graphs torch's cache just loaded into `compiled`, or None
        where none is known to be theirs."""
        if self.entry is None or _loaded_fx_keys(compiled) != self.entry.fx_keys:
            counters["unmatched"] += 1
            return None
        counters["reused"] += 1
        return self.entry


def restore(entry: Entry, plan: GraphPlan, opts: Options):
    """Set `plan`'s planned fields from `entry` and replay its warnings; the StepPlan for
    `opts` (its host-memory parts recomputed, the host budget checked again), for the
    caller to configure the runtime with."""
    for name, value in entry.fields.items():
        setattr(plan, name, value)
    plan.cached = True
    for category, message, filename, lineno in entry.warnings:
        warnings.warn_explicit(message, category, filename, lineno)
    step = entry.fields["step_plan"]
    needs = dict(step.host_needs)
    host_budget.check_host_budget(needs, opts.host_memory)
    gradients = dataclasses.replace(step.gradients, host_slab_bytes=host_budget.slab_room(needs, opts.host_memory))
    return dataclasses.replace(step, host_memory=opts.host_memory, gradients=gradients)


def key_tag(cap, opts: Options, sid: int) -> str:
    """The hash of what the plan is a function of beyond torch's key (module docstring)."""
    regions = [(r.id, r.name, r.kind, list(r.param_fqns), r.param_bytes) for r in cap.regions.regions]
    parts = (
        str(_FORMAT), torch.__version__, decision_cache.source_hash(), f"grad {torch.is_grad_enabled()}",
        f"streamer {sid}", decision_cache.graph_fingerprint(cap.gm, blank_streamer=False),
        repr(regions), repr(list(cap.fqns)), repr(sorted(cap.region_params.items())),
        _options_text(opts), repr(sorted((k, repr(v)) for k, v in _knobs().items())),
        device_name(opts.device), _read(cache_path(device_name(opts.device))),
        repr(_optimizers(cap.params)),
    )
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _options_text(opts: Options) -> str:
    """The options, host memory as whether it is bounded (its value is checked apart)."""
    return decision_cache.options_text(opts, opts.host_memory is not None)


def _knobs() -> dict:
    """megatrain.config's knobs (the decisions also sit in the options)."""
    return {k: getattr(config, k) for k in config._knobs() if k != "aot_cache"}


def _optimizers(params) -> list:
    """Per parameter, what planning reads of the optimizer that owns it: which one (in order
    of appearance), its class, whether it holds updates for the norm, whether it has state
    for the parameter (the moments to create count against host_memory)."""
    index: dict[int, int] = {}
    out = []
    for p in params:
        opt = owner_of(p)
        if opt is None:
            out.append(None)
            continue
        state = getattr(opt, "state", {})
        out.append((index.setdefault(id(opt), len(index)), type(opt).__qualname__,
                    bool(opt.waits_for_norm()), bool(state.get(p))))
    return out


def _what_changed(entry: Entry, cap, opts: Options) -> str | None:
    """What planning afresh now would read differently from the stored plan (plan/inputs.py),
    or None where nothing would."""
    inputs = entry.inputs
    if not inputs.admits_room(decide.offload_room(cap, opts, training=entry.training)):
        return "host room"
    if inputs.kernels:
        try:
            timed = json.loads(kernel_probe.cache_file(opts.device).read_text())
        except (OSError, ValueError):
            return "kernel timings unreadable"
        if any(timed.get(k) != seconds for k, seconds in inputs.kernels.items()):
            return "kernel timings"
    if inputs.decision is not None:
        graph, how, text = inputs.decision
        now = decision_cache.stored_text(decision_cache.key(graph, opts))
        if now != text and (how == "remembered" or now is not None):
            return "kept-activations choice"
    return None


def _loaded_fx_keys(compiled) -> tuple | None:
    """The FX-graph-cache keys of the forward and backward in the AOTAutograd cache entry
    `compiled` was loaded from; None where they cannot be read."""
    serialize = getattr(compiled, "serialize", None)
    if serialize is None:
        return None
    try:
        result = serialize()
    except Exception:  # noqa: BLE001
        return None
    bw = getattr(result, "compiled_bw", None)
    return _fx_key(getattr(result, "compiled_fw", None)), (None if bw is None else _fx_key(bw))


def _fx_key(part) -> str | None:
    info = getattr(part, "fx_graph_cache_info", None)
    if info:
        return info[0]
    return getattr(getattr(part, "result", None), "_fx_graph_cache_key", None)


def _path(tag: str) -> Path:
    """Beside torch's entries, so that clearing Inductor's cache clears both."""
    from torch._inductor.runtime.runtime_utils import cache_dir

    return Path(cache_dir()) / "megatrain" / f"plan-{tag}.pkl"


def _load(tag: str) -> Entry | None:
    try:
        entry = pickle.loads(_path(tag).read_bytes())
    except Exception:  # noqa: BLE001  (no entry, or one this version cannot read)
        return None
    return entry if isinstance(entry, Entry) else None


def _write(path: Path, blob: bytes) -> bool:
    """Write atomically (a concurrent reader sees the old entry or the new one); best
    effort: whether it was written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(blob)
        tmp.replace(path)
    except OSError:
        return False
    return True


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
