"""Compile phases: exclusive wall times that add up to the backend's time, per graph."""

import time

import torch

import megatrain
from megatrain.compiler.phases import phase


def test_nested_phases_are_exclusive_and_add_up():
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    with phase("outer", times):
        time.sleep(0.02)
        with phase("inner"):           # the enclosing phase's dict
            time.sleep(0.03)
            with phase("inner"):       # re-entered: still one entry, no double count
                time.sleep(0.01)
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    assert set(times) == {"outer", "inner"}
    assert 0.04 <= times["inner"] < 0.04 + 0.03 and 0.03 <= times["outer"] < 0.03 + 0.03
    assert abs(sum(times.values()) - wall) < 0.005
    with phase("nowhere"):             # outside any phase and without a dict: not recorded
        pass
    assert "nowhere" not in times


def test_explain_reports_each_phase_of_a_compile():
    torch._dynamo.reset()
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    step = torch.compile(model, backend="megatrain", options={"device": "cpu", "gpu_memory": "64MiB"})
    t0 = time.perf_counter()
    with megatrain.config.patch(lowering="eager"):   # the phases, not Inductor's speed
        step(torch.randn(4, 32)).sum().backward()
    wall = time.perf_counter() - t0
    phases = megatrain.explain(step).compile_seconds
    assert {"probe", "capture", "aot", "planning", "lowering", "homing"} <= set(phases), phases
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) < wall
