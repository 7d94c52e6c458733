import os

import pytest
import torch

# Triton kernels run on the CPU through the interpreter in the default (CPU) run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graphs or counters leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
