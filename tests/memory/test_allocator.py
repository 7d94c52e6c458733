"""memory/allocator.py: reading and turning on the CUDA allocator's expandable segments,
without touching the process's real allocator (its setter is stood in for)."""

import random

import pytest
import torch

from megatrain.memory import allocator


@pytest.fixture
def settings(monkeypatch):
    """A clean environment and a recording stand-in for torch's run-time setter/getter."""
    for k in allocator._ENV:
        monkeypatch.delenv(k, raising=False)
    state = {"now": "", "calls": []}

    def set_(s):
        state["calls"].append(s)
        state["now"] = s

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", set_, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: state["now"],
                        raising=False)
    return state


def test_the_last_expandable_segments_setting_wins(settings, monkeypatch):
    assert not allocator.expandable_segments()
    other = random.choice(["max_split_size_mb:128", "garbage_collection_threshold:0.6", ""])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", f"{other},expandable_segments:True")
    assert allocator.expandable_segments()
    settings["now"] = "expandable_segments:False"  # set at run time after the environment
    assert not allocator.expandable_segments()


def test_the_main_job_turns_them_on_unless_the_user_configured_the_allocator(settings, monkeypatch):
    import os

    assert allocator.enable_expandable_segments()
    assert settings["calls"] == ["expandable_segments:True"]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # child processes
    assert allocator.expandable_segments()

    settings["calls"].clear()
    settings["now"] = ""
    var = random.choice(allocator._ENV)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv(var, "expandable_segments:False")
    assert not allocator.enable_expandable_segments()
    assert settings["calls"] == [] and os.environ[var] == "expandable_segments:False"


def test_resident_growth_fills_up_to_the_peak_it_is_given(monkeypatch):
    """UpdateRoom.measured on a CUDA device: the second whole measured step grows the
    reserve from the allocator's reserved peak under fixed segments (fragmentation
    included), from the allocated peak under expandable ones; an overrun is judged by the
    allocated peak alone."""
    import types

    from megatrain.runtime.update_room import MEASURED_STEP, UpdateRoom

    allocated = random.randint(1, 1 << 29)
    reserved = allocated + random.randint(1, 1 << 28)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: reserved)
    room = UpdateRoom.__new__(UpdateRoom)
    grown = []
    room._ctx = types.SimpleNamespace(cuda=True, device=torch.device("cuda", 0))
    room.resident, room._measured_steps, room._overran = object(), 0, None
    room.pool = type("Pool", (), {"budget": 1 << 30})()
    room.grow = grown.append
    monkeypatch.setattr(allocator, "expandable_segments", lambda: False)
    for _ in range(MEASURED_STEP):
        room.measured(allocated)
    assert grown == [reserved] and room._overran is None
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: room.pool.budget + 2)
    room.measured(room.pool.budget + 1)
    assert room._overran == room.pool.budget + 1

    monkeypatch.setattr(allocator, "expandable_segments", lambda: True)
    room._measured_steps, grown[:] = 0, []
    for _ in range(MEASURED_STEP):
        room.measured(allocated)
    assert grown == [allocated]
