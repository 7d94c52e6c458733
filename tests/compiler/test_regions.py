"""Region assignment: module paths from dynamo's stacks (layers in real models: test_hf_zoo)."""

from __future__ import annotations

import pytest

from megatrain.compiler.regions import module_path


@pytest.mark.parametrize("raw, path", [
    ("L['self'].layers[3]", "layers.3"),
    ("L['self'].layers.3.mlp", "layers.3.mlp"),
    ("L['args'][0].model.layers.0", "model.layers.0"),  # a decorated forward(*args)
    ("L['self']._modules['layers']._modules['0']", "layers.0"),
    ("getattr(L['self'].layers, '2')", "layers.2"),
    ("L['model'].h.11", "h.11"),
    ("L['self']", ""),
])
def test_module_path(raw, path):
    assert module_path(raw) == path
