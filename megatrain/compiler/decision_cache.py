"""The kept-activations choice remembered across processes, so a warm start skips the search.

Choosing which regions keep their activations (compiler/keep.py) partitions the joint graph
twice more than a plain compile and scores a dozen plans: most of a warm-cache compile's
planning, where Inductor's kernels already come from its cache. A second process compiling
the same graph with the same options on the same machine makes the same choice, so the
choice is written to megatrain's cache folder (beside the probe's rates) and read back.

Only the decision is cached, never the plan: the chosen pair is partitioned, planned and
validated from its real graphs as on a miss, and where that plan does not fit, every region
recomputes as before. A stale entry can cost speed, never correctness. The key covers what
the choice is a function of:
- the joint graph: each node's op, target, arguments, region and result shape and dtype;
- the options (the host memory rounded to 4 GiB: its default is read from the free RAM at
  each compile, and a few GiB either way rarely change a choice);
- the rates the plans are scored with (the probe's and the kernel timings' cache files);
- megatrain's own source, so a changed cost model or chooser is a new key.
State the key does not see (resident state placed by another graph of the same process)
can make a cached choice less good than a fresh one, not wrong. `megatrain.config.
decision_cache = False` turns the cache off (the tests' setting; compiler/keep.py reads it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.fx as fx

from ..plan.keep import KeepChoice
from ..runtime import kernel_probe
from ..runtime.probe import cache_dir, cache_path, device_name
from .options import Options

# The host memory in the key, rounded to this: its default is read from the free RAM at
# each compile, which moves by GiBs between two processes (or two compiles beside a busy one).
_HOST_QUANTUM = 4 << 30
_FORMAT = 1


def graph_fingerprint(gm: fx.GraphModule, blank_streamer: bool = True) -> str:
    """A hash of the graph's structure, regions and shapes (not its values): equal for the
    same model, inputs' shapes and dtypes, and tracing, whichever streamer the graph's
    megatrain ops name (a process numbers its streamers from 0 in compile order) unless
    `blank_streamer` is False. Reads AOTAutograd's fake values, or dynamo's before it."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        region = (n.meta.get("custom") or {}).get("megatrain_region")
        args = _without_streamer(n) if blank_streamer else n.args
        val = n.meta.get("val", n.meta.get("example_value"))
        h.update(f"{n.op}|{n.name}|{_target(n.target)}|{_describe(args)}"
                 f"|{_describe(n.kwargs)}|{region}|{_describe(val)}\n".encode())
    return h.hexdigest()


def key(graph: str, opts: Options) -> str:
    """The cache key of a choice for the graph fingerprinted `graph` under `opts`."""
    host = None if opts.host_memory is None else round(opts.host_memory / _HOST_QUANTUM)
    h = hashlib.sha256()
    for part in (str(_FORMAT), graph, options_text(opts, host),
                 _rates_files(opts.device), source_hash()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def options_text(opts: Options, host_memory) -> str:
    """The options as key text, `host_memory` in place of its value, sets in a fixed order
    (their order follows string hashing, which differs per process)."""
    values = dataclasses.asdict(dataclasses.replace(opts, host_memory=host_memory))
    return repr(sorted((k, repr(sorted(v) if isinstance(v, frozenset) else v)) for k, v in values.items()))


def load(k: str) -> tuple[frozenset[int], KeepChoice | None] | None:
    """(the kept graph regions, the chooser's answer) stored under `k`, or None."""
    try:
        entry = json.loads(_path(k).read_text())
        choice = entry["choice"]
        return frozenset(entry["regions"]), (None if choice is None else KeepChoice(
            kept=frozenset(choice["kept"]), step_s=choice["step_s"],
            scored=tuple((n, s) for n, s in choice["scored"]),
            fused_loss_step_s=choice.get("fused_loss_step_s")))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no entry, or an unreadable one: choose afresh


def entry_text(regions: frozenset[int], choice: KeepChoice | None) -> str:
    """The choice as the cache file holds it (JSON)."""
    return json.dumps({"regions": sorted(regions), "choice": None if choice is None else {
        "kept": sorted(choice.kept), "step_s": choice.step_s, "scored": list(choice.scored),
        "fused_loss_step_s": choice.fused_loss_step_s}})


def stored_text(k: str) -> str | None:
    """The entry stored under `k`, normalised as `entry_text` writes it; None without one."""
    try:
        return json.dumps(json.loads(_path(k).read_text()))
    except (OSError, ValueError):
        return None


def store(k: str, regions: frozenset[int], choice: KeepChoice | None) -> None:
    """Remember the choice under `k` (best effort: a cache that cannot be written is skipped)."""
    _write(_path(k), entry_text(regions, choice))


def load_fused_loss(k: str) -> tuple[float, float] | None:
    """(plain, fused) predicted steps of a graph whose step was found faster with the fused
    loss (compiler/loss_choice.py), stored under `k` (dynamo's graph: `key` of its
    fingerprint), or None."""
    try:
        entry = json.loads(_path(k, "loss").read_text())
        return float(entry["plain_s"]), float(entry["fused_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_fused_loss(k: str, plain_s: float, fused_s: float) -> None:
    """Remember that the graph keyed `k` compiles faster with the fused loss (best effort)."""
    _write(_path(k, "loss"), json.dumps({"plain_s": plain_s, "fused_s": fused_s}))


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)   # atomic: a concurrent reader sees the old entry or the new one
    except OSError:
        pass


def _path(k: str, kind: str = "keep") -> Path:
    return cache_dir() / "decisions" / f"{kind}-{k}.json"


def _rates_files(device: torch.device) -> str:
    """The contents of the probe's and the kernel timings' cache files for `device`."""
    out = []
    for p in (cache_path(device_name(device)), kernel_probe.cache_file(device)):
        try:
            out.append(p.read_text())
        except OSError:
            out.append("")
    return "\0".join(out)


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """A hash of every megatrain source file (the cost model and the chooser among them)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def _without_streamer(n: fx.Node) -> tuple:
    """The node's positional arguments, a megatrain op's `streamer` index blanked."""
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.name.startswith("megatrain::"):
        return n.args
    return tuple(None if i < len(schema.arguments) and schema.arguments[i].name == "streamer" else a
                 for i, a in enumerate(n.args))


def _target(t) -> str:
    """An op by its name, a Python callable by its module and qualified name (never its
    address, which differs between processes)."""
    if isinstance(t, str):
        return t
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', type(t).__name__)}"


def _describe(x) -> str:
    """Arguments and results as text, tensors by shape and dtype only (never their values)."""
    if isinstance(x, fx.Node):
        return x.name
    if isinstance(x, torch.Tensor):
        return f"T{tuple(x.shape)}{x.dtype}{x.device.type}"
    if isinstance(x, (list, tuple)):
        return "(" + ",".join(_describe(v) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k}:{_describe(v)}" for k, v in x.items()) + "}"
    text = repr(x)
    return type(x).__qualname__ if " at 0x" in text else text
