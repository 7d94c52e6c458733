"""What was live on the GPU at one step's allocated-bytes peak, grouped by where it was allocated.

Why this exists: on an H100, `bench/train.py --model 3b --tokens 16384 --gpu-memory 20GiB
--systems megatrain+updates=resident+kernels=linear_cross_entropy+backlog=host` measured
max_memory_allocated 20.2-21.5 GiB for a step, over the 20 GiB budget: the planner predicted
7.57 GiB beside the 11.22 GiB of resident optimizer state, the step took ~9-10 GiB. The
allocator's high-water mark says how much, not whose. `bench/train.py --memory-peak` runs one
more (untimed) step under `recording()`, takes `torch.cuda.memory._snapshot()` and reports
`live_at_peak` grouped by `group_by_origin`. Everything here but `recording` and
`tensor_labels` works on the snapshot dict alone (tests/train/test_memory_peak.py, on the CPU).

How the replay counts, from c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator):
  - alloc_found_block() adds block->size to allocated_bytes and active_bytes, and records
    'alloc' with the size the caller asked for (orig_size), not the block's;
  - free() subtracts block->size from allocated_bytes and records 'free_requested'; then, if
    the block was used on other streams (record_stream), it waits for events on those
    streams, else it calls free_block() at once;
  - free_block() records 'free_completed' and subtracts from active_bytes (and
    requested_bytes): only now can the memory be handed out again.
So max_memory_allocated() (allocated_bytes.all.peak) drops at 'free_requested'. A block
freed with record_stream uses pending is not "allocated" any more, but still "active": its
memory is unusable until 'free_completed'. `live_at_peak` counts either way: by default
(freed_at="free_requested") its peak compares with max_memory_allocated(); with
freed_at="free_completed" with memory_stats()["active_bytes.all.peak"]. What the second
peak adds over the first is what pending frees (the record_stream suspect) cost.
(torch/cuda/_memory_viz.py's `trace` subtracts at free_completed: it draws active memory.)

Recording starts mid-run, and the trace is a ring buffer (max_entries; the oldest events
drop out), so blocks allocated before the first recorded event have no 'alloc'. Rather
than guess that baseline (a free without an alloc shows only the blocks freed during the
step, not those live throughout), the replay starts from the snapshot's segments, the
exact state at the trace's end (`snapshot()` takes segments and traces under the same
allocator lock; turning recording off clears the trace, so snapshot inside `recording()`),
and undoes the events walking back: before an 'alloc' its block was not live, before a
free it was (with the free's size and frames). What is left is the state at the trace's
first event, baseline included; a forward replay from it finds the peak, in total bytes
comparable with max_memory_allocated().

Sizes: trace entries carry requested sizes; allocated_bytes counts block sizes (the request
rounded up to 512 B, and a large block keeps a remainder under 1 MiB rather than split it
off). The replay uses the exact block size of every block still live at the end (from
the segments) and the 512-B rounded request for the others, so its peak can fall short of
max_memory_allocated() by those unsplit remainders (at most ~1 MiB per large block that
was allocated and freed within the trace), or more under roundup_power2_divisions.
"""

from __future__ import annotations

import contextlib

FREED_AT = ("free_requested", "free_completed")
BEFORE = "live before recording"  # the origin of a block allocated before the trace, without frames
NO_FRAMES = "<no Python frames>"  # allocated in the trace from a thread running no Python (autograd's)


@contextlib.contextmanager
def recording(max_entries: int = 1_000_000):
    """Record the CUDA caching allocator's history (every alloc and free, with the Python
    stack of each allocation) inside the block. Take `torch.cuda.memory._snapshot()` inside
    it: turning recording off clears the trace. Only the four arguments torch has had since
    2.1 (torch 2.11 and 2.13 both take them); stacks="python" skips C++ unwinding."""
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _block_size(requested: int) -> int:
    """The allocator's round_size(): at least 512 B, a multiple of 512 B."""
    return max(512, -(-requested // 512) * 512)


def _live_at_end(snapshot: dict, device: int, freed_at: str) -> dict[int, dict]:
    """addr -> block for the blocks the snapshot's segments hold on `device`: allocated ones,
    and with freed_at="free_completed" also those whose free waits on other streams."""
    states = ("active_allocated",) if freed_at == "free_requested" else ("active_allocated", "active_pending_free")
    live = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] in states:
                # old snapshots kept the frames in the block's history
                frames = b.get("frames") or (b.get("history") or [{}])[0].get("frames") or []
                live[b.get("address", addr)] = {"addr": b.get("address", addr), "size": b["size"],
                                                "frames": frames, "before": True}
            addr += b["size"]
    return live


def _forward(start: dict[int, dict], trace: list[dict], sizes: dict[int, int], freed_at: str,
             stop: int) -> tuple[dict[int, dict], int, int]:
    """Replay trace[:stop] from `start`: (live blocks after it, peak total, index of the event
    that reached the peak; -1 when it was the start)."""
    live = dict(start)
    total = sum(b["size"] for b in live.values())
    peak, at = total, -1
    for i, e in enumerate(trace[:stop]):
        if e["action"] == "alloc":
            size = sizes.get(i) or _block_size(e["size"])
            old = live.get(e["addr"])  # only in a trace that disagrees with itself
            total += size - (old["size"] if old else 0)
            live[e["addr"]] = {"addr": e["addr"], "size": size, "frames": e.get("frames") or [], "before": False}
        elif e["action"] == freed_at and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > peak:
            peak, at = total, i
    return live, peak, at


def live_at_peak(snapshot: dict, device: int = 0,
                 freed_at: str = "free_requested") -> tuple[int, list[dict]]:
    """The highest total of live block bytes over `snapshot["device_traces"][device]` and the
    blocks live then, largest first, each {"addr", "size", "frames"}; a block allocated before
    the trace began and without frames has "origin": BEFORE instead. `freed_at`: the event
    after which a freed block stops counting (module docstring: "free_requested" matches
    max_memory_allocated, "free_completed" active bytes, pending record_stream frees kept)."""
    if freed_at not in FREED_AT:
        raise ValueError(f"freed_at must be one of {FREED_AT}, not {freed_at!r}")
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    # Walk back from the end state to the state before the first recorded event. Other
    # actions (segment_alloc/free/map/unmap: reserved memory; snapshot, oom) allocate nothing.
    live = _live_at_end(snapshot, device, freed_at)
    sizes = {}  # index of an 'alloc' -> its block's size (exact when the block is live at the end)
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        if e["action"] == "alloc":
            b = live.pop(e["addr"], None)
            if b is not None:  # None: a trace that disagrees with the segments; the rounded size
                sizes[i] = b["size"]
        elif e["action"] == freed_at:
            # with context="alloc" a free carries the allocation's frames (none for a block
            # allocated before recording began)
            live[e["addr"]] = {"addr": e["addr"], "size": _block_size(e["size"]),
                               "frames": e.get("frames") or [], "before": True}
    _, _, at = _forward(live, trace, sizes, freed_at, len(trace))
    at_peak, peak, _ = _forward(live, trace, sizes, freed_at, at + 1)
    blocks = []
    for b in sorted(at_peak.values(), key=lambda b: -b["size"]):
        out = {"addr": b["addr"], "size": b["size"], "frames": b["frames"]}
        if b["before"] and not b["frames"]:
            out["origin"] = BEFORE
        blocks.append(out)
    return peak, blocks


def _ours(filename: str) -> bool:
    """A frame of this repository (megatrain/, bench/) or of Inductor's generated code
    (/tmp/torchinductor_<user>/xx/<hash>.py). Only the path after the last site-packages
    counts: a virtual environment inside a checkout named megatrain is not ours."""
    for marker in ("/site-packages/", "/dist-packages/"):
        filename = filename.rsplit(marker, 1)[-1]
    path = "/" + filename
    return "torchinductor" in path or "/megatrain/" in path or "/bench/" in path


def _where(frame: dict) -> str:
    """"file:line name", the file from megatrain/ or bench/ on (whichever comes last in the
    path), an Inductor file by its base name, anything else from after site-packages/."""
    name = frame["filename"]
    if "torchinductor" in name:
        name = name.rsplit("/", 1)[-1]
    else:
        name = "/" + name.rsplit("site-packages/", 1)[-1]
        cut = max(name.rfind("/megatrain/"), name.rfind("/bench/"))
        name = name[cut + 1:] if cut >= 0 else name[1:]
    return f"{name}:{frame['line']} {frame['name']}"


def origin(block: dict) -> str:
    """Where a block was allocated: the innermost frame of this repository or of Inductor's
    generated code, else the innermost frame (frames[0] is innermost, as torch gathers them)."""
    if block.get("origin"):
        return block["origin"]
    frames = block.get("frames") or []
    if not frames:
        return NO_FRAMES
    return _where(next((f for f in frames if _ours(f["filename"])), frames[0]))


def _stack(frames: list[dict], most: int = 8) -> list[str]:
    """The frames of ours, innermost first (who called an Inductor graph, from where in the
    bench), else the innermost ones."""
    ours = [f for f in frames if _ours(f["filename"])]
    return [_where(f) for f in (ours or frames)[:most]]


def group_by_origin(blocks: list[dict], top: int = 25) -> list[dict]:
    """Live blocks summed by `origin`, largest first: each {"where", "bytes", "count", "stack"}
    (the largest block's frames of ours, for context); past `top`, one "other" group, so
    the groups' bytes sum to the blocks'."""
    groups: dict[str, dict] = {}
    for b in sorted(blocks, key=lambda b: -b["size"]):
        where = origin(b)
        g = groups.setdefault(where, {"where": where, "bytes": 0, "count": 0, "stack": _stack(b.get("frames") or [])})
        g["bytes"] += b["size"]
        g["count"] += 1
    ranked = sorted(groups.values(), key=lambda g: (-g["bytes"], g["where"]))
    rest = ranked[top:]
    if rest:
        ranked = ranked[:top] + [{"where": f"other ({len(rest)} origins)", "bytes": sum(g["bytes"] for g in rest),
                                  "count": sum(g["count"] for g in rest), "stack": []}]
    return ranked


def summary_table(total: int, groups: list[dict], title: str = "live at the peak") -> str:
    """The groups as text: bytes, block count, origin; the title and total first."""
    from megatrain.errors import format_bytes

    lines = [f"{title}: {format_bytes(total)}", f"{'bytes':>10s} {'blocks':>6s}  where"]
    lines += [f"{format_bytes(g['bytes']):>10s} {g['count']:6d}  {g['where']}" for g in groups]
    return "\n".join(lines)


def tensor_labels(sizes: dict[int, int], most: int = 12) -> dict[int, str]:
    """Names for blocks allocated before recording (they have no frames): addr -> the dtype
    of a live CUDA tensor whose storage starts there and, for the `most` largest, what holds
    it (referrers' types, a dict by its first keys). Blocks no Python tensor owns (held by
    C++ only) get no name. Walks the garbage collector: seconds, after the timed steps."""
    import gc

    import torch

    found: dict[int, torch.Tensor] = {}
    for obj in gc.get_objects():
        try:
            # type(), not isinstance(): that reads __class__, which some module proxies warn on
            if issubclass(type(obj), torch.Tensor) and obj.is_cuda:
                addr = obj.untyped_storage().data_ptr()
                if addr in sizes and addr not in found:
                    found[addr] = obj
        except Exception:  # objects half-built or half-collected, tensors without storage
            continue
    labels = {}
    for rank, addr in enumerate(sorted(found, key=lambda a: -sizes[a])):
        label = f"{str(found[addr].dtype).removeprefix('torch.')} tensor"
        if rank < most:
            # what refers to it, but for `found` and this frame
            holders = sorted({type(r).__qualname__ + (f" {sorted(str(k) for k in list(r)[:64])[:6]}"
                                                      if isinstance(r, dict) else "")
                              for r in gc.get_referrers(found[addr]) if r is not found and not _is_frame(r)})
            label += f" held by {', '.join(holders[:4]) or 'nothing Python sees'}"
        labels[addr] = label
    return labels


def _is_frame(obj) -> bool:
    import types

    return isinstance(obj, types.FrameType)
