"""Knobs for tests, benchmarks and debugging, like `torch._inductor.config`: module-level
values read where they act, changed with `megatrain.config.patch(name=value)` (a context
manager) or by assignment. Users set options (`device`, `gpu_memory`, `precision`); the
rest is megatrain's to decide, and nothing here is needed to train fast or exactly.

The decisions below are read when a graph is compiled (the first call of the compiled
model, and any recompile): a test or benchmark forcing one wraps those calls in `patch`.
A forced decision is a diagnostic; where one wins, the planner must learn to choose it.
Each value is validated like an option, with the fix in the error.
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

# Measure this machine's rates (link, matmul, device memory, host AdamW) at the first
# compile when no cache holds them: seconds, once per machine, cached under
# $MEGATRAIN_CACHE (runtime/probe.py). False plans with the cache or, without one, with
# plausible defaults (plan/costs.py): the tests' setting, so their plans do not depend on
# the machine that runs them.
probe_rates: bool = True

# Remember which regions keep their activations, per graph, options, rates and megatrain
# source, under $MEGATRAIN_CACHE (compiler/decision_cache.py): a second process compiling
# the same graph skips the chooser's search. False chooses afresh at every compile.
decision_cache: bool = True

# Store each graph's plan beside AOTAutograd's cache entry (in Inductor's cache folder)
# and restore it where torch's cache answers, so a second process compiling the same graph
# skips tracing, planning and lowering (compiler/aot_cache.py). False compiles every graph
# afresh, asking only Inductor's FX graph cache (the tests' setting).
aot_cache: bool = True

# Warn when a graph's predicted step is at least this many times its GPU compute (about
# what a GPU-resident run takes), naming the regions the GPU waits for and why
# (plan/waits.py). None: never.
slow_plan_ratio: float | None = 1.5

# How the planner's liveness walk counts a graph Inductor lowers to GPU kernels: "inductor"
# leaves out the pointwise results Inductor computes inside their readers' kernels and
# never writes (compiler/op_costs.py `inlined`); "nodes" counts every node's result, as an
# eager run would allocate it (the walk before it knew; a diagnostic).
memory_walk: str = "inductor"


# -- decisions (the planner's, or today's fixed choice where it has none yet) -------------
# How each graph is lowered: "inductor" (Triton on GPU, C++ on CPU) or "eager" (the
# scheduled FX graphs run as they are: debugging, fast tests).
lowering: str = "inductor"
# The most regions fetched ahead of the one computing; the planner picks the fastest depth
# up to it that fits gpu_memory.
prefetch: int = 1
# megatrain's Triton kernels swapped in for their patterns (names of compiler.fusions.
# PATTERNS, True for all, False for none); None: the planner's choice, the fused
# linear-cross-entropy loss only where the budget needs it.
kernels = None
# Where megatrain.AdamW's updates run: "host", "auto" (the cost model per region),
# "device" (streamed state) or "resident" (state kept on the device where it fits, the
# cost model for the rest). None: the planner's choice, "resident" on a GPU (a resident
# region moves no bytes at all) and "host" on the CPU device (where "device" memory is
# host memory: keeping a second copy there saves nothing).
updates = None
# The order a lagging host optimizer gets the regions: "arrival", "host" (the next
# forward's fetch order, the rest deferred into it) or "device". None: the planner's
# choice, "host" on a GPU where some update runs on the host, else arrival.
backlog = None
# Boundary activations may wait in host memory between the passes where the plan needs it.
offload: bool = True
# Token-wise modules (an MLP: linears, activations, per-feature norms) run a chunk of the
# sequence at a time, their backward recomputing one chunk's forward (compiler/
# token_chunks.py): True wherever a module qualifies, False never. None: the planner's
# choice, only where the step does not fit gpu_memory and host_memory otherwise.
token_chunks = None
# Regions whose backward reads the matmul and attention outputs their forward saved instead
# of recomputing them (plan/keep.py): True every region that can, False none. None: the
# planner's choice by predicted step on a device whose rates are calibrated (CUDA), none
# elsewhere.
keep_activations = None
# Gradients to the host through a ring of 4 chunks of this many bytes, not region slabs.
grad_chunk = None
# The most host gradient slabs (None: two, more while the host lags and RAM allows).
grad_slabs = None
# Keep the forward's weights of the regions whose backward comes first, where they fit.
keep_weights: bool = False
# Stream bf16 weights from a page-locked copy megatrain.AdamW keeps current (bf16 only).
weight_shadow: bool = False

DECISIONS = ("lowering", "prefetch", "kernels", "updates", "backlog", "offload", "token_chunks",
             "keep_activations", "grad_chunk", "grad_slabs", "keep_weights", "weight_shadow")


def decisions() -> dict:
    """The decision knobs' current values, by name."""
    module = sys.modules[__name__]
    return {name: getattr(module, name) for name in DECISIONS}


@contextlib.contextmanager
def patch(**values):
    """Set module values for a block: `with megatrain.config.patch(check_fetched_weights=True):`."""
    module = sys.modules[__name__]
    unknown = [k for k in values if k not in _knobs()]
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
    return ["check_fetched_weights", "probe_rates", "decision_cache", "aot_cache", "slow_plan_ratio", "memory_walk",
            *DECISIONS]
