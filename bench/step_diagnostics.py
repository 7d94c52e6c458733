"""Extra, untimed steps a bench child runs after its timed ones when asked: one under
torch.profiler (--profile: op tables, the ops that take the GPU's and the host's time) and
one under the CUDA allocator's history (--memory-peak: what was live at the peak, by where
it was allocated), which the peak figure alone cannot say. Neither is timed; the
allocator-history step runs after every figure of the row is read, since it resets the
peak-memory stats."""

from __future__ import annotations

from pathlib import Path

from presets import _config

MEMORY_PEAK_ENTRIES = 1_000_000  # --memory-peak: the allocator's ring buffer, events (a few KB each)


def _memory_at_peak(args, device, step) -> dict:
    """Run `step` once under the CUDA allocator's history (bench/memory_peak.py): the bytes
    live at its allocated-bytes peak, replayed from the trace, beside max_memory_allocated()
    for the same step, and the live blocks grouped by where they were allocated; blocks
    allocated before the step are named by the tensor that owns them. The same at the
    active-bytes peak (frees still waiting on record_stream events count)."""
    import torch
    from memory_peak import (
        BEFORE,
        group_by_origin,
        live_at_peak,
        recording,
        tensor_labels,
    )

    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)  # the streamer's begin_step resets it too
    with recording(MEMORY_PEAK_ENTRIES):
        step()
        torch.cuda.synchronize(device)
        max_allocated = torch.cuda.max_memory_allocated(device)
        max_active = torch.cuda.memory_stats(device).get("active_bytes.all.peak")
        snapshot = torch.cuda.memory._snapshot()  # inside: turning recording off clears the trace
    if args.memory_peak_snapshot:  # for pytorch.org/memory_viz
        import pickle

        Path(args.memory_peak_snapshot).parent.mkdir(parents=True, exist_ok=True)
        Path(args.memory_peak_snapshot).write_bytes(pickle.dumps(snapshot))
    traces = snapshot["device_traces"]
    entries = len(traces[index]) if index < len(traces) else 0
    peak, blocks = live_at_peak(snapshot, index)
    active_peak, active_blocks = live_at_peak(snapshot, index, freed_at="free_completed")
    before = [b for b in blocks + active_blocks if b.get("origin") == BEFORE]
    labels = tensor_labels({b["addr"]: b["size"] for b in before}) if before else {}
    for b in before:
        if b["addr"] in labels:
            b["origin"] = f"{BEFORE}: {labels[b['addr']]}"
    return {"peak_bytes": peak, "max_memory_allocated": max_allocated, "groups": group_by_origin(blocks),
            "active_peak_bytes": active_peak, "max_active_bytes": max_active,
            "active_groups": group_by_origin(active_blocks, top=10),
            # a full ring buffer dropped the step's first events: the peak may precede them
            "trace_entries": entries, "trace_full": entries >= MEMORY_PEAK_ENTRIES}


def _profile_step(args, step) -> None:
    """One step under torch.profiler: the ops that take the GPU's time and the host's, as
    text tables (a whole trace is too large to bring back from the device machine)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.key_averages()
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    sort = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
    layers = args.layers or _config(args.model).layers
    (out / f"profile_{args.system}_{args.model}_L{layers}_{args.tokens}.txt").write_text(
        f"{args.system} {args.model} {args.tokens} tokens: by GPU time\n"
        + events.table(sort_by=sort, row_limit=40, max_name_column_width=70)
        + "\nby host self time\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))


def compile_split(top: int = 20) -> dict[str, float]:
    """Where this process's compiling went, by torch's own timers (`dynamo_timed`: dynamo's
    tracing, AOT autograd, Inductor's lowering, scheduling, code generation and its wait for
    the kernel compiles), summed over every graph, the `top` largest in seconds. Timers
    nest (a lowering holds its code generation), so the values overlap and do not add up;
    they say which stage of a long first step to look at."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    seconds = {n: float(v) for n, v in zip(names, values) if v}
    return {n: round(s, 2) for n, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:top]}
