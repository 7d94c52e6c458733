"""Lowering: compile a scheduled forward/backward graph for the compute device.

"inductor" hands the graph to Inductor's inner compiler (Triton kernels on GPU, C++ on
CPU); megatrain's transfer ops stay opaque extern calls in their FX order (reordering
passes that could move them are switched off). "eager" runs the scheduled FX graph as is.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import pathlib

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import make_boxed_func

_OPS_VERSION = "megatrain-ops-" + hashlib.sha256(
    (pathlib.Path(__file__).parent / "ops.py").read_bytes()).hexdigest()[:16]

# Inductor passes that reorder nodes would move prefetch/evict away from where the
# schedule put them; the schedule already decides memory, so they are off. Buffer reuse
# is off too: Inductor holds a freed buffer until a later one of the same size takes it,
# which can be regions later, so tensors outlive the last use the planner's liveness walk
# counts, and a step peaked above its plan (on CUDA and on the CPU alike;
# tests/compiler/test_memory_contract.py checks the plan holds). The caching allocator
# hands the freed block to the next allocation anyway.
INDUCTOR_PATCHES = {
    "reorder_for_peak_memory": False,
    "reorder_for_locality": False,
    "allow_buffer_reuse": False,
    # The backward hands gradients to the optimizer through an effectful op
    # (ops.grad_to_optimizer), which AOT autograd wraps in `with_effects`; Inductor's FX
    # graph cache refuses any graph holding that operator unless it is marked cacheable,
    # so every process recompiled the whole backward, which took most of a long first
    # step on CPU and GPU alike. Cached code calls the op by name with its ids as graph
    # constants (hashed into the key); the value below, a hash of the ops' module, also
    # enters the key, so changing the ops invalidates old entries.
    "unsafe_marked_cacheable_functions": {"torch.ops.higher_order.with_effects": _OPS_VERSION},
}


def joint_passes(lowering: str, device: torch.device):
    """Inductor's joint-graph passes, for the partition to run first, as Inductor's own
    partition function does (megatrain partitions the joint graph itself, so without this
    they never ran); None for eager lowering, which runs the graph as traced.

    The pass that matters: cross-entropy's backward builds its one-hot gradient by
    scattering into a [tokens, vocab] zeros tensor, which Inductor realises as a buffer in
    the loss's dtype (fp32 under bf16 autocast: 2 GiB at 16k tokens and vocab 32000, 16 GiB
    at 32k tokens and vocab 128256). The pass (`scatter_upon_const_tensor`) rewrites it as
    a pointwise `where(iota == label)` that fuses into its reader. Measured on the CPU
    (bf16, vocab 8192, 1024 tokens): step peak 52.2 -> 21.0 MB, losses bitwise equal.
    The node that replaces a match's output keeps its region tag (pattern replacement
    copies `meta["custom"]` to it); the partition gives the other new nodes theirs
    (partition.adopt_regions)."""
    if lowering != "inductor":
        return None
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    if not getattr(inductor_config, "use_joint_graph_passes", True):
        return None
    takes_device = "input_device" in inspect.signature(joint_graph_passes).parameters

    def run(joint: fx.GraphModule, joint_inputs) -> fx.GraphModule:
        from torch._guards import detect_fake_mode
        from torch._inductor.virtualized import V

        # Passes that build nodes read their fake mode from V, as under Inductor's compile
        # (replace_random's seed fusion does: a model with dropout needs it).
        # On CUDA, the graph's device is the current one while they run, as under Inductor
        # (pad_mm times matmuls on the current device).
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on_device, V.set_fake_mode(detect_fake_mode(joint_inputs)):
            out = joint_graph_passes(joint, input_device=device) if takes_device else joint_graph_passes(joint)
        return joint if out is None else out  # some torch versions edit in place, return None

    return run


def lower(gm: fx.GraphModule, example_inputs, lowering: str, is_backward: bool):
    if lowering == "eager":
        return _boxed(gm)
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner

    patches = {k: v for k, v in INDUCTOR_PATCHES.items() if hasattr(inductor_config, k)}
    with inductor_config.patch(patches):
        return compile_fx_inner(gm, example_inputs, is_backward=is_backward)


def _boxed(gm: fx.GraphModule):
    """The graph as a boxed callable that clears its argument list on entry, so each input
    dies at its last use in the graph, as under Inductor (make_boxed_func unpacks the list
    into a call, and the list keeps every input, saved activations included, alive until
    the graph returns)."""
    codegen = getattr(fx.graph, "_BoxedCodeGen", None)
    if codegen is None:  # an older torch: inputs live until the graph returns
        return make_boxed_func(gm.forward)
    gm.graph.set_codegen(codegen())
    gm.recompile()

    def run(args):
        return gm.forward(args)

    run._boxed_call = True
    return run
