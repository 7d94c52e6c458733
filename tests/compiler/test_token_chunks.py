"""Token-wise modules run a chunk of tokens at a time (compiler/token_chunks.py, the op in
runtime/token_chunks.py): the pass swaps a model's MLPs and nothing that mixes tokens, the
op computes what its subgraph computes, and a step that fits gpu_memory only with chunks
gets them, trains like eager and stays within the plan."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import megatrain
from megatrain.compiler import token_chunks as pass_mod
from megatrain.models import Llama, LlamaConfig
from megatrain.runtime import token_chunks as op
from tests.compiler.helpers import compile_streamed, cpu_peak_bytes


def _own_llama(seq, ffn=256):
    cfg = LlamaConfig(vocab_size=128, hidden=32, layers=2, heads=4, kv_heads=2, ffn=ffn,
                      rope_theta=10000.0, max_seq=seq)
    return Llama(cfg), lambda m, ids, labels: m(ids, labels=labels)


def _hf_llama(seq, ffn=256):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=ffn, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model, lambda m, ids, labels: m(input_ids=ids, labels=labels).loss


# One sequence of this many tokens: four chunks of the pass's least chunk.
SEQ = 4 * pass_mod.MIN_CHUNK
BUILDS = pytest.mark.parametrize("build", [_own_llama, _hf_llama], ids=["own_llama", "hf_llama"])


def _swapped(model, loss_of, seq):
    """The subgraphs the pass swaps into dynamo's graph of one step of `model`."""
    found = []

    def backend(gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        params = {n for n, x in zip(placeholders, example_inputs) if isinstance(x, torch.nn.Parameter)}
        pass_mod.chunk_token_wise_modules(gm, params)
        found.extend(n.args for n in gm.graph.nodes if n.target is op.run_in_chunks)
        return gm

    torch._dynamo.reset()
    ids = torch.randint(0, 128, (1, seq))
    loss_of(torch.compile(model, backend=backend), ids, ids)
    torch._dynamo.reset()
    return found


@BUILDS
def test_the_pass_swaps_each_mlp_and_each_norms_readers_and_nothing_that_mixes_tokens(build):
    """Per layer, the MLP (wider than the hidden states) with the norm that feeds it alone,
    and the attention's norm (fp32 inside) with the q, k, v projections that read it, are
    swapped, whatever the model calls them; the final norm too. Attention itself (rows
    mix) is not."""
    model, loss_of = build(SEQ)
    found = _swapped(model, loss_of, SEQ)
    codes = {key: op._SUBGRAPHS[key].code for _, _, key, _ in found}
    assert not any("scaled_dot_product" in c for c in codes.values())
    mlps = [(params, chunk) for _, params, key, chunk in found if "silu" in codes[key]]
    qkv = [params for _, params, key, _ in found if "silu" not in codes[key] and len(params) == 4]
    assert len(mlps) == 2 and len(qkv) == 2, codes
    for params, chunk in mlps:  # the three projections and the norm that feeds them alone
        assert sorted(tuple(p.meta["example_value"].shape) for p in params) == [(32,), (32, 256)] + [(256, 32)] * 2
        assert pass_mod.MIN_CHUNK <= chunk < SEQ and chunk % pass_mod.MIN_CHUNK == 0
    for params in qkv:  # the norm and q (4 heads of 8), k and v (2 heads each)
        assert sorted(tuple(p.meta["example_value"].shape) for p in params) == [(16, 32)] * 2 + [(32,), (32, 32)]
    for x, params, key, chunk in found:
        assert "rsqrt" in codes[key]


def test_a_module_whose_rows_mix_is_not_swapped():
    """An MLP-shaped module with one op across tokens (a running sum over the sequence)
    is left as it is; the same module without it is swapped."""

    class Block(torch.nn.Module):
        def __init__(self, mix):
            super().__init__()
            self.mix = mix
            self.up, self.down = torch.nn.Linear(16, 64, bias=False), torch.nn.Linear(64, 16, bias=False)

        def forward(self, x):
            h = F.silu(self.up(x))
            if self.mix:
                h = h.cumsum(1)
            return self.down(h)

    class Net(torch.nn.Module):
        def __init__(self, mix):
            super().__init__()
            self.block = Block(mix)

        def forward(self, x, labels):
            return self.block(x).square().mean()

    x = torch.randn(1, 4096, 16)
    assert len(_swapped(Net(False), lambda m, ids, _: m(x, None), 4)) == 1
    assert _swapped(Net(True), lambda m, ids, _: m(x, None), 4) == []


def _mlp_subgraph(upcast: bool = True):
    """A norm feeding an MLP, returning the MLP's output and the normed states (two outputs,
    as a norm with the projections that read it has several)."""
    def mlp(x, wg, wu, wd, norm):
        h = x.float() if upcast else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
        return F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd), h

    return fx.symbolic_trace(mlp)


@pytest.mark.parametrize("trial", range(3))
def test_the_op_computes_its_subgraph_in_float64(trial):
    """Outputs and every gradient equal the subgraph run on all tokens at once (float64,
    fresh random sizes; a chunk that does not divide the tokens included)."""
    rng = random.Random(torch.seed())
    torch.manual_seed(rng.randrange(2**31))
    batch, tokens, hidden, ffn = rng.randint(1, 3), rng.randint(1, 300), rng.randint(2, 24), rng.randint(8, 64)
    chunk = rng.randint(1, tokens + 5)
    gm = _mlp_subgraph(upcast=False)
    key = op.register(gm)
    f64 = dict(dtype=torch.float64, requires_grad=True)
    x = torch.randn(batch, tokens, hidden, **f64)
    params = [torch.randn(ffn, hidden, **f64), torch.randn(ffn, hidden, **f64), torch.randn(hidden, ffn, **f64),
              torch.randn(hidden, **f64)]
    ys = op.token_chunks(x, params, key, chunk, None)
    refs = op.reference(gm, x, params)
    for y, ref in zip(ys, refs, strict=True):
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    both = trial != 0  # trial 0: the loss reads the first output only (the other's gradient is None)
    gs = [torch.randn_like(ref) for ref in refs[:2 if both else 1]]
    got = torch.autograd.grad(ys[:len(gs)], [x, *params], gs)
    want = torch.autograd.grad(refs[:len(gs)], [x, *params], gs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_the_op_passes_torch_library_checks():
    gm = _mlp_subgraph()
    key = op.register(gm)
    x = torch.randn(2, 37, 8, requires_grad=True)
    params = [torch.randn(20, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True),
              torch.randn(8, 20, requires_grad=True), torch.randn(8, requires_grad=True)]
    torch.library.opcheck(torch.ops.megatrain.token_chunks.default, (x, params, key, 10, None))


def _least_budget(build, seq, chunks: bool) -> int:
    from megatrain.plan.search import InfeasibleBudget

    model, loss_of = build(seq)
    ids, labels = torch.randint(0, 128, (1, seq)), torch.randint(0, 128, (1, seq))
    torch._dynamo.reset()
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                    "gpu_memory": 1 << 18, "token_chunks": chunks, "kernels": False})
    with pytest.raises(InfeasibleBudget) as info:
        loss_of(step, ids, labels)
    return info.value.min_budget


@BUILDS
def test_a_step_that_fits_only_with_chunks_gets_them_and_trains_like_eager(build):
    """A budget between the leanest plans with and without chunks: megatrain applies them
    itself, says so, plans within the budget, measures within the plan, and the loss and
    gradients match eager fp32 (1e-5); three AdamW steps keep the parameters within 1e-3."""
    seq = SEQ
    unchunked, chunked = _least_budget(build, seq, False), _least_budget(build, seq, True)
    assert chunked < unchunked
    budget = (chunked + unchunked) // 2
    torch.manual_seed(random.randint(0, 10**6))
    model, loss_of = build(seq)
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                    "gpu_memory": budget, "kernels": False})
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01) for m in (model, ref))
    for i in range(3):
        ids, labels = torch.randint(0, 128, (1, seq)), torch.randint(0, 128, (1, seq))
        out = {}

        def run():
            out["loss"] = loss_of(step, ids, labels)
            out["loss"].backward()

        if i == 1:  # a step after the compiling one, from a collected heap (cpu_peak_bytes)
            peak = cpu_peak_bytes(run)
        else:
            run()
        loss_ref = loss_of(ref, ids, labels)
        loss_ref.backward()
        assert abs(out["loss"].item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item())
        if i == 0:
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)
    plan = megatrain.explain(step)
    (graph,) = plan.graphs
    assert graph.token_chunks == 5 and graph.note.startswith("token chunks applied for memory"), graph.note
    assert str(unchunked) in graph.note
    assert plan.predicted_peak_bytes <= budget and peak <= plan.predicted_peak_bytes, \
        (peak, plan.predicted_peak_bytes, budget)


def test_no_chunks_where_the_step_fits():
    torch.manual_seed(0)
    model, loss_of = _own_llama(SEQ)
    torch._dynamo.reset()
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                    "gpu_memory": 1 << 30})
    ids = torch.randint(0, 128, (1, SEQ))
    loss_of(step, ids, ids).backward()
    graph = megatrain.explain(step).graphs[0]
    assert graph.token_chunks == 0 and graph.note == "" and "token_chunks" not in graph.code


def test_the_fused_loss_comes_first_then_chunks_beside_it():
    """A vocabulary wide enough that the loss region also binds: between the leanest plans
    with the fused loss alone and with chunks beside it, the backend applies both (the
    fused loss first: it costs nothing), says so, and trains like eager fp32."""
    from megatrain.plan.search import InfeasibleBudget

    seq, vocab = SEQ, 256
    cfg = LlamaConfig(vocab_size=vocab, hidden=32, layers=2, heads=4, kv_heads=2, ffn=256,
                      rope_theta=10000.0, max_seq=seq)
    ids, labels = torch.randint(0, vocab, (1, seq)), torch.randint(0, vocab, (1, seq))
    least = {}
    for chunks in (False, True):
        torch._dynamo.reset()
        step = compile_streamed(Llama(cfg), {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                             "gpu_memory": 1 << 18, "token_chunks": chunks,
                                             "kernels": ["linear_cross_entropy"]})
        with pytest.raises(InfeasibleBudget) as info:
            step(ids, labels=labels)
        least[chunks] = info.value.min_budget
    assert least[True] < least[False]
    torch.manual_seed(random.randint(0, 10**6))
    model = Llama(cfg)
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                    "gpu_memory": (least[True] + least[False]) // 2})
    loss = step(ids, labels=labels)
    loss.backward()
    loss_ref = ref(ids, labels=labels)
    loss_ref.backward()
    assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    graph = megatrain.explain(step).graphs[0]
    assert graph.kernels == ("linear_cross_entropy",) and graph.token_chunks > 0
    assert graph.note.startswith("token chunks and the fused linear-cross-entropy applied for memory"), graph.note
