"""The warm start on CUDA (device machine): a second process compiling the same model in
bf16 on the GPU, with the defaults a GPU compile runs with (the probe, kernel timings, the
decision cache), gets AOTAutograd's cache hit and restores megatrain's plan. The CPU twin
(tests/compiler/test_warm_start.py) runs on the CPU device only."""

from __future__ import annotations

import pytest

from ..compiler.test_warm_start import _run

pytestmark = pytest.mark.gpu


def test_a_second_cuda_process_restores_the_plan(tmp_path):
    options = {"device": "cuda", "precision": "bf16"}
    first = _run(tmp_path, cuda=True, options=options)
    assert first["megatrain"].get("stored", 0) == 2, first["megatrain"]
    second = _run(tmp_path, cuda=True, options=options)
    assert second["megatrain"] == {"reused": 2}, (second["megatrain"], second["aot"])
    assert second["aot"].get("autograd_cache_hit", 0) == 2, second["aot"]
    assert second["losses"] == first["losses"]
