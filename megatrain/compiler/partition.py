"""megatrain's partition function: save region-boundary activations, recompute the rest,
except in the regions the plan keeps.

Every forward node of the joint graph is tagged for torch's partitioner
(`node.meta["recompute"]`, the selective-checkpointing policy):
    MUST_SAVE       an activation produced in one region and consumed in another (the
                    region's output, e.g. a layer's residual stream), or a random op's
                    output (recomputing it would draw a different mask);
    PREFER_SAVE     in a *kept* region, the output of a FLOP-bound op (matmul, attention)
                    computed from activations: saved if the backward reads it, so that
                    region's backward recomputes only the memory-bound ops between them
                    (norms, rotary, activations), never a matmul;
    MUST_RECOMPUTE  everything else: intermediates inside a region, every `fetch` (the
                    backward re-fetches the weight instead of keeping the device copy) and
                    everything derived from weights alone.
So in backward each region recomputes its forward with its weights resident once (or,
kept, only its cheap ops): the weights cross PCIe twice per step, and no weight-derived
tensor is ever saved. Which regions are kept is the plan's decision (compiler/keep.py):
their saved matmul outputs live on the device from their forward to their backward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from . import ops
from .op_costs import flops
from .sizes import tensor_nbytes


def region_of(node: fx.Node) -> int | None:
    if node.op == "call_function" and node.target is ops.FETCH:
        return node.args[2]
    custom = node.meta.get("custom") or {}
    return custom.get("megatrain_region")


def _is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.name.startswith("tangents")


def _is_sym(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _is_random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


@dataclass
class JointAnalysis:
    backward: set[fx.Node]
    data_dependent: set[fx.Node]  # depends on a non-parameter input (an activation)
    weight_dependent: set[fx.Node]  # depends on a fetched weight

    def weight_derived(self, node: fx.Node) -> bool:
        """Computed from weights alone (a fetch, w.t(), w.to(bf16), ...): never to be saved."""
        return node in self.weight_dependent and node not in self.data_dependent


def analyse(graph: fx.Graph) -> JointAnalysis:
    backward: set[fx.Node] = set()
    data: set[fx.Node] = set()
    weights: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if _is_tangent(node):
                backward.add(node)
            elif not node.users or not all(u.target is ops.FETCH for u in node.users):
                data.add(node)
            continue
        inputs = node.all_input_nodes
        if any(i in backward for i in inputs):
            backward.add(node)
        if node.target is not ops.FETCH and any(i in data for i in inputs):
            data.add(node)
        if node.target is ops.FETCH or any(i in weights for i in inputs):
            weights.add(node)
    return JointAnalysis(backward, data, weights)


def tag_for_region_checkpointing(graph: fx.Graph, kept: frozenset[int] = frozenset()) -> JointAnalysis:
    """Tag every forward node (module docstring); `kept`: the regions whose FLOP-bound
    outputs are saved rather than recomputed. Tags are rewritten each call, so one joint
    graph can be partitioned again with another kept set."""
    info = analyse(graph)
    for node in graph.nodes:
        if node.op != "call_function" or node in info.backward or _is_sym(node):
            continue
        if _is_random(node):
            policy = CheckpointPolicy.MUST_SAVE
        elif node.target is ops.FETCH or node not in info.data_dependent:
            policy = CheckpointPolicy.MUST_RECOMPUTE
        else:
            here = region_of(node)
            crosses = any(
                u.op == "call_function" and u not in info.backward and region_of(u) != here
                for u in node.users)
            if crosses:
                policy = CheckpointPolicy.MUST_SAVE
            elif here in kept and _flop_bound(node):
                policy = CheckpointPolicy.PREFER_SAVE
            else:
                policy = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["recompute"] = policy
    return info


def _flop_bound(node: fx.Node) -> bool:
    """A matmul or attention output (or one output of a multi-output attention op): what a
    kept region saves. Views of them are recomputed (free)."""
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and bool(flops(src))
    return bool(flops(node))


def kept_candidates(graph: fx.Graph) -> list[int]:
    """Regions that own a FLOP-bound forward node computed from activations: the ones
    keeping can spare a recompute, in forward order."""
    info = analyse(graph)
    seen: dict[int, None] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node in info.backward or node not in info.data_dependent:
            continue
        r = region_of(node)
        if r is not None and r not in seen and flops(node):
            seen[r] = None
    return list(seen)


def adopt_regions(graph: fx.Graph, known: set[fx.Node]) -> None:
    """Give a region to each node a rewrite added (not in `known`) without one.

    Pattern replacement copies the region tag (`meta["custom"]`) only to the node that
    replaces a match's output; the others come untagged, and an untagged node next to a
    tagged one looks like a region boundary to `tag_for_region_checkpointing`, which then
    saves both sides (a rewritten scaled softmax saved each layer's scores). Each new node
    takes the region of its earliest tagged reader (readers first: a chain of new nodes
    inherits from its end), else of the nearest tagged node before it: the run it sits in."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    new = {n: None for n in nodes if n.op == "call_function" and n not in known and region_of(n) is None}

    def tag(n: fx.Node, r: int) -> None:
        n.meta.setdefault("custom", {})["megatrain_region"] = r

    for n in reversed(new):
        readers = sorted((u for u in n.users if region_of(u) is not None), key=pos.__getitem__)
        if readers:
            tag(n, region_of(readers[0]))
    last = None
    for n in nodes:
        r = region_of(n)
        if r is None and n in new and last is not None:
            tag(n, last)
        elif r is not None:
            last = r


@dataclass
class SavedActivations:
    names: list[str] = field(default_factory=list)
    bytes: int = 0


def saved_activations(fw: fx.GraphModule, num_fwd_outputs: int) -> SavedActivations:
    out = fw.graph.find_nodes(op="output")[0]
    saved = SavedActivations()
    for node in out.args[0][num_fwd_outputs:]:
        if not isinstance(node, fx.Node):
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            saved.names.append(node.name)
            if node.op != "placeholder":
                saved.bytes += tensor_nbytes(val)
    return saved


def check_saved(fw: fx.GraphModule, num_fwd_outputs: int, info: JointAnalysis) -> None:
    derived = {n.name for n in info.weight_dependent if info.weight_derived(n)}
    out = fw.graph.find_nodes(op="output")[0]
    for node in out.args[0][num_fwd_outputs:]:
        if not isinstance(node, fx.Node) or node.op == "placeholder":
            continue
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if node.target is ops.FETCH or node.name in derived:
            raise AssertionError(
                f"megatrain partition saved weight-derived tensor {node.name} ({node.target}); "
                f"weights must be re-fetched in backward, never kept")


def make_partition_fn(on_partition=None, joint_passes=None):
    """A partition_fn for aot_module_simplified.

    `joint_passes(joint, joint_inputs) -> joint` rewrites the joint graph first (lower.joint_passes);
    `on_partition(split, candidates, joint) -> (fw, bw)` decides which regions to keep and
    schedules the two graphs: `split(kept)` partitions the joint graph with that kept set
    and returns (fw, bw, SavedActivations); `candidates()` lists the regions keeping can
    help (kept_candidates), a walk of the joint graph made only where a decision is due;
    `joint` is the joint graph itself (which keys a remembered decision).
    Without `on_partition` nothing is kept.
    """

    def partition(joint_module: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        from torch._functorch.partitioners import default_partition

        if joint_passes is not None:
            known = set(joint_module.graph.nodes)
            joint_module = joint_passes(joint_module, joint_inputs)
            adopt_regions(joint_module.graph, known)

        def split(kept: frozenset[int] = frozenset()):
            info = tag_for_region_checkpointing(joint_module.graph, frozenset(kept))
            fw, bw = default_partition(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                       **kwargs)
            check_saved(fw, num_fwd_outputs, info)
            return fw, bw, saved_activations(fw, num_fwd_outputs)

        if on_partition is None:
            return split()[:2]
        return on_partition(split, lambda: kept_candidates(joint_module.graph), joint_module)

    return partition
