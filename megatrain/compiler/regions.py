"""Regions: which layer every node of the torch-level graph belongs to.

A region is the unit of streaming: its weights are fetched together, its boundary
activations are the only ones saved for backward. Layers are the graph's repeated
structure, read from `node.meta["nn_module_stack"]` only (no model names; `LayerFinder`
has the rule): children of a ModuleList/Sequential (`layers.3`, `h.11`,
`encoder.layer.0`), each call of a module called several times (`blk@2`), or, in a graph
without indexed children, same-class siblings (ModuleDict values, `layer0..layer5`). A
higher-order op outside any layer (a checkpoint around a layer call) belongs, with its
outputs, to the layer its body does. Every maximal run of other nodes
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


@dataclass(frozen=True)
class _Call:
    """One call of one module, from an `nn_module_stack` entry: dynamo keys a module's
    n-th call in a graph (n >= 1) as '<module id>@n'."""

    module: str  # dynamo's key without the call suffix: the module's identity
    call: int
    path: str
    cls: str

    @property
    def name(self) -> str:
        return self.path if self.call == 0 else f"{self.path}@{self.call}"


def _calls(node: fx.Node) -> list[_Call]:
    """The module calls on `node`'s stack, outermost first."""
    out = []
    for key, entry in (node.meta.get("nn_module_stack") or {}).items():
        raw, cls = (entry if isinstance(entry, tuple) else (str(entry), ""))
        module, _, call = str(key).partition("@")
        out.append(_Call(module, int(call) if call.isdigit() else 0, module_path(raw), str(cls)))
    return out


class LayerFinder:
    """Which module calls of a graph are layers: the repeated structure, from the stacks
    alone (no model names). For a node: the outermost call on its stack that is a child of
    a ModuleList or Sequential (its path ends in an index: `layers.3`; a list looped twice
    gives `layers.3@1`); if none, the outermost call that is
      - of a module with weights called more than once in the graph (a block reused across
        depth: each call is its own region, `blk@2`), or
      - where the graph has neither indexed children nor reused modules, a member of the
        largest group of same-class siblings (ModuleDict values, attributes `layer0..5`).
    Siblings count only as the last resort so that glue such as two same-class embeddings
    (token and position) stays in the prologue beside real layers."""

    def __init__(self, graph: fx.Graph, weights: set[fx.Node] | None = None):
        calls = [c for g in _graphs(graph) for n in g.nodes for c in _calls(n)]
        # A module called more than once is weights shared across depth only if it has
        # weights: a parameterless Dropout or activation reused at two places is glue.
        weighted = None if weights is None else {
            c.module for n in graph.nodes if any(a in weights for a in n.all_input_nodes) for c in _calls(n)}
        self._reused = {c.module for c in calls if c.call > 0 and (weighted is None or c.module in weighted)}
        self._siblings: set[str] = set()
        if not self._reused and not any(_indexed(c) for c in calls):
            groups: dict[tuple[str, str], set[str]] = {}
            for c in calls:
                if c.path:
                    parent = c.path.rpartition(".")[0]
                    groups.setdefault((parent, c.cls), set()).add(c.module)
            largest = max((len(m) for m in groups.values()), default=0)
            if largest >= 2:
                self._siblings = set().union(*(m for m in groups.values() if len(m) == largest))

    def layer_of(self, node: fx.Node) -> str | None:
        """The region name of the layer call `node` belongs to, or None (outer glue)."""
        stack = _calls(node)
        for wanted in (_indexed, lambda c: c.module in self._reused or c.module in self._siblings):
            found = next((c for c in stack if wanted(c)), None)
            if found is not None:
                return found.name
        if node.op != "call_function":
            return None
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and node.args[0].op == "call_function":
            node = node.args[0]  # an output of a higher-order op, picked outside any module
        return self._body_layer(node)

    def _body_layer(self, node: fx.Node) -> str | None:
        """A higher-order op called outside any layer, e.g. torch.utils.checkpoint around a
        layer call in the model's top-level forward (dynamo's `tag_activation_checkpoint`,
        whose own stack is empty): the one layer its body's nodes belong to, if one."""
        layers: set[str | None] = set()
        for body in _bodies(node):
            layers |= {self.layer_of(n) for n in body.nodes if n.op == "call_function"}
        layers.discard(None)
        return layers.pop() if len(layers) == 1 else None


def _indexed(call: _Call) -> bool:
    return bool(call.path) and call.path.split(".")[-1].isdigit()


def _bodies(node: fx.Node) -> list[fx.Graph]:
    owner = node.graph.owning_module
    out = []
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            body = getattr(owner, arg.target, None)
            if isinstance(body, fx.GraphModule):
                out.append(body.graph)
    return out


def _graphs(graph: fx.Graph) -> list[fx.Graph]:
    """`graph` and the bodies of its higher-order ops, recursively."""
    out, todo = [], [graph]
    while todo:
        g = todo.pop()
        out.append(g)
        todo.extend(b for n in g.nodes if n.op == "call_function" for b in _bodies(n))
    return out


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


def assign_regions(graph: fx.Graph, weights: set[fx.Node] | None = None) -> RegionMap:
    """`weights`: the graph's parameter placeholders (None: every module counts as having
    weights)."""
    finder = LayerFinder(graph, weights)
    regions: list[Region] = []
    by_layer: dict[str, int] = {}
    of_node: dict[fx.Node, int] = {}
    outer: int | None = None
    last_layer: str | None = None
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        layer = finder.layer_of(node)
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
