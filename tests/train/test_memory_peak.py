"""bench/memory_peak.py: the blocks live at a step's allocated-bytes peak, replayed from the
allocator's trace, on snapshot dicts built here in the form torch.cuda.memory._snapshot()
returns (keys as torch/csrc/cuda/Module.cpp writes them): no GPU needed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from memory_peak import BEFORE, NO_FRAMES, group_by_origin, live_at_peak, summary_table  # noqa: E402

MiB = 2**20
TORCH = "/usr/lib/python3/site-packages/torch"  # any installation's path


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


def event(action: str, addr: int, size: int, frames: list[dict] | None = None) -> dict:
    """A trace entry as torch writes it; "frames" only where the allocator kept a context."""
    e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0}
    if frames is not None:
        e["frames"] = frames
    return e


def block(address: int, size: int, state: str, requested: int | None = None, frames=()) -> dict:
    return {"address": address, "size": size, "requested_size": size if requested is None else requested,
            "state": state, "frames": list(frames)}


def segment(address: int, blocks: list[dict], device: int = 0) -> dict:
    used = [b for b in blocks if b["state"] != "inactive"]
    return {"device": device, "address": address, "total_size": sum(b["size"] for b in blocks),
            "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in used), "requested_size": sum(b["requested_size"] for b in used),
            "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
            "frames": [], "blocks": blocks}


# where each block of the step below was allocated, innermost frame first
AT_A = [frame(f"{TORCH}/_tensor.py", 1500, "new_empty"), frame("/src/repo/megatrain/runtime/streamer.py", 120, "fetch"),
        frame("/src/repo/bench/train.py", 700, "run_steps")]
AT_C = [frame("/src/repo/megatrain/runtime/activation_offload.py", 90, "park")]
AT_D = [frame(f"{TORCH}/_inductor/runtime/triton_heuristics.py", 10, "run"),
        frame("/tmp/torchinductor_root/ab/cabcdef0123.py", 33, "call"),
        frame("/src/repo/megatrain/compiler/backend.py", 400, "run_graph")]
# torch in a virtual environment inside a checkout named megatrain: not megatrain's code
AT_E = [frame("/home/u/megatrain/.venv/lib/python3.11/site-packages/torch/nn/functional.py", 2000, "linear"),
        frame("/home/u/megatrain/.venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125, "forward"),
        frame("/home/u/megatrain/megatrain/models/llama.py", 88, "forward")]
B0, B1, A, C, D, E, OTHER = (0x7F0000000000 + i * 0x10000000 for i in range(7))


def step_snapshot() -> dict:
    """One step recorded mid-run. Before recording: B0 (4 MiB, live throughout) and B1 (2 MiB,
    freed in the step), neither with an alloc event or frames. C is freed while another
    stream still uses it (record_stream): free_requested, then D's alloc, then
    free_completed. D asked for 10 MiB and got a 10.5 MiB block (an unsplit remainder),
    which the segments show because D is still live at the end.

        allocated MiB (free_requested)    active MiB (free_completed)
        start B0+B1          6                  6
        alloc A 8           14                 14
        alloc C 16          30                 30
        free_req C          14                 30
        alloc D 10.5        24.5               40.5  <- active peak
        free_compl C        24.5               24.5
        free B1             22.5               22.5
        alloc E 12          34.5  <- peak      34.5
        free A, free E      14.5               14.5  = B0 + D, the segments at the end
    """
    trace = [
        event("segment_alloc", A, 20 * MiB, AT_A),
        event("alloc", A, 8 * MiB, AT_A),
        event("alloc", C, 16 * MiB, AT_C),
        event("free_requested", C, 16 * MiB, AT_C),
        event("alloc", D, 10 * MiB, AT_D),
        event("oom", 0, 64 * MiB) | {"device_free": 0},
        event("free_completed", C, 16 * MiB, AT_C),
        event("free_requested", B1, 2 * MiB, []),
        event("free_completed", B1, 2 * MiB, []),
        event("alloc", E, 12 * MiB, AT_E),
        event("free_requested", A, 8 * MiB, AT_A),
        event("free_completed", A, 8 * MiB, AT_A),
        event("snapshot", 0, 0),
        event("free_requested", E, 12 * MiB, AT_E),
        event("free_completed", E, 12 * MiB, AT_E),
    ]
    del trace[5]["addr"]  # an oom entry has device_free in addr's place
    other = [event("alloc", OTHER, 64 * MiB, AT_A)]
    segments = [
        segment(B0, [block(B0, 4 * MiB, "active_allocated"), block(B0 + 4 * MiB, 16 * MiB, "inactive")]),
        segment(A, [block(A, 20 * MiB, "inactive")]),
        segment(D, [block(D, int(10.5 * MiB), "active_allocated", 10 * MiB, AT_D),
                    block(D + int(10.5 * MiB), int(9.5 * MiB), "inactive")]),
        segment(OTHER, [block(OTHER, 64 * MiB, "active_allocated", frames=AT_A)], device=1),
    ]
    return {"segments": segments, "device_traces": [trace, other], "allocator_settings": {},
            "external_annotations": []}


def test_peak_counts_until_free_requested_and_includes_blocks_live_before_recording():
    """allocated_bytes (max_memory_allocated) drops at free_requested; B0 has no event at all
    and B1 only its free, yet both count; D at its exact block size."""
    peak, blocks = live_at_peak(step_snapshot())
    assert peak == int(34.5 * MiB)
    assert {b["addr"]: b["size"] for b in blocks} == {B0: 4 * MiB, A: 8 * MiB, D: int(10.5 * MiB), E: 12 * MiB}
    assert sum(b["size"] for b in blocks) == peak
    assert [b["addr"] for b in blocks] == [E, D, A, B0]  # largest first
    b0 = next(b for b in blocks if b["addr"] == B0)
    assert b0["frames"] == [] and b0["origin"] == BEFORE
    assert next(b for b in blocks if b["addr"] == D)["frames"] == AT_D


def test_active_peak_keeps_frees_waiting_on_other_streams():
    """Counting until free_completed (active bytes) peaks elsewhere, higher: C's pending free
    and B1 still count. A replay that dropped blocks at free_completed in the default mode
    would report this 40.5 MiB as max_memory_allocated's peak."""
    peak, blocks = live_at_peak(step_snapshot(), freed_at="free_completed")
    assert peak == int(40.5 * MiB)
    assert {b["addr"] for b in blocks} == {B0, B1, A, C, D}
    assert next(b for b in blocks if b["addr"] == B1)["origin"] == BEFORE
    assert peak != live_at_peak(step_snapshot())[0]
    with pytest.raises(ValueError):
        live_at_peak(step_snapshot(), freed_at="free")


def test_other_devices_stay_apart():
    snapshot = step_snapshot()
    assert OTHER not in {b["addr"] for b in live_at_peak(snapshot, device=0)[1]}
    # device 1: its block was allocated in its trace and is live at the end
    assert live_at_peak(snapshot, device=1) == (64 * MiB, [{"addr": OTHER, "size": 64 * MiB, "frames": AT_A}])


def test_pending_free_of_a_block_from_before_recording_and_rounded_sizes():
    """P was allocated before recording and its free still waits at the end: only the
    segments know it is active. Q asked for 100 bytes and holds a 512-byte block; R (freed
    in the trace, so sized from its request) 1000 bytes, counted as 1024. Allocations from a
    thread without Python (autograd's) have no frames."""
    P, Q, R = 0x7F0000000000, 0x7F0000200000, 0x7F0000200200
    trace = [event("free_requested", P, 2 * MiB, []), event("alloc", Q, 100), event("alloc", R, 1000),
             event("free_requested", R, 1000), event("free_completed", R, 1000)]
    snapshot = {"segments": [segment(P, [block(P, 2 * MiB, "active_pending_free")]),
                             segment(Q, [block(Q, 512, "active_allocated", 100), block(R, 2 * MiB - 512, "inactive")])],
                "device_traces": [trace]}
    peak, blocks = live_at_peak(snapshot)
    assert (peak, [b["addr"] for b in blocks]) == (2 * MiB, [P])  # the start: P not yet freed
    peak, blocks = live_at_peak(snapshot, freed_at="free_completed")
    assert peak == 2 * MiB + 512 + 1024
    assert {b["addr"]: b["size"] for b in blocks} == {P: 2 * MiB, Q: 512, R: 1024}
    assert [g["where"] for g in group_by_origin(blocks)] == [BEFORE, NO_FRAMES]


def test_groups_by_megatrain_inductor_or_innermost_frame_and_sum_to_the_total():
    peak, blocks = live_at_peak(step_snapshot())
    groups = group_by_origin(blocks)
    assert [(g["where"], g["bytes"], g["count"]) for g in groups] == [
        ("megatrain/models/llama.py:88 forward", 12 * MiB, 1),  # not the venv's torch frames
        ("cabcdef0123.py:33 call", int(10.5 * MiB), 1),  # Inductor's generated code, not triton_heuristics
        ("megatrain/runtime/streamer.py:120 fetch", 8 * MiB, 1),  # not torch/_tensor.py inside it
        (BEFORE, 4 * MiB, 1)]
    # for context, the frames of ours: which megatrain code ran that Inductor graph
    assert groups[1]["stack"] == ["cabcdef0123.py:33 call", "megatrain/compiler/backend.py:400 run_graph"]
    top = group_by_origin(blocks, top=2)
    assert [g["where"] for g in top] == [groups[0]["where"], groups[1]["where"], "other (2 origins)"]
    assert top[-1]["bytes"] == 12 * MiB and top[-1]["count"] == 2
    assert sum(g["bytes"] for g in top) == sum(g["bytes"] for g in groups) == peak
    # no frame of ours: the innermost
    torch_only = group_by_origin([{"addr": 1, "size": MiB, "frames": AT_E[:2]}])
    assert [g["where"] for g in torch_only] == ["torch/nn/functional.py:2000 linear"]
    # two blocks from one line make one group
    twice = group_by_origin([{"addr": 1, "size": 3 * MiB, "frames": AT_A}, {"addr": 2, "size": MiB, "frames": AT_A}])
    assert [(g["where"], g["bytes"], g["count"]) for g in twice] == [("megatrain/runtime/streamer.py:120 fetch", 4 * MiB, 2)]


def test_summary_table():
    peak, blocks = live_at_peak(step_snapshot())
    table = summary_table(peak, group_by_origin(blocks, top=2))
    lines = table.splitlines()
    assert lines[0] == "live at the peak: 34.50 MiB"  # megatrain.errors.format_bytes
    assert lines[2].split() == ["12.00", "MiB", "1", "megatrain/models/llama.py:88", "forward"]
    assert lines[-1].split()[-3:] == ["other", "(2", "origins)"] and len(lines) == 5
    assert summary_table(3 * 2**30, [], "allocated").startswith("allocated: 3.00 GiB")


def test_replay_matches_a_simulated_allocator():
    """A random run of a toy allocator (addresses reused, some frees deferred as with
    record_stream), recorded from a random event on: the replayed peaks are the true ones
    over the recorded window, in both counts, whatever was live before recording."""
    import random

    rng = random.Random(0)
    for _ in range(50):
        allocated, pending, free_addrs, trace = {}, {}, [], []
        totals = [(0, 0)]  # (allocated, active) before the first event and after each

        def emit(action: str, addr: int, size: int, frames: list[dict]) -> None:
            trace.append(event(action, addr, size, frames))
            totals.append((sum(allocated.values()), sum(allocated.values()) + sum(pending.values())))

        next_addr = 0x7F0000000000
        for _ in range(rng.randrange(5, 80)):
            roll = rng.random()
            if roll < 0.45 or not allocated:
                addr = free_addrs.pop() if free_addrs and rng.random() < 0.5 else next_addr
                next_addr = max(next_addr, addr + 0x1000000)
                allocated[addr] = rng.randrange(1, 16) * 512
                emit("alloc", addr, allocated[addr], [frame("/src/repo/megatrain/x.py", rng.randrange(5), "f")])
            elif roll < 0.85:
                addr = rng.choice(sorted(allocated))
                pending[addr] = allocated.pop(addr)
                emit("free_requested", addr, pending[addr], [])
            if pending and rng.random() < 0.7:  # a free completes: at once, or one waiting
                addr = rng.choice(sorted(pending))
                size = pending.pop(addr)
                emit("free_completed", addr, size, [])
                free_addrs.append(addr)
        k = rng.randrange(len(trace))  # recording starts at event k
        ends = [block(a, s, "active_allocated") for a, s in allocated.items()] + \
               [block(a, s, "active_pending_free") for a, s in pending.items()]
        snapshot = {"segments": [segment(b["address"], [b]) for b in ends], "device_traces": [trace[k:]]}
        assert live_at_peak(snapshot)[0] == max(t[0] for t in totals[k:])
        assert live_at_peak(snapshot, freed_at="free_completed")[0] == max(t[1] for t in totals[k:])
