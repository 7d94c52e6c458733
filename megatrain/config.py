"""Knobs for tests, benchmarks and debugging, like `torch._inductor.config`: module-level
values read where they act, changed with `megatrain.config.patch(name=value)` (a context
manager and decorator) or by assignment. Users set options (`device`, `gpu_memory`, ...);
nothing here is needed to train fast or exactly.
"""

from __future__ import annotations

import contextlib
import sys

# Compare every fetched weight buffer bitwise with its host master (cast to the compute
# dtype) before the region computes with it. Slow (a device-to-host copy per region per
# pass): for hunting a wrong result, never for training. The cheap check that a buffer was
# fetched from exactly its region's parameters, unchanged since, is always on. Regions
# whose AdamW state lives on the device are skipped: their host copies may lag by design.
check_fetched_weights: bool = False


@contextlib.contextmanager
def patch(**values):
    """Set module values for a block: `with megatrain.config.patch(check_fetched_weights=True):`."""
    module = sys.modules[__name__]
    unknown = [k for k in values if not hasattr(module, k) or k.startswith("_") or k == "patch"]
    if unknown:
        raise AttributeError(f"megatrain.config has no knob {unknown[0]!r}; knobs: "
                             f"{', '.join(_knobs())}")
    old = {k: getattr(module, k) for k in values}
    try:
        for k, v in values.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def _knobs() -> list[str]:
    module = sys.modules[__name__]
    return [k for k, v in vars(module).items()
            if not k.startswith("_") and not callable(v) and not isinstance(v, type(sys))
            and k != "annotations"]
