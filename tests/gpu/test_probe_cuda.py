"""The probe on a GPU times the host update as training runs it: at the optimizer's
threads, while both directions of the link copy and with the link quiet."""

from __future__ import annotations

import json

import pytest
import torch

from megatrain.runtime import probe

pytestmark = pytest.mark.gpu


def test_the_host_update_is_timed_beside_a_busy_link(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    before = torch.get_num_threads()
    sizes = probe.ProbeSizes(copy_bytes=64 << 20, matmul_n=1024, adamw_params=8 << 20, repeats=2)
    rates = probe.load_or_probe("cuda", refresh=True, sizes=sizes)
    meta = json.loads(probe.cache_path(rates.device).read_text())["meta"]
    assert meta["adamw_beside"] == "duplex copies" and meta["adamw_link_busy_throughout"] is True
    assert meta["adamw_threads"] == max(1, before // 2) and torch.get_num_threads() == before
    assert rates.adamw > 0 and rates.adamw_quiet is not None and rates.adamw_quiet > 0
