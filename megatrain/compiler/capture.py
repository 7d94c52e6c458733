"""Capture: find the parameters of a dynamo graph and re-home the graph onto the device.

In the torch-level graph dynamo hands the backend, every parameter is a placeholder (a real
CPU `nn.Parameter` in `example_inputs`). Re-homing rewrites the graph so AOTAutograd traces
it on the compute device while the user keeps everything on the CPU:

    param placeholder  -> megatrain::fetch(param, streamer, region, param_id), one per region
                          that uses it (a tied weight is fetched where needed; autograd sums
                          the gradient contributions)
    data placeholder   -> .to(device)          (mutated inputs are copied back at the end)
    device('cpu') args and device-less factory calls -> the compute device
    tensor outputs     -> .to('cpu')
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import MegatrainTypeError, MegatrainValueError, UnsupportedError
from ..optim.registry import owner_of
from . import ops
from .fx_match import fake_value
from .regions import Region, RegionMap, assign_regions

_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.rand,
              torch.randn, torch.randint, torch.randperm, torch.tensor, torch.linspace,
              torch.logspace, torch.eye, torch.scalar_tensor}
_SOURCE_KEY = re.compile(r"\.?_(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]")


@dataclass
class Capture:
    gm: fx.GraphModule
    params: list[torch.nn.Parameter]  # indexed by param_id
    fqns: list[str]
    regions: RegionMap
    region_params: dict[int, list[int]]  # region id -> param ids it fetches, in fetch order


def parameter_fqn(node: fx.Node) -> str:
    """'L['self']._modules['layers']._modules['0']._parameters['weight']' -> 'layers.0.weight'."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    name = source.name() if callable(getattr(source, "name", None)) else getattr(source, "name", None)
    if isinstance(name, str):
        keys = _SOURCE_KEY.findall(name)
        if keys:
            return ".".join(keys)
    return node.name


def source_line(node: fx.Node) -> str | None:
    """The innermost user source line of ``node``'s stack trace ('File "...", line N, in f')."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines()
             if ln.strip().startswith("File ")]
    return lines[-1] if lines else None


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top level>"
    from .regions import module_path

    entry = list(stack.values())[-1]
    return module_path(entry[0] if isinstance(entry, tuple) else str(entry)) or "<top level>"


def check_inputs(gm: fx.GraphModule, example_inputs) -> None:
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, x in zip(placeholders, example_inputs):
        if not isinstance(x, torch.Tensor):
            continue
        what = f"parameter {parameter_fqn(node)!r}" if isinstance(x, torch.nn.Parameter) else f"input {node.name!r}"
        if x.device.type != "cpu":
            raise MegatrainValueError(
                f"{what} is on {x.device}; megatrain streams from host memory: keep the model and "
                f"its inputs on the CPU (call model.cpu() and pass CPU tensors) and choose the compute "
                f"device with options={{'device': 'cuda'}}")
        if isinstance(x, torch.nn.Parameter):
            if not x.dtype.is_floating_point:
                raise MegatrainTypeError(
                    f"{what} has dtype {x.dtype}; megatrain streams floating-point parameters only: "
                    f"register it as a buffer instead")
            if x.layout != torch.strided:
                raise UnsupportedError(
                    f"{what} has layout {x.layout}; megatrain streams dense (strided) parameters only")


def _replace_device_constants(gm: fx.GraphModule, device: torch.device) -> None:
    """Every CPU device the user's graph names means "where the model lives": dynamo traced
    a CPU model with CPU inputs, so `x.to(h.device)`, `torch.arange(n, device=h.device)`
    and `.cpu()` were baked as the CPU (Hugging Face's rotary embedding moves `inv_freq` with
    `.to(x.device)`, its losses move labels with `.to(logits.device)`). On the compute device
    they must all mean the compute device, or the first op mixing them fails. Graph outputs
    go back to the host afterwards, explicitly (`rehome`)."""
    cpu = torch.device("cpu")

    def fix(a):
        if isinstance(a, torch.device) and a == cpu:
            return device
        if isinstance(a, str) and a == "cpu":
            return str(device)
        return a

    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if node.op == "call_method" and node.target == "cpu":
            node.target, node.kwargs = "to", {**node.kwargs, "device": device}
            continue
        node.args = fx.node.map_aggregate(node.args, fix)
        node.kwargs = fx.node.map_aggregate(node.kwargs, fix)
        if node.op == "call_function" and node.target in _FACTORIES and node.kwargs.get("device") is None:
            node.kwargs = {**node.kwargs, "device": device}


def _mutated_by(user: fx.Node, node: fx.Node) -> bool:
    """Whether `user` writes `node` in place (method `x.add_()`, `x[i] = v`, `x.copy_()`)."""
    if not user.args or user.args[0] is not node:
        return False
    if user.op == "call_method":
        return user.target.endswith("_") and not user.target.endswith("__")
    if user.op == "call_function":
        if user.target is operator.setitem:
            return True
        name = getattr(user.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__")
    return False


def _mutated(node: fx.Node) -> bool:
    return any(_mutated_by(user, node) for user in node.users)


def _drop_unchanging_casts(node: fx.Node, param: torch.nn.Parameter) -> None:
    """`module.to(dtype)` inside forward with the dtype the parameters already have (Hugging
    Face's Switch router casts its classifier to float32 on every call) traces as
    `p.set_(p.to(None, dtype, False))`: a write that changes nothing, since `.to` returns
    `p` itself. Erase it (with dynamo's version-counter fix-up) rather than refuse it."""
    for user in list(node.users):
        if not (user.op == "call_function" and user.target is torch.Tensor.set_ and len(user.args) == 2):
            continue
        cast = user.args[1]
        if not (isinstance(cast, fx.Node) and cast.op == "call_method" and cast.target == "to"
                and cast.args and cast.args[0] is node and len(cast.users) == 1):
            continue
        targets = [a for a in (*cast.args[1:], *cast.kwargs.values())
                   if isinstance(a, (torch.dtype, torch.device, str))]
        if any(a != param.dtype for a in targets if isinstance(a, torch.dtype)) \
                or any(torch.device(a) != param.device for a in targets if not isinstance(a, torch.dtype)):
            continue
        for fixup in list(user.users):
            if not fixup.users:
                fixup.graph.erase_node(fixup)
        if not user.users:
            user.graph.erase_node(user)
            cast.graph.erase_node(cast)


def _refuse_parameter_mutation(node: fx.Node, fqn: str) -> None:
    """A parameter written inside forward would only change the streamed device copy: the
    write would be lost silently. Refuse it, naming the op and the module."""
    for user in node.users:
        if _mutated_by(user, node):
            op = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", user.target)
            raise UnsupportedError(
                f"in-place {op!r} on parameter {fqn!r} inside forward (module {_module_of(user)}): "
                f"megatrain streams a copy of each weight, so the write would be lost; update "
                f"parameters outside the compiled forward (e.g. in the optimizer step or under "
                f"torch.no_grad() before calling the model)")


def _refuse_nested_compile_regions(graph: fx.Graph) -> None:
    """torch.compiler.nested_compile_region makes its function one opaque higher-order op
    (`invoke_subgraph`) that AOTAutograd partitions on its own: its weights could not be
    fetched per layer, nor its activations planned. Refuse it, naming where it is called."""
    invoke = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    if invoke is None:
        return
    for node in graph.find_nodes(op="call_function", target=invoke):
        raise UnsupportedError(
            f"torch.compiler.nested_compile_region (op {node.target}, module {_module_of(node)}, "
            f"called at {source_line(node) or '<unknown>'}): megatrain plans and streams the whole "
            f"graph layer by layer, and a nested region's body is one opaque op to it; remove the "
            f"decorator (megatrain compiles the model as one graph anyway)")


def rehome(gm: fx.GraphModule, example_inputs, device: torch.device, streamer_id: int) -> Capture:
    check_inputs(gm, example_inputs)
    _refuse_nested_compile_regions(gm.graph)
    graph = gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    region_map = assign_regions(graph, {n for n, x in zip(placeholders, example_inputs)
                                        if isinstance(x, torch.nn.Parameter)})
    params: list[torch.nn.Parameter] = []
    fqns: list[str] = []
    region_params: dict[int, list[int]] = {}
    last_placeholder = placeholders[-1] if placeholders else None
    writebacks: list[tuple[fx.Node, fx.Node]] = []
    order = {n: i for i, n in enumerate(graph.nodes)}

    for node, x in zip(placeholders, example_inputs):
        if isinstance(x, torch.nn.Parameter):
            _drop_unchanging_casts(node, x)
            _refuse_parameter_mutation(node, parameter_fqn(node))
            pid = len(params)
            params.append(x)
            fqns.append(parameter_fqn(node))
            by_region: dict[int, list[fx.Node]] = {}
            for user in list(node.users):
                r = region_map.of_node.get(user)
                if r is None:
                    continue
                by_region.setdefault(r, []).append(user)
            for r, users in by_region.items():
                first = min(users, key=order.__getitem__)
                with graph.inserting_before(first):
                    f = graph.call_function(ops.FETCH, (node, streamer_id, r, pid, owner_of(x) is not None))
                f.meta["nn_module_stack"] = dict(first.meta.get("nn_module_stack") or {})
                f.meta["custom"] = {"megatrain_region": r}
                region_map.of_node[f] = r
                for u in users:
                    u.replace_input_with(node, f)
                region_params.setdefault(r, []).append(pid)
        elif isinstance(x, torch.Tensor) and device.type != "cpu":
            with graph.inserting_after(last_placeholder):
                moved = graph.call_method("to", (node,), {"device": device})
            _carry_value(node, moved, device)
            users = [u for u in node.users if u is not moved]
            for u in users:
                u.replace_input_with(node, moved)
            if users:
                r = min((region_map.of_node[u] for u in users if u in region_map.of_node), default=None)
                if r is not None:
                    moved.meta["custom"] = {"megatrain_region": r}
                    region_map.of_node[moved] = r
            if _mutated(moved):
                writebacks.append((node, moved))

    for node, r in region_map.of_node.items():
        node.meta.setdefault("custom", {})["megatrain_region"] = r

    if device.type != "cpu":
        _replace_device_constants(gm, device)
        output = graph.find_nodes(op="output")[0]
        last_region = max(region_map.of_node.values(), default=None)
        with graph.inserting_before(output):
            for src, moved in writebacks:
                wb = graph.call_method("copy_", (src, moved))
                if last_region is not None:
                    wb.meta["custom"] = {"megatrain_region": last_region}

            def to_host(a):
                if isinstance(a, fx.Node) and isinstance(a.meta.get("example_value"), torch.Tensor) \
                        and a.op != "placeholder":
                    n = graph.call_method("to", (a,), {"device": torch.device("cpu")})
                    _carry_value(a, n, torch.device("cpu"))
                    if last_region is not None:
                        n.meta["custom"] = {"megatrain_region": last_region}
                    return n
                return a

            output.args = fx.node.map_arg(output.args, to_host)

    _fill_region_params(region_map.regions, region_params, params, fqns)
    graph.lint()
    gm.recompile()
    return Capture(gm, params, fqns, region_map, region_params)


def _carry_value(src: fx.Node, moved: fx.Node, device: torch.device) -> None:
    """Give a node moving `src` to `device` its fake value. AOTAutograd's cache refuses
    (bypasses) a graph where a method is called on a node without one: on a GPU every
    input is moved here, so without this no GPU graph was cached across processes."""
    value = fake_value("call_method", "to", (src,), {"device": device})
    if value is not None:
        moved.meta["example_value"] = value


def _fill_region_params(regions: list[Region], region_params, params, fqns) -> None:
    for r in regions:
        pids = region_params.get(r.id, [])
        r.param_fqns = [fqns[i] for i in pids]
        r.param_bytes = sum(params[i].numel() * params[i].element_size() for i in pids)
