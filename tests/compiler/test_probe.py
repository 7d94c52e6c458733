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
    assert all(getattr(rates, k) > 0 for k in ("h2d", "d2h", "duplex", "flops", "adamw"))
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


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("MEGATRAIN_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert probe.cache_dir() == tmp_path / ".cache" / "megatrain"
