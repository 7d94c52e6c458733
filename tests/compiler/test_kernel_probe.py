"""The graph's own products and attention, timed at their shapes: which nodes are read as
what (shapes, dtype, transposed operands, causal attention and its backward), that every
shape is timed once per machine and then read from the cache, and that the cost model
charges a node its FLOPs at its own rate."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from megatrain.compiler import op_costs
from megatrain.runtime import kernel_probe


def _graph(t, h, e, heads, seq):
    def step(x, w, q, k, v):
        y = torch.mm(x, w.t())
        z = torch.addmm(y[0], x, w.t())
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y, z, a

    args = (torch.randn(t, h), torch.randn(e, h), *(torch.randn(2, heads, seq, 8) for _ in range(3)))
    return make_fx(step, tracing_mode="fake")(*args).graph


def test_products_and_attention_are_read_with_their_layouts():
    rng = random.Random()
    t, h, e, heads, seq = (rng.randint(3, 40) for _ in range(5))
    shapes = [s for s in map(op_costs.kernel_shape, _graph(t, h, e, heads, seq).nodes) if s]
    mm = [s for s in shapes if s.kind == "mm"]
    assert [s.shapes for s in mm] == [((t, h), (h, e))] * 2
    assert all(s.flags == (False, True) and s.dtype == "float32" for s in mm)  # x @ w.t()
    (attn,) = [s for s in shapes if s.kind == "sdpa"]
    assert attn.shapes == ((2, heads, seq, 8),) * 2 and attn.flags == (True,) and not attn.backward


@pytest.mark.parametrize("kind", ["mm", "bmm", "sdpa"])
def test_a_slice_of_a_large_product_is_scaled_back_to_the_whole(monkeypatch, kind):
    """Rows (or a batch) cut to keep a timing short are scaled back: with a clock that
    charges each run its operand's leading size, the sliced estimate equals the whole's.
    (Not a timed test: on a shared CPU wall-clock noise allows no useful bound.)"""
    runs = []

    def clock(device, fn):
        out = fn()
        runs.append(out.shape[0] if kind == "sdpa" else out.shape[-2])
        return 1e-6 * runs[-1]

    monkeypatch.setattr(kernel_probe, "_best", clock)
    rows = random.choice([96, 160, 224])
    shapes = {"mm": ((rows, 32), (32, 16)), "bmm": ((2, rows, 32), (2, 32, 16)),
              "sdpa": ((rows, 2, 8, 4), (rows, 2, 8, 4))}[kind]
    s = kernel_probe.KernelShape(kind, shapes, "float32", (False, False))
    whole = kernel_probe._time(torch.device("cpu"), s)
    sliced = kernel_probe._time(torch.device("cpu"), s, shrink=8)
    assert runs == [rows, rows // 8]
    assert sliced == pytest.approx(whole, rel=1e-9)


def test_each_shape_is_timed_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    m, k, n = (random.randint(16, 96) for _ in range(3))
    mm = kernel_probe.KernelShape("mm", ((m, k), (k, n)), "float32", (False, True))
    attn = kernel_probe.KernelShape("sdpa", ((1, 2, 32, 8), (1, 2, 32, 8)), "float32", (True,))
    back = kernel_probe.KernelShape("sdpa", ((1, 2, 32, 8), (1, 2, 32, 8)), "float32", (True,), True)
    flops = {mm: 2 * m * k * n, attn: 4 * 2 * 32 * 32 * 8, back: 8 * 2 * 32 * 32 * 8}
    rates = kernel_probe.measured_rates(torch.device("cpu"), [mm, attn, back], flops, 1e11)
    assert set(rates) <= {mm, attn, back} and mm in rates and attn in rates
    assert all(0 < r < float("inf") for r in rates.values())

    def no_timing(*a):
        raise AssertionError("timed again despite the cache")

    monkeypatch.setattr(kernel_probe, "_time", no_timing)
    assert kernel_probe.measured_rates(torch.device("cpu"), [mm, attn, back], flops, 1e11) == rates


def test_a_shape_that_cannot_run_alone_is_cached_as_such(tmp_path, monkeypatch):
    """Left out of the rates (charged at the probe's), and remembered: a later compile reads
    the same answer without timing, so its plan is the same (a warm start's plan cache
    needs that); a full device is not remembered."""
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    m, k, n = (random.randint(16, 96) for _ in range(3))
    mm = kernel_probe.KernelShape("mm", ((m, k), (k, n)), "float32", (False, True))
    odd = kernel_probe.KernelShape("conv", ((m, k), (k, n)), "float32", ())   # _time refuses it
    flops = {mm: 2 * m * k * n, odd: 2 * m * k * n}
    seen: dict = {}
    rates = kernel_probe.measured_rates(torch.device("cpu"), [mm, odd], flops, 1e11, seen=seen)
    assert set(rates) == {mm} and seen[odd.key] == 0.0 and seen[mm.key] > 0

    def no_timing(*a):
        raise AssertionError("timed again despite the cache")

    monkeypatch.setattr(kernel_probe, "_time", no_timing)
    again: dict = {}
    assert kernel_probe.measured_rates(torch.device("cpu"), [mm, odd], flops, 1e11, seen=again) == rates
    assert again == seen

    full = kernel_probe.KernelShape("mm", ((m + 1, k), (k, n)), "float32", (False, True))

    def out_of_memory(*a):
        raise torch.OutOfMemoryError("full")

    monkeypatch.setattr(kernel_probe, "_time", out_of_memory)
    third: dict = {}
    assert full not in kernel_probe.measured_rates(torch.device("cpu"), [full], {full: 1}, 1e11, seen=third)
    assert third == {full.key: None}
    assert full.key not in json.loads(kernel_probe.cache_file(torch.device("cpu")).read_text())


def test_a_node_is_charged_at_its_own_rate(tmp_path, monkeypatch):
    """The compile's problem carries each region's FLOPs at the probe's matmul rate: a
    product measured at half that rate counts twice its FLOPs."""
    import megatrain
    from megatrain.compiler import rates as rates_mod
    from megatrain.runtime import probe

    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(probe.ProbeSizes, "for_device", classmethod(
        lambda cls, d: probe.ProbeSizes(copy_bytes=1 << 20, matmul_n=64, adamw_params=1 << 14, repeats=1)))
    half = {}

    def half_rate(device, shapes, flops, probe_flops, seen=None):
        base = rates_mod.cached_rates(device).flops
        half.update({s: base / 2 for s in shapes})
        return dict(half)

    monkeypatch.setattr(kernel_probe, "measured_rates", half_rate)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x = torch.randn(16, 32)
    plans = {}
    for probing in (False, True):
        torch._dynamo.reset()
        with megatrain.config.patch(probe_rates=probing, lowering="eager"):
            rates_mod.measure_once(torch.device("cpu")) if not probing else None
            torch.compile(model, backend="megatrain", options={"device": "cpu"})(x).sum().backward()
        plans[probing] = megatrain.explain().graphs[0].schedule.plan.schedule.problem
    assert half, "no product was timed"
    plain = sum(r.flops_fw for r in plans[False].regions)
    timed = sum(r.flops_fw for r in plans[True].regions)
    assert plain > 0 and timed == pytest.approx(2 * plain, rel=1e-6)


def test_timing_runs_inside_a_real_compile(tmp_path, monkeypatch):
    """Unpatched: the compile times its products on the device from inside the partition
    (outside the trace's fake mode), caches them, and plans with them."""
    import json

    import megatrain
    from megatrain.runtime import probe

    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(probe.ProbeSizes, "for_device", classmethod(
        lambda cls, d: probe.ProbeSizes(copy_bytes=1 << 20, matmul_n=64, adamw_params=1 << 14, repeats=1)))
    width = random.randint(16, 48)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    with megatrain.config.patch(probe_rates=True, lowering="eager"):
        torch.compile(model, backend="megatrain", options={"device": "cpu"})(
            torch.randn(8, width)).sum().backward()
    (cache,) = tmp_path.glob("kernels-*.json")
    timed = json.loads(cache.read_text())
    assert timed and all(0 < s < 10 for s in timed.values())
    assert any(json.loads(k)[1][0] == [8, width] for k in timed)  # the first layer's product
    assert sum(r.flops_fw for r in megatrain.explain().graphs[0].schedule.plan.schedule.problem.regions) > 0
