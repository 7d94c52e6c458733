"""`torch.compile(model, backend="megatrain")`: the pipeline, stage by stage.

    options -> capture (re-home onto the device, fetch per region; a cast to a weight's
    host dtype that no op reconciles with the compute-dtype weight targets the compute
    dtype: weight_casts.py) -> AOTAutograd with Inductor's joint-graph passes and the
    region-checkpointing partition -> the planner's schedule of the graph pair (device
    budget proven, validated) -> its FX transfer nodes -> lowering (Inductor) -> runtime.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import warnings
import weakref

import torch
from torch._dynamo.backends.common import aot_autograd  # noqa: F401  (keeps dynamo's registry warm)
from torch._functorch.aot_autograd import aot_module_simplified

from .. import config
from ..errors import MegatrainValueError, format_bytes, noting
from ..optim import engine, module_reads
from ..optim.registry import owner_of
from ..runtime import streamer as streamer_mod
from ..memory.host_store import home_parameters
from . import explain as explain_mod
from . import aot_cache, decide, decision_cache, keep, loss_choice, outputs, rates
from . import token_chunks as token_chunks_mod
from .capture import check_inputs, rehome, source_line
from .lower import joint_passes, lower
from .options import Options, parse_options
from .partition import make_partition_fn
from .passes import gradient_handoffs, insert_transfers
from .phases import phase
from .plan import GraphPlan
from ..plan.search import InfeasibleBudget, OffloadRoomExceeded
from ..plan.waits import slow_plan_warning
from .schedule import schedule_step
from .weight_casts import retarget_weight_casts

_seen_breaks: collections.Counter = collections.Counter()  # break reason -> count warned of


def _graph_end(gm: torch.fx.GraphModule) -> str:
    """The user source line of the graph's last op: where dynamo stopped this graph."""
    return next(filter(None, map(source_line, reversed(gm.graph.nodes))), "<unknown>")


# Graph-break reasons (dynamo's gb_type, the start of its counter key) for which a user
# can do better than accept the break, and what to do.
_BREAK_HINTS = {
    "HOP: Unsafe side effect": (
        "the model's own activation checkpointing (torch.utils.checkpoint) wraps code with a "
        "Python side effect, so dynamo cannot trace it; megatrain already recomputes every layer "
        "in the backward, so turn the model's checkpointing off (Hugging Face: "
        "model.gradient_checkpointing_disable()), or accept that the side effect is not replayed "
        "in the recompute: torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True"),
    "logging.Logger method": (
        "a logging call inside the model: add it to torch._dynamo.config.ignore_logging_functions"),
}


def _hints(reasons) -> str:
    """The known fixes for these graph-break reasons, as a sentence each."""
    found = [hint for key, hint in _BREAK_HINTS.items() if any(str(r).startswith(key) for r in reasons)]
    return "".join(f". To remove it: {h}" for h in found)


def _warn_graph_breaks(gm: torch.fx.GraphModule) -> None:
    """Dynamo records why it split the frame before it calls us for the first piece: warn
    with the reasons counted since the last warning (and their known fixes)."""
    from torch._dynamo.utils import counters

    # A break at top level lands in "graph_break"; one inside a loop makes dynamo skip the
    # frame and compile its callees, recorded under "unimplemented".
    counts = collections.Counter()
    for kind in ("unimplemented", "graph_break"):
        counts.update(counters.get(kind, {}))
    if any(_seen_breaks[k] > counts[k] for k in _seen_breaks):
        _seen_breaks.clear()  # counters were reset (torch._dynamo.reset())
    new = [k for k in counts if counts[k] > _seen_breaks[k]]
    if new:
        reasons = "; ".join(str(r).splitlines()[0] for r in new[-3:])
        warnings.warn(
            f"megatrain: the model has a graph break ({reasons}); this graph ends at {_graph_end(gm)}. "
            f"Each graph streams on its own and trains correctly, but transfers do not overlap "
            f"across the break{_hints(new)}", stacklevel=2)
    _seen_breaks.clear()
    _seen_breaks.update(counts)


def _check_region_budget(regions, params, region_params, opts: Options) -> None:
    from ..memory.layout import FlatLayout

    itemsize = opts.compute_dtype.itemsize
    worst = None
    for r in regions:
        pids = region_params.get(r.id, [])
        if not pids:
            continue
        need = FlatLayout.of([params[i].shape for i in pids]).numel * itemsize
        if worst is None or need > worst[0]:
            worst = (need, r.name)
    if worst is not None and worst[0] > opts.gpu_memory:
        raise MegatrainValueError(
            f"gpu_memory={opts.gpu_memory} bytes ({format_bytes(opts.gpu_memory)}) cannot hold even one "
            f"region: region {worst[1]!r} needs {worst[0]} bytes ({format_bytes(worst[0])}) of "
            f"{opts.precision} weights alone; give gpu_memory of at least {worst[0]} bytes plus "
            f"activations")


# id -> first parameter of each model warned about (weak: a collected model's id is free again)
_warned_without_layers: "weakref.WeakValueDictionary[int, torch.nn.Parameter]" = weakref.WeakValueDictionary()


def _without_layers(cap) -> str:
    """For a graph with weights but no repeated structure (it streams as one piece): a
    sentence naming the module that holds the most bytes; "" for a graph with layers."""
    if not cap.params or any(r.kind == "layer" for r in cap.regions.regions):
        return ""
    by_module: collections.Counter = collections.Counter()
    for fqn, p in zip(cap.fqns, cap.params):
        by_module[fqn.rpartition(".")[0] or "<top level>"] += p.numel() * p.element_size()
    module, nbytes = by_module.most_common(1)[0]
    return (f"this graph has no repeated structure (no ModuleList, Sequential or ModuleDict of blocks, "
            f"no same-class sibling modules, no module called more than once), so its "
            f"{format_bytes(sum(by_module.values()))} of weights stream as one piece and gpu_memory must "
            f"hold them all at once; module {module!r} holds the most ({format_bytes(nbytes)}). To stream "
            f"below that, hold the model's blocks in an nn.ModuleList (or call one block several times)")


def _parameter_placeholders(gm: torch.fx.GraphModule, example_inputs) -> set[torch.fx.Node]:
    """The placeholders of dynamo's graph that are the model's parameters."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {n for n, x in zip(placeholders, example_inputs) if isinstance(x, torch.nn.Parameter)}


def _split_by_a_break(gm: torch.fx.GraphModule) -> bool:
    """Whether dynamo made `gm` from part of a frame: it ends at a graph break, or it is
    the resumed rest of a frame after one (dynamo's `torch_dynamo_resume_in_...`)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and reason.graph_break:
        return True
    return any("torch_dynamo_resume_in_" in (n.meta.get("stack_trace") or "") for n in gm.graph.nodes)


def _warn_without_layers(cap, note: str, piece: bool) -> None:
    """Warn once per model (keyed by its first parameter); not for the pieces of a model
    split by graph breaks (one layer's graph has no repeated structure, and streams fine)."""
    first = cap.params[0] if cap.params else None
    if note and not piece and _warned_without_layers.get(id(first)) is not first:
        _warned_without_layers[id(first)] = first
        warnings.warn(f"megatrain: {note}", stacklevel=4)


def _share_cores(params, opts: Options) -> None:
    """Streaming on a GPU, the host optimizer shares the cores and host memory bandwidth
    with the copies, the launch thread and autograd: fewer threads than cores update
    faster there (bench/train.py --optim-threads sweeps it). So an optimizer whose threads
    the user left unset gets `engine.streaming_threads`, the count the probe times the host
    update at."""
    if opts.device.type != "cuda":
        return
    threads = engine.streaming_threads(opts.device.type)
    owners = {id(o): o for o in map(owner_of, params) if o is not None}
    for opt in owners.values():
        opt.prefer_threads(threads)


def megatrain_backend(gm: torch.fx.GraphModule, example_inputs, options=None, **kwargs):
    opts = parse_options({**(options or {}), **kwargs})
    _warn_graph_breaks(gm)
    check_inputs(gm, example_inputs)
    times: dict[str, float] = {}   # the graph's compile phases (phases.py), kept by its plan
    with phase("probe", times):
        rates.measure_once(opts.device)
    with phase("capture", times):
        return _backend(gm, example_inputs, opts, times)


def _backend(gm, example_inputs, opts: Options, times: dict[str, float]):
    params = [x for x in example_inputs if isinstance(x, torch.nn.Parameter)]
    streamer = streamer_mod.Streamer(opts.device, opts.compute_dtype, opts.gpu_memory, params,
                                     grad_slabs=opts.grad_slabs)
    sid = streamer_mod.register(streamer)
    dropped = outputs.drop_non_scalar_outputs(gm) if opts.outputs == "loss" else None
    fuse, chunk = _may_fuse_loss(gm, opts), opts.token_chunks is None
    loss_key = _fused_loss_key(gm, opts) if fuse else None
    first = _why_fused_first(gm, opts, loss_key) if fuse else None
    if first is not None:  # the fused loss comes first: no plain plan is tried
        compiled, plan, cap = _compile_for_memory(gm, example_inputs, opts, streamer, sid, first,
                                                  times, fuse, chunk)
    else:
        # Capture edits dynamo's graph in place: a retry starts from an untouched copy.
        retry = _pristine_copy(gm) if fuse or chunk else None
        try:
            compiled, plan, cap = _compile(gm, example_inputs, opts, streamer, sid, opts.kernels or (),
                                           times, token_chunks=opts.token_chunks is True, weigh_fused_loss=fuse)
        except (InfeasibleBudget, OffloadRoomExceeded, loss_choice.FusedLossFaster) as first:
            if retry is None:
                raise
            if isinstance(first, loss_choice.FusedLossFaster) and loss_key is not None:
                decision_cache.store_fused_loss(loss_key, first.plain_s, first.fused_s)
            compiled, plan, cap = _compile_for_memory(retry, example_inputs, opts, streamer, sid, first,
                                                      times, fuse, chunk)
    # Homing moves parameter storage (new storage offsets), so it runs after tracing: the
    # traced graph does not depend on where the host bytes sit, only the copies do.
    with phase("homing", times):
        for r in cap.regions.regions:
            own = [cap.params[i] for i in cap.region_params.get(r.id, [])]
            home_parameters(own, pin=opts.device.type == "cuda")
    # The optimizer may hold newer values than the host parameters (queued or resident
    # updates): reading the model through state_dict() makes them current first.
    module_reads.keep_state_dict_current(cap.params)
    if streamer.device_updates is not None and opts.device.type == "cuda":
        streamer.device_updates.prepare()  # page-lock their moments now, not in a backward
    explain_mod.record(plan)
    return compiled if dropped is None else outputs.with_stand_ins(compiled, dropped)


_FUSED_LOSS = ("linear_cross_entropy",)


def _logits_alone(gm: torch.fx.GraphModule, opts: Options) -> "_LogitsAlone | None":
    """Why no plan of `gm` without the fused loss can fit gpu_memory, where the logits it
    must hold at once alone exceed it (fusions.unfused_logits_bytes, as the planner's walk
    counts them: Inductor's kernels hold one buffer); else None."""
    from . import fusions  # imports the Triton kernels: only when a graph is compiled

    inductor = opts.inductor_walk
    logits = fusions.unfused_logits_bytes(gm, opts.compute_dtype, inductor=inductor)
    if logits <= opts.gpu_memory:
        return None
    what = "the logits Inductor holds at once" if inductor else "the logits and their gradient alone"
    return _LogitsAlone(f"{what} take {logits} bytes ({format_bytes(logits)}) "
                        f"> gpu_memory={opts.gpu_memory} bytes ({format_bytes(opts.gpu_memory)})")


def _why_fused_first(gm: torch.fx.GraphModule, opts: Options, loss_key: str | None) -> Exception | None:
    """Why the fused linear-cross-entropy is compiled without a plain attempt first, or
    None: the logits alone overflow gpu_memory (_logits_alone), or an earlier compile of
    this graph found the step faster with it (loss_choice, remembered under `loss_key`)."""
    alone = _logits_alone(gm, opts)
    if alone is not None or loss_key is None:
        return alone
    remembered = decision_cache.load_fused_loss(loss_key)
    return None if remembered is None else loss_choice.FusedLossFaster(*remembered, remembered=True)


def _fused_loss_key(gm: torch.fx.GraphModule, opts: Options) -> str | None:
    """The decision cache's key of dynamo's graph `gm` (before capture edits it), where the
    cache is on and the device calibrated (the choice is the cost model's); else None."""
    if not (config.decision_cache and rates.calibrated(opts.device)):
        return None
    return decision_cache.key(decision_cache.graph_fingerprint(gm), opts)


def _may_fuse_loss(gm: torch.fx.GraphModule, opts: Options) -> bool:
    """The fused linear-cross-entropy is megatrain's to choose only when the user left
    `kernels` unset (an explicit value, even False, is kept exactly), the graph has the
    pattern, and the kernels can run on the device."""
    from . import fusions  # imports the Triton kernels: only when a graph is compiled

    return opts.kernels is None and fusions.has_linear_cross_entropy(gm) \
        and fusions.kernels_run_on(opts.device)


def _pristine_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of dynamo's graph that capture's in-place edits of `gm` do not reach (node metas
    are copied shallowly: their fake values are shared and never mutated)."""
    fresh = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    fresh.meta = dict(gm.meta)
    return fresh


def _compile_for_memory(gm, example_inputs, opts: Options, streamer, sid, first: Exception,
                        times: dict[str, float], fuse: bool, chunk: bool):
    """The step did not fit, or the fused loss comes first (`first`, the reason): plan `gm`
    (a pristine copy where a plain attempt edited the original) with what saves memory, the
    cheaper first. The fused linear-cross-entropy never materialises the [tokens, vocab]
    logits, their fp32 upcast and their gradient, and is about as fast as Inductor's code
    (fusions.DEFAULT's comment); token chunks keep one chunk of an MLP's intermediates at a
    time, for one more forward of the MLP in the backward, and are used only where the step
    fits no other way. Raises the last attempt's error, saying what was already applied."""
    error, applied = first, []
    if fuse:
        try:
            result = _compile(_pristine_copy(gm) if chunk else gm, example_inputs, opts, streamer, sid,
                              _FUSED_LOSS, times, token_chunks=opts.token_chunks is True)
            return _noted(result, first, "fused linear-cross-entropy", opts)
        except (InfeasibleBudget, OffloadRoomExceeded) as e:
            if not chunk:
                raise _already(e, ["the fused linear-cross-entropy loss"], first) from None
            error = e
        applied.append("the fused linear-cross-entropy loss")
    try:
        result = _compile(gm, example_inputs, opts, streamer, sid, _FUSED_LOSS if fuse else (opts.kernels or ()),
                          times, token_chunks=True, only_if_chunked=True)
    except _NothingToChunk:
        raise (_already(error, applied, first) if applied else error) from None
    except (InfeasibleBudget, OffloadRoomExceeded) as e:
        applied.append("token chunks (one chunk of each MLP's intermediates at a time)")
        raise _already(e, applied, first) from None
    # chunks are for memory even where the fused loss came first for speed: its plan did not fit
    why = error if isinstance(first, loss_choice.FusedLossFaster) else first
    return _noted(result, why, "token chunks" + (" and the fused linear-cross-entropy" if fuse else ""), opts,
                  several=fuse)


class _NothingToChunk(Exception):
    """No module of the graph is token-wise and wide enough to gain from chunks."""


class _LogitsAlone(Exception):
    """The step cannot fit without the fused loss: its logits alone exceed gpu_memory
    (_logits_alone), so no plan without it is tried."""


def _already(e: Exception, applied: list[str], first: Exception) -> Exception:
    """`e` again, saying what was applied and what the step needed without it."""
    without = ""
    if isinstance(first, InfeasibleBudget) and first is not e:
        without = f"; without it the step needs {first.min_budget} bytes ({format_bytes(first.min_budget)})"
    elif isinstance(first, _LogitsAlone):
        without = f"; without it {first}"
    message = f"{e} (this is with {' and '.join(applied)} already applied{without})"
    if isinstance(e, InfeasibleBudget):
        return InfeasibleBudget(message, e.min_budget)
    return type(e)(message)


def _noted(result, first: Exception, what: str, opts: Options, several: bool = False):
    """`result` with the plan's note saying `what` (`several` things) was applied for memory,
    and why."""
    compiled, plan, cap = result
    it = "them" if several else "it"
    if isinstance(first, loss_choice.FusedLossFaster):
        plan.note = (f"{what} applied for speed: {first}; with {it} the plan peaks at "
                     f"{plan.predicted_peak_bytes} bytes ({format_bytes(plan.predicted_peak_bytes)}). "
                     f"megatrain.config.kernels = False keeps the plain loss")
        return compiled, plan, cap
    need = (f"the leanest schedule peaks at {first.min_budget} bytes ({format_bytes(first.min_budget)}) "
            f"> gpu_memory={opts.gpu_memory} bytes ({format_bytes(opts.gpu_memory)})"
            if isinstance(first, InfeasibleBudget) else str(first))
    plan.note = (
        f"{what} applied for memory: without {it} {need}; with {it} the plan peaks at "
        f"{plan.predicted_peak_bytes} bytes ({format_bytes(plan.predicted_peak_bytes)}). Not for speed: "
        f"megatrain applies {it} only where the step does not fit otherwise")
    return compiled, plan, cap


def _compile(gm, example_inputs, opts: Options, streamer, sid, kernels: tuple[str, ...],
             times: dict[str, float], token_chunks: bool = False, only_if_chunked: bool = False,
             weigh_fused_loss: bool = False):
    """One attempt at the whole pipeline for `gm` (edited in place) with `kernels` swapped in,
    and with `token_chunks` its token-wise modules (compiler/token_chunks.py; with
    `only_if_chunked`, _NothingToChunk where none qualifies): (compiled callable, its
    GraphPlan, the capture). Raises InfeasibleBudget from the planner; with
    `weigh_fused_loss`, loss_choice.FusedLossFaster where the fused loss would make the
    step predicted faster than its plain one.
    Each phase's wall time goes into `times` (phases.py), which the plan keeps."""
    applied = ()
    if kernels:
        from . import fusions

        counts = fusions.replace_kernel_patterns(gm, kernels)
        applied = tuple(name for name, n in counts.items() if n)
    chunked = token_chunks_mod.chunk_token_wise_modules(gm, _parameter_placeholders(gm, example_inputs)) \
        if token_chunks else 0
    if only_if_chunked and not chunked:
        raise _NothingToChunk()
    piece = _split_by_a_break(gm)
    pending = loss_choice.pending_head(gm, opts.compute_dtype, opts.inductor_walk) if weigh_fused_loss else None
    cap = rehome(gm, example_inputs, opts.device, sid)
    head = loss_choice.head_of(pending)
    retarget_weight_casts(cap.gm, cap.params, opts.compute_dtype, cap.regions.of_node)
    streamer.region_names = {r.id: r.name for r in cap.regions.regions}
    no_layers = _without_layers(cap)
    _warn_without_layers(cap, no_layers, piece)
    with noting(no_layers):
        _check_region_budget(cap.regions.regions, cap.params, cap.region_params, opts)

    plan = GraphPlan(regions=cap.regions.regions, budget=opts.gpu_memory, streamer=streamer,
                     kernels=applied, compile_seconds=times, token_chunks=chunked)
    cache = aot_cache.GraphCache.open(cap, opts, sid)   # None where off
    planning = cache.planning if cache is not None else contextlib.nullcontext
    lowering = cache.lowering if cache is not None else contextlib.nullcontext
    planned = []   # the partition or the inference compiler ran: torch's cache did not answer

    def transfers(fw, bw, problem=None):
        """Plan the pair (bw None: forward only), then materialise exactly that plan."""
        sched = schedule_step(fw, bw, cap.params, opts.device, opts.compute_dtype, opts.gpu_memory,
                              opts.prefetch, opts.offload,
                              fused=opts.fused_lowering, inductor=opts.inductor_walk,
                              keep_weights=opts.keep_weights, region_names=streamer.region_names,
                              param_names=cap.fqns, problem=problem,
                              offload_room=decide.offload_room(cap, opts, training=bw is not None))
        f = insert_transfers(fw, "forward", sid, sched.forward, sched.forward_fetches, opts.device,
                             opts.compute_dtype, sched.offloaded)
        plan.schedule, plan.forward_events, plan.prefetch_count = sched, f.events, f.prefetch_count
        if bw is not None:
            b = insert_transfers(bw, "backward", sid, sched.backward, sched.backward_fetches, opts.device,
                                 opts.compute_dtype, sched.offloaded)
            plan.backward_events, plan.prefetch_count = b.events, f.prefetch_count + b.prefetch_count

    def on_partition(split, candidates_of, joint):
        planned.append("partition")
        with phase("planning", times), planning():
            chosen, recompute_pair, plan.keep_choice = keep.choose(split, candidates_of, cap, opts,
                                                                   streamer, joint, head)
            choice = plan.keep_choice
            if head is not None and choice is not None \
                    and loss_choice.fused_is_faster(choice.step_s, choice.fused_loss_step_s):
                raise loss_choice.FusedLossFaster(choice.step_s, choice.fused_loss_step_s)
            try:
                step = plan_pair(chosen)
            except (InfeasibleBudget, OffloadRoomExceeded) as e:
                if not chosen.kept:
                    raise
                if opts.keep_activations is not None:  # forced: say that it did not happen
                    budget = "gpu_memory" if isinstance(e, InfeasibleBudget) else "host_memory"
                    warnings.warn(f"megatrain: keep_activations={opts.keep_activations!r} does not fit "
                                  f"{budget} ({e}); every region recomputes its forward",
                                  RuntimeWarning, stacklevel=2)
                chosen = recompute_pair()  # the mix was an estimate: the real kept graphs did not fit
                step = plan_pair(chosen)
            configure(step)
            _warn_if_slow(plan, opts, streamer.region_names)
        return chosen.fw, chosen.bw

    def plan_pair(chosen):
        """Schedule the pair `chosen` (transfer nodes in its graphs) and decide the rest:
        its StepPlan, or InfeasibleBudget / OffloadRoomExceeded where a budget cannot hold
        it."""
        transfers(chosen.fw, chosen.bw, chosen.problem)
        plan.saved_activations, plan.saved_activation_bytes = chosen.saved.names, chosen.saved.bytes
        handoffs = gradient_handoffs(chosen.bw) if chosen.bw is not None else []
        if handoffs:
            _share_cores(cap.params, opts)
        return decide.step_plan(plan, cap, opts, streamer, handoffs,
                                training=chosen.bw is not None, kept=chosen.kept)

    def configure(step):
        """The one way decisions reach the runtime (and explain)."""
        plan.record(step)
        streamer.configure(step)

    def fw_compiler(fx_gm, inputs):
        plan.forward_code = fx_gm.code
        with phase("lowering", times), lowering():   # its first op begins the step (ops.begin_step)
            compiled = lower(fx_gm, inputs, opts.lowering, is_backward=False)
        if cache is not None:
            cache.lowered_forward(compiled)
        return compiled

    def bw_compiler(fx_gm, inputs):
        plan.backward_code = fx_gm.code
        with phase("lowering", times), lowering():   # maybe at the first backward, after the backend returned
            compiled = lower(fx_gm, inputs, opts.lowering, is_backward=True)
        if cache is not None:
            cache.lowered(plan, compiled)   # the plan is whole once both graphs are lowered
        return compiled

    def inference_compiler(fx_gm, inputs):
        planned.append("inference")
        with phase("planning", times), planning():
            transfers(fx_gm, None)
            configure(decide.step_plan(plan, cap, opts, streamer, (), training=False))
        compiled = fw_compiler(fx_gm, inputs)
        if cache is not None:
            cache.lowered(plan, compiled, training=False)
        return compiled

    def aot(asked: bool):
        """AOTAutograd on the capture; `asked`: through torch's cache (aot_cache.py)."""
        wrap = cache.compiler if asked else (lambda fn: fn)
        with cache.asking() if asked else contextlib.nullcontext():
            return aot_module_simplified(
                cap.gm, example_inputs,
                fw_compiler=wrap(fw_compiler), bw_compiler=wrap(bw_compiler),
                inference_compiler=wrap(inference_compiler),
                partition_fn=make_partition_fn(on_partition, joint_passes(opts.lowering, opts.device)),
                decompositions=_decompositions(),
                keep_inference_input_mutations=True)

    autocast = (torch.autocast(opts.device.type, dtype=torch.bfloat16) if opts.precision == "bf16"
                else contextlib.nullcontext())
    with autocast, noting(no_layers), phase("aot", times):
        asked = cache is not None and cache.ask
        compiled = aot(asked)
        if asked and not planned:   # torch's cache answered: restore the plan stored beside it
            entry = cache.hit(compiled)
            if entry is not None:
                configure(aot_cache.restore(entry, plan, opts))
                if plan.step_plan.handoffs:   # as plan_pair did when it planned them
                    _share_cores(cap.params, opts)
            else:   # no plan known to be its graphs': compile afresh, storing nothing
                cache.forgo()
                compiled = aot(False)
    return compiled, plan, cap


def _warn_if_slow(plan: GraphPlan, opts: Options, names: dict[int, str]) -> None:
    """Warn when the plan, with the update sites in effect, predicts a step much slower than
    its GPU compute, naming what the GPU waits for (plan/waits.py)."""
    ratio = config.slow_plan_ratio
    sched = plan.predicted_schedule
    if ratio is None or sched is None or not rates.calibrated(opts.device):
        return
    text = slow_plan_warning(sched, ratio, names)
    if text is not None:
        warnings.warn(f"megatrain: {text}", RuntimeWarning, stacklevel=2)


def _decompositions():
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()
