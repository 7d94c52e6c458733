import os
import tempfile

import pytest
import torch

# Triton kernels run on the CPU through the interpreter in the default (CPU) run. Set
# before megatrain is imported: triton reads it when a kernel is decorated.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import megatrain  # noqa: E402

# Plans in tests use the default rates, never a probe of the machine that runs them
# (megatrain.config.probe_rates) nor a cache a user's runs left: the cache folder is empty
# and private to the test session (test_probe.py measures into its own on purpose).
megatrain.config.probe_rates = False
megatrain.config.decision_cache = False  # each test's choice is made afresh (test_decision_cache.py turns it on)
megatrain.config.aot_cache = False  # each test plans afresh (test_warm_start.py turns it on)
os.environ["MEGATRAIN_CACHE"] = tempfile.mkdtemp(prefix="megatrain-test-cache-")


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
