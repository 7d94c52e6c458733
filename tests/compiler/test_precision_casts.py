"""precision="bf16" where the model casts an activation to a weight's dtype (weight_casts.py).

Dynamo traces the fp32 masters, so `x.to(w.dtype)` reaches megatrain as a cast to fp32,
while the weight arrives from `fetch` in bf16. Matmuls reconcile the two under the trace's
autocast and elementwise ops promote; an op that does neither (a custom op whose kernel
takes one dtype, as Hugging Face's grouped-matmul MoE experts fall back to when dynamo sees
fp32 weights) failed at run time with "expected m1 and m2 to have the same dtype". Such
casts now target the compute dtype; every other cast stays as traced.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from megatrain.compiler import backend

from .helpers import compile_streamed

STEPS = 3
GAP = 0.02  # the bf16 zoo's bound on the relative loss gap to eager bf16 autocast (tests/gpu)


@pytest.fixture
def retargeted(monkeypatch):
    """The ops whose cast the backend retargeted, per compiled graph."""
    seen: list[list[str]] = []
    real = backend.retarget_weight_casts

    def spy(gm, params, compute_dtype, *args, **kwargs):
        changed = real(gm, params, compute_dtype, *args, **kwargs)
        seen.append([str(n.target) for n in changed])
        for op in changed:   # each new cast carries its fake value (AOTAutograd's cache wants one)
            casts = [a for a in op.all_input_nodes if a.target in ("to", torch.Tensor.to)]
            assert casts and all(c.meta["example_value"].dtype == compute_dtype for c in casts), op
        return changed

    monkeypatch.setattr(backend, "retarget_weight_casts", spy)
    return seen


def _tracks_eager_autocast(model, inputs, options, loss_of=lambda out: out):
    """Train `model` STEPS steps through megatrain and a copy eagerly under bf16 autocast (both
    torch.optim.AdamW); the worst relative loss gap and the losses."""
    ref = copy.deepcopy(model)
    step = compile_streamed(model, {"device": "cpu", "precision": "bf16", "gpu_memory": "256MiB", **options})
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    worst, losses = 0.0, []
    for _ in range(STEPS):
        kw = inputs()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_ref = loss_of(ref(**kw))
        loss_ref.backward()
        loss = loss_of(step(**kw))
        loss.backward()
        assert torch.isfinite(loss), losses
        losses.append((loss.item(), loss_ref.item()))
        worst = max(worst, abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    return worst, losses


# --- a Hugging Face MoE ----------------------------------------------------------------------

def _qwen3_moe():
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    if not hasattr(transformers, "Qwen3MoeConfig"):
        pytest.skip("this transformers has no Qwen3-MoE")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, norm_topk_prob=True)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


@pytest.mark.parametrize("lowering", ["inductor", "eager"])
def test_moe_experts_train_in_bf16_like_eager_autocast(lowering):
    """Hugging Face's grouped-matmul experts, traced on fp32 masters, fall back to a custom op
    fed `x.to(w.dtype)`: it trains at bf16, under both lowerings, within the bf16 zoo's gap."""
    torch.manual_seed(0)
    model = _qwen3_moe()
    model.train()

    def tokens():
        ids = torch.randint(0, 256, (2, 12))
        return {"input_ids": ids, "labels": ids}

    worst, losses = _tracks_eager_autocast(model, tokens, {"lowering": lowering}, lambda out: out.loss)
    assert worst < GAP, losses


# --- the pattern, without transformers ------------------------------------------------------

@torch.library.custom_op("megatrain_test::one_dtype_mm", mutates_args=())
def one_dtype_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T by a kernel that takes one dtype (torch.mm refuses mixed ones)."""
    return torch.mm(x, w.t())


@one_dtype_mm.register_fake
def _(x, w):  # like many fakes, it does not check dtypes: the mismatch shows only at run time
    return x.new_empty(x.shape[0], w.shape[0])


def _one_dtype_mm_backward(ctx, grad):
    x, w = ctx.saved_tensors
    grad = grad.to(x.dtype)  # eager autocast may hand the fp32 output a bf16 gradient
    return torch.mm(grad, w), torch.mm(grad.t(), x)


one_dtype_mm.register_autograd(_one_dtype_mm_backward,
                               setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class _Block(torch.nn.Module):
    """An RMSNorm (`w * h.to(input dtype)`: an elementwise op meeting the weight, left as
    traced), a linear after `h.to(w.dtype)` (autocast reconciles it, left as traced) and the
    custom op after `h.to(w.dtype)` (nothing reconciles it: retargeted)."""

    def __init__(self, width: int, custom: bool):
        super().__init__()
        self.custom = custom
        self.norm = torch.nn.Parameter(torch.ones(width))
        self.up = torch.nn.Parameter(torch.randn(2 * width, width) / width ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(width, 2 * width) / (2 * width) ** 0.5)

    def forward(self, h):
        dtype = h.dtype
        x = h.to(torch.float32)
        x = self.norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        u = F.silu(F.linear(x.to(self.up.dtype), self.up))
        if self.custom:
            return h + one_dtype_mm(u.to(self.down.dtype), self.down)
        return h + F.linear(u.to(self.down.dtype), self.down)


class _Toy(torch.nn.Module):
    def __init__(self, custom: bool, width: int = 32, layers: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(64, width)
        self.blocks = torch.nn.ModuleList(_Block(width, custom) for _ in range(layers))
        self.head = torch.nn.Linear(width, 64, bias=False)

    def forward(self, ids, labels):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h.reshape(-1, h.shape[-1])).reshape(h.shape)
        return F.cross_entropy(self.head(h).flatten(0, 1).float(), labels.flatten())


def _toy_inputs():
    ids = torch.randint(0, 64, (2, 8))
    return {"ids": ids, "labels": ids}


def test_a_custom_op_fed_a_cast_to_the_weight_dtype_computes_in_bf16(retargeted):
    """The pattern alone: only the cast into the custom op changes, in every layer."""
    torch.manual_seed(0)
    worst, losses = _tracks_eager_autocast(_Toy(custom=True), _toy_inputs, {"lowering": "eager"})
    assert worst < GAP, losses
    # One cast per layer, at the custom op: the norm's and the linear's stay as traced.
    assert retargeted == [["megatrain_test.one_dtype_mm.default"] * 3], retargeted


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_casts_that_autocast_or_promotion_reconcile_stay_as_traced(precision, retargeted):
    """A dense block's casts (the norm's before an elementwise product, the linears' under
    autocast) keep their traced dtype at bf16, so its numerics are those of eager autocast;
    at fp32 the weights arrive in their host dtype and there is nothing to look at."""
    torch.manual_seed(0)
    model = _Toy(custom=False)
    step = compile_streamed(model, {"device": "cpu", "precision": precision, "lowering": "eager"})
    step(**_toy_inputs()).backward()
    assert retargeted == [[]]
