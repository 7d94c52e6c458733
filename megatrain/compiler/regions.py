"""Regions: which layer every node of the torch-level graph belongs to.

A region is the unit of streaming: its weights are fetched together, its boundary
activations are the only ones saved for backward. Rule, from `node.meta["nn_module_stack"]`
only (no model names): the outermost module on a node's stack whose path ends in an index
(`layers.3`, `h.11`, `encoder.layer.0`) is a repeated child of a ModuleList/Sequential,
i.e. a layer; a higher-order op outside any layer (a checkpoint around a layer call)
belongs, with its outputs, to the layer its body does. Every maximal run of other nodes
between layers forms one outer region: "prologue" (embeddings, rotary tables),
"epilogue" (final norm, head, loss), or "between(<layer>)" for glue between two layers.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch.fx as fx

# The frame-local root: L['self'], L['model'], L['args'][0] (decorated forwards), L__self__.
_ROOT = re.compile(r"^(L\[['\"][^'\"]+['\"]\](\[\d+\])*|L__self__|self)\.?")
_MODULES = re.compile(r"(?:^|\.)_modules\[['\"]([^'\"]+)['\"]\]")
_INDEX = re.compile(r"\[(\d+)\]")
_GETATTR = re.compile(r"getattr\(([^,]+),\s*['\"](\w+)['\"]\)")


def module_path(raw: str) -> str:
    """'L['self']._modules['layers']._modules['0']' or "L['self'].layers[0]" -> 'layers.0'."""
    s = raw
    while _GETATTR.search(s):
        s = _GETATTR.sub(r"\1.\2", s)
    s = _ROOT.sub("", s)
    s = _MODULES.sub(r".\1", s)
    s = _INDEX.sub(r".\1", s)
    return s.strip(".")


def layer_of(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    for entry in stack.values():
        path = module_path(entry[0] if isinstance(entry, tuple) else str(entry))
        if path and path.split(".")[-1].isdigit():
            return path
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and node.args[0].op == "call_function":
        node = node.args[0]  # an output of a higher-order op, picked outside any module
    return _body_layer(node)


def _body_layer(node: fx.Node) -> str | None:
    """A higher-order op called outside any layer, e.g. torch.utils.checkpoint around a
    layer call in the model's top-level forward (dynamo's `tag_activation_checkpoint`,
    whose own stack is empty): the one layer its body's nodes belong to, if one."""
    owner = node.graph.owning_module
    layers: set[str] = set()
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            body = getattr(owner, arg.target, None)
            if isinstance(body, fx.GraphModule):
                layers |= {layer_of(n) for n in body.graph.nodes if n.op == "call_function"}
    layers.discard(None)
    return layers.pop() if len(layers) == 1 else None


@dataclass
class Region:
    id: int
    name: str
    kind: str  # "layer" or "outer"
    param_fqns: list[str] = field(default_factory=list)
    param_bytes: int = 0


@dataclass
class RegionMap:
    regions: list[Region]
    of_node: dict[fx.Node, int]

    def __len__(self) -> int:
        return len(self.regions)


def assign_regions(graph: fx.Graph) -> RegionMap:
    regions: list[Region] = []
    by_layer: dict[str, int] = {}
    of_node: dict[fx.Node, int] = {}
    outer: int | None = None
    last_layer: str | None = None
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        layer = layer_of(node)
        if layer is not None:
            if layer not in by_layer:
                by_layer[layer] = len(regions)
                regions.append(Region(len(regions), layer, "layer"))
            of_node[node] = by_layer[layer]
            outer, last_layer = None, layer
            continue
        if outer is None:
            name = "prologue" if last_layer is None else f"between({last_layer})"
            outer = len(regions)
            regions.append(Region(outer, name, "outer"))
        of_node[node] = outer
    # The run after the last layer is the epilogue.
    if regions and regions[-1].kind == "outer" and by_layer:
        regions[-1].name = "epilogue"
    return RegionMap(regions, of_node)
