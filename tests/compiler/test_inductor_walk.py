"""Where Inductor lowers to GPU kernels the planner's liveness walk leaves out the
pointwise results Inductor computes inside their readers' loops and never writes
(op_costs.inlined), and holds their inputs until those readers run. The rule, on
hand-built graphs; then the contract it must keep: a step at a long sequence (the norms'
fp32 [S, hidden] chains, the MLP's elementwise ones), planned at the least budget it fits,
allocates no more than the plan under Inductor, on the CPU where the allocator can be
measured."""

from __future__ import annotations

import random

import pytest
import torch

import megatrain
from megatrain.compiler import fusions, op_costs
from megatrain.compiler.options import Options
from megatrain.errors import MegatrainValueError
from megatrain.models import Llama, LlamaConfig
from megatrain.plan.search import InfeasibleBudget
from tests.compiler.helpers import compile_streamed, cpu_peak_bytes
from tests.compiler.test_op_costs import _build
from tests.compiler.test_token_chunks import _hf_llama, _own_llama

aten = torch.ops.aten
prims = torch.ops.prims


def test_single_reader_chains_are_inlined_and_what_a_matmul_reads_is_written():
    t, h = random.randint(3, 40), random.randint(2, 30)
    names = {}

    def make(node, placeholder):
        x = placeholder("x", t, h)
        w = placeholder("w", h, h)
        up = node(aten.mul.Tensor, x, x)  # one pointwise reader: inlined
        more = node(aten.add.Tensor, up, x)  # read by the product: written
        prod = node(aten.mm.default, more, w)
        sq = node(aten.mul.Tensor, prod, prod)  # read by a reduction: inlined
        total = node(aten.sum.default, sq)  # a reduction: its result is written
        names.update(up=up, more=more, sq=sq, total=total, prod=prod)
        return [total]

    nodes = _build(make)
    owner = {n: 0 for n in nodes if n.op == "call_function"}
    inlined, reads_at = op_costs.inlined(nodes, owner)
    assert inlined == {names["up"], names["sq"]}
    # `up` reads x where `more` runs; `sq` reads the product where the sum runs
    assert reads_at[names["up"]] == nodes.index(names["more"])
    assert reads_at[names["sq"]] == nodes.index(names["total"])
    # what another unit reads, or what the caller says is written, is written
    owner[names["more"]] = 1
    assert names["up"] not in op_costs.inlined(nodes, owner)[0]
    owner[names["more"]] = 0
    assert names["sq"] not in op_costs.inlined(nodes, owner, {names["sq"]})[0]


@pytest.mark.parametrize("case", ["cheap", "many_reads", "transcendental"])
def test_a_result_several_kernels_read_is_inlined_only_when_cheap(case):
    """Shared by two readers, a cast is recomputed in each; one that reads five buffers,
    or on the CPU one that calls exp, is written once (Inductor's realize thresholds)."""
    t, h = random.randint(3, 40), random.randint(2, 30)
    names = {}

    def make(node, placeholder):
        xs = [placeholder(f"x{i}", t, h) for i in range(5)]
        if case == "cheap":
            shared = node(aten.mul.Tensor, xs[0], xs[1])
        elif case == "many_reads":
            shared = xs[0]
            for x in xs[1:]:
                shared = node(aten.add.Tensor, shared, x)  # each add one reader: inlined
        else:
            shared = node(aten.exp.default, xs[0])
        a = node(aten.sum.dim_IntList, shared, [1])
        b = node(aten.amax.default, shared, [0])
        names["shared"] = shared
        return [a, b]

    nodes = _build(make)
    owner = {n: 0 for n in nodes if n.op == "call_function"}
    assert (names["shared"] in op_costs.inlined(nodes, owner, cpu=True)[0]) == (case == "cheap")
    # Triton's kernels recompute a shared transcendental too
    assert (names["shared"] in op_costs.inlined(nodes, owner)[0]) == (case != "many_reads")


@pytest.mark.parametrize("buffers", [4, 5])
def test_scalar_constants_are_no_buffer_reads(buffers):
    """A result two reductions read is recomputed in each while its expression reads at most
    four buffers; tensors made from scalars alone (a loss's one-hot scale, its ignore value)
    are constants inside the expression, not reads (Inductor's num_reads)."""
    t, h = random.randint(3, 40), random.randint(2, 30)
    names = {}

    def make(node, placeholder):
        xs = [placeholder(f"x{i}", t, h) for i in range(buffers)]
        shared = node(aten.where.self, node(aten.gt.Scalar, xs[0], 0.0), node(aten.scalar_tensor.default, -1.0),
                      node(aten.scalar_tensor.default, 0.0))
        for x in xs[1:]:
            shared = node(aten.mul.Tensor, shared, x)
        names["shared"] = shared
        return [node(aten.sum.dim_IntList, shared, [1]), node(aten.amax.default, shared, [0])]

    nodes = _build(make)
    owner = {n: 0 for n in nodes if n.op == "call_function"}
    assert (names["shared"] in op_costs.inlined(nodes, owner)[0]) == (buffers <= 4)


@pytest.mark.parametrize("case", ["dies_here", "read_later", "sibling", "transposed", "other_dtype", "graph_input"])
def test_a_pointwise_result_takes_the_buffer_of_an_input_that_dies_in_its_kernel(case):
    """Inductor writes a pointwise kernel's result over an input the kernel is the last to
    read, when dtype and size match and the kernel reads it element for element (a loss's
    gradient over its recomputed logits): that input's buffer serves both. Not where a later
    node still reads the input, where it is read transposed, where the dtypes differ, nor
    into a graph input, nor where a sibling kernel (one the result does not depend on) also
    reads it, through a node Inductor computes inside that kernel: the two may be fused
    into one kernel, which then keeps the input."""
    t, v = random.randint(3, 40), random.randint(41, 90)
    names = {}

    def make(node, placeholder):
        x, w = placeholder("x", t, t), placeholder("w", t, v)
        if case == "graph_input":
            logits = read = placeholder("logits", t, v)
        elif case == "transposed":
            logits = node(aten.mm.default, node(aten.t.default, w), x)  # [v, t]
            read = node(aten.t.default, logits)
        else:
            logits = read = node(aten.mm.default, x, w)
        outs = []
        if case == "sibling":  # computed in both kernels: the gradient's and one before it
            read = node(aten.mul.Tensor, logits, 2.0)
            outs.append(node(aten.mm.default, node(aten.add.Tensor, read, 1.0), node(aten.t.default, w)))
        scaled = node(aten.mul.Tensor, read, 0.5)  # inlined into its one reader
        dtype = torch.bfloat16 if case == "other_dtype" else torch.float32
        grad = node(prims.convert_element_type.default, scaled, dtype)
        names.update(logits=logits, grad=grad)
        # a matmul reads the gradient: it is written (a reduction's read would inline it)
        outs.append(node(aten.mm.default, grad, node(prims.convert_element_type.default, node(aten.t.default, w), dtype)))
        if case == "read_later":
            outs.append(node(aten.sum.default, logits))
        return outs

    nodes = _build(make)
    owner = {n: 0 for n in nodes if n.op == "call_function"}
    inlined, reads_at = op_costs.inlined(nodes, owner)
    end = len(nodes)
    last = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[op_costs._source(a)] = max(last.get(op_costs._source(a), -1),
                                           end if n.op == "output" else reads_at.get(n, i))
    reuses = op_costs.inplace_reuses(nodes, owner, inlined, last)
    assert (reuses.get(names["grad"]) is names["logits"]) == (case == "dies_here"), (case, reuses)


def _least_budget(build, seq, walk):
    model, loss_of = build(seq, ffn=128)
    ids = torch.randint(0, 128, (1, seq))
    torch._dynamo.reset()
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "gpu_memory": 1 << 16,
                                    "kernels": False, "token_chunks": False})
    with megatrain.config.patch(memory_walk=walk), pytest.raises(InfeasibleBudget) as info:
        loss_of(step, ids, ids)
    return info.value.min_budget


@pytest.mark.parametrize("build", [_own_llama, pytest.param(_hf_llama, marks=pytest.mark.slow)],
                         ids=["own_llama", "hf_llama"])  # the same walk: the default run takes one
def test_a_long_step_planned_for_fused_kernels_measures_within_the_inductor_walk(build, monkeypatch):
    """Planned as for Inductor's GPU kernels (the walk leaves out what Inductor never
    writes and pads each region with its largest transient), a long step plans leaner than
    under the node-by-node walk, and run at the least budget the walk allows, Inductor's CPU
    step allocates no more than the plan. fp32: the CPU's bf16 kernels allocate scratch of
    their own that the walk does not model (a GPU's do not), so the CPU can referee only
    fp32; the GPU tests check bf16."""
    monkeypatch.setattr(Options, "fused_lowering", property(lambda self: self.lowering == "inductor"))
    seq = random.choice([1024, 1536, 2048])
    walk, nodes = _least_budget(build, seq, "inductor"), _least_budget(build, seq, "nodes")
    assert walk < nodes, (walk, nodes)
    torch.manual_seed(random.randint(0, 10**6))
    model, loss_of = build(seq, ffn=128)
    torch._dynamo.reset()
    budget = walk + walk // 50
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "gpu_memory": budget,
                                    "kernels": False, "token_chunks": False})
    ids, labels = torch.randint(0, 128, (1, seq)), torch.randint(0, 128, (1, seq))

    def run():
        loss_of(step, ids, labels).backward()

    run()  # compiles; the next step is measured
    model.zero_grad(set_to_none=True)
    peak = cpu_peak_bytes(run)
    plan = megatrain.explain(step)
    assert peak <= plan.predicted_peak_bytes <= budget, (peak, plan.predicted_peak_bytes, budget)


def test_an_unknown_memory_walk_is_refused_with_the_fix():
    opts = Options(device=torch.device("cuda"), gpu_memory=1 << 30)
    with megatrain.config.patch(memory_walk="fused"), pytest.raises(MegatrainValueError, match="nodes"):
        opts.inductor_walk


def test_a_loss_backward_planned_for_fused_kernels_holds_one_logits_buffer(monkeypatch):
    """A vocabulary much wider than the model, so the step peaks in the loss's backward:
    its gradient is written over the logits the backward recomputed (Inductor's in-place
    reuse), so the plan counts one [tokens, vocab] buffer there, not two, and Inductor's
    CPU step, run at the least budget that plan allows, still allocates no more than it.
    The bound below which the backend compiles the fused loss without trying the plain
    one (fusions.unfused_logits_bytes for Inductor's kernels) stays under what was measured."""
    monkeypatch.setattr(Options, "fused_lowering", property(lambda self: self.lowering == "inductor"))
    seq, vocab = random.choice([512, 768, 1024]), random.choice([4096, 6144, 8192])
    cfg = LlamaConfig(vocab_size=vocab, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, rope_theta=10000.0,
                      max_seq=seq)
    ids, labels = torch.randint(0, vocab, (1, seq)), torch.randint(0, vocab, (1, seq))

    def compiled(budget):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Llama(cfg)
        return compile_streamed(model, {"device": "cpu", "precision": "fp32", "gpu_memory": budget,
                                        "kernels": False, "token_chunks": False})

    with pytest.raises(InfeasibleBudget) as info:
        compiled(vocab * 32 * 4 + (1 << 16))(ids, labels=labels)  # the head's weights and no more
    budget = info.value.min_budget + info.value.min_budget // 50
    step = compiled(budget)

    def run():
        step(ids, labels=labels).backward()

    run()  # compiles; the next step is measured
    peak = cpu_peak_bytes(run)
    plan = megatrain.explain(step)
    logits = seq * vocab * 4
    assert peak <= plan.predicted_peak_bytes <= budget, (peak, plan.predicted_peak_bytes, budget)
    assert plan.predicted_peak_bytes < peak + logits, (peak, plan.predicted_peak_bytes, logits)

    bounds = []

    def bound_of(gm, example_inputs):
        bounds.append(fusions.unfused_logits_bytes(gm, torch.float32, inductor=True))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Llama(cfg), backend=bound_of)(ids, labels=labels)
    assert bounds == [logits] and logits <= peak, (bounds, logits, peak)
