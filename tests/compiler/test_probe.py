"""The machine probe: measures positive rates on the CPU device, caches them per device."""

from __future__ import annotations

import json

import pytest

from megatrain.plan.costs import Rates
from megatrain.runtime import probe

TINY = probe.ProbeSizes(copy_bytes=1 << 20, matmul_n=64, adamw_params=1 << 14, repeats=1)


def test_probe_measures_and_caches_by_device_name(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    rates = probe.load_or_probe("cpu", sizes=TINY)
    assert rates.device == probe.device_name("cpu")
    assert all(getattr(rates, k) > 0 for k in ("h2d", "d2h", "duplex", "flops", "adamw", "memory"))
    path = probe.cache_path(rates.device)
    assert path.parent == tmp_path
    data = json.loads(path.read_text())
    assert Rates.from_json(data["rates"]) == rates and data["meta"]["adamw_impl"] in ("fused", "foreach")

    def no_measuring(*a, **k):
        raise AssertionError("measured again despite a cache")

    monkeypatch.setattr(probe, "probe", no_measuring)
    assert probe.load_or_probe("cpu") == rates  # from the cache
    with pytest.raises(AssertionError, match="measured again"):
        probe.load_or_probe("cpu", refresh=True)


def test_unreadable_cache_is_measured_over(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    path = probe.cache_path(probe.device_name("cpu"))
    path.write_text("{not json")
    rates = probe.load_or_probe("cpu", sizes=TINY)
    assert json.loads(path.read_text())["rates"]["device"] == rates.device


def test_cache_from_before_a_rate_was_measured_is_measured_over(tmp_path, monkeypatch):
    """A cache without the device memory rate is not trusted with a guess: measured again."""
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    path = probe.cache_path(probe.device_name("cpu"))
    old = {"device": probe.device_name("cpu"), "h2d": 1e9, "d2h": 1e9, "duplex": 1e9,
           "flops": 1e9, "adamw": 1e9}
    path.write_text(json.dumps({"rates": old}))
    rates = probe.load_or_probe("cpu", sizes=TINY)
    assert rates.memory > 0 and json.loads(path.read_text())["rates"]["memory"] == rates.memory


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("MEGATRAIN_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert probe.cache_dir() == tmp_path / ".cache" / "megatrain"


def test_the_first_compile_measures_the_machine_once(tmp_path, monkeypatch):
    """A user who never calls the probe still plans with this machine's rates: the first
    compile measures and caches them, later compiles read the cache."""
    import torch

    import megatrain
    from megatrain.compiler import rates as rates_mod

    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(probe.ProbeSizes, "for_device", classmethod(lambda cls, d: TINY))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    with megatrain.config.patch(probe_rates=True, lowering="eager"):
        torch.compile(model, backend="megatrain", options={"device": "cpu"})(x).sum().backward()
        measured = rates_mod.cached_rates(torch.device("cpu"))
        assert measured is not None and measured.device == probe.device_name("cpu")
        assert megatrain.explain().graphs[0].schedule.rates == measured

        def no_measuring(*a, **k):
            raise AssertionError("measured again despite a cache")

        monkeypatch.setattr(probe, "probe", no_measuring)
        torch._dynamo.reset()
        torch.compile(model, backend="megatrain", options={"device": "cpu"})(x).sum().backward()
