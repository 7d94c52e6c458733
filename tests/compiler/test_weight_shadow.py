"""Option weight_shadow: weights stream from a bf16 copy of each parameter that
megatrain.AdamW writes as it updates it (AdamW.keep_shadows, Streamer._shadow_spans),
instead of from the fp32 masters cast on the way. On the CPU device the fetched bf16
weights must be bitwise those of casting the masters, so training must equal the run
without shadows bitwise; a write that is not the optimizer's update must make the shadow
stale (the fetch reads the master) until the next update writes it again."""

from __future__ import annotations

import pytest
import torch

import megatrain
from megatrain.errors import MegatrainValueError
from megatrain.models import Llama
from megatrain.optim import functional

from .helpers import compile_streamed, SMALL_VOCAB, flat, random_batches, small_llama_config, train_megatrain


def options(shadow: bool, **more) -> dict:
    return {"device": "cpu", "precision": "bf16", "lowering": "eager", "weight_shadow": shadow, **more}


@pytest.mark.parametrize("more", [{}, {"grad_chunk": 8192},
                                  pytest.param({"backlog": "host"}, marks=pytest.mark.slow)],  # a third route
                         ids=["region slabs", "gradient ring (pieces)", "backlog"])
def test_shadowed_training_is_bitwise_the_masters_path(more, monkeypatch):
    """Every host update writes the shadows (whole parameters, pieces from the gradient
    ring, deferred updates), chunk by chunk: the chunk is made small so that parameters
    span several chunks and chunks span several parameters."""
    monkeypatch.setattr(functional, "UPCAST_CHUNK", 64 * 37)
    torch.manual_seed(0)
    model = Llama(small_llama_config(3))
    batches = random_batches(SMALL_VOCAB, 3, batch=2, seq=16)
    shadowed = train_megatrain(model, batches, options(True, **more))
    masters = train_megatrain(model, batches, options(False, **more))
    assert torch.equal(shadowed["params"], masters["params"]) and shadowed["losses"] == masters["losses"]
    paths = shadowed["plan"].streamer.last_stats.fetch_paths
    assert paths["shadow"] > 0 and paths["cpu"] == 0, dict(paths)  # every fetch, after step 1
    assert masters["plan"].streamer.last_stats.fetch_paths["shadow"] == 0


def test_regions_updated_on_the_device_get_no_shadow():
    """updates="device": a region's AdamW runs on the device and copies the master back,
    which would leave a shadow stale every step, so those regions get none and fetch their
    masters; training is bitwise the run without shadows."""
    torch.manual_seed(4)
    model = Llama(small_llama_config(2))
    batches = random_batches(SMALL_VOCAB, 3, batch=2, seq=16)
    shadowed = train_megatrain(model, batches, options(True, updates="device"))
    masters = train_megatrain(model, batches, options(False, updates="device"))
    assert torch.equal(shadowed["params"], masters["params"]) and shadowed["losses"] == masters["losses"]
    plan = shadowed["plan"]
    device_sites = {r for r, site in plan.update_sites.items() if site == "device"}
    assert device_sites, plan.update_sites
    opt = shadowed["opt"]
    names = dict(shadowed["model"].named_parameters())
    on_device = {fqn for r in plan.regions if r.id in device_sites for fqn in r.param_fqns}
    assert on_device and not any(opt.has_shadow(names[f]) for f in on_device)


def _step(step, opt, ids, labels) -> float:
    loss = step(ids, labels=labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_a_write_outside_the_optimizer_makes_the_shadow_stale():
    """Between steps the user halves one weight in place (no_grad: its version moves): the
    next forward must see the halved values, so it fetches that region from the master,
    like the run without shadows, bitwise; after that step's update the shadow is current
    again."""
    torch.manual_seed(1)
    model = Llama(small_llama_config(2))
    batches = random_batches(SMALL_VOCAB, 4, batch=2, seq=16)
    runs = {}
    for shadow in (True, False):
        torch._dynamo.reset()
        copy = Llama(small_llama_config(2))
        copy.load_state_dict(model.state_dict())
        opt = megatrain.AdamW(copy.parameters(), lr=3e-3, weight_decay=0.1)
        step = compile_streamed(copy, options(shadow))
        losses = [_step(step, opt, *b) for b in batches[:2]]
        opt.synchronize()
        with torch.no_grad():
            copy.layers[1].mlp.up_proj.weight.mul_(0.5)
        losses.append(_step(step, opt, *batches[2]))
        stats = megatrain.explain(step).graphs[0].streamer.last_stats
        losses.append(_step(step, opt, *batches[3]))
        opt.synchronize()
        runs[shadow] = (losses, flat(copy.parameters()), stats,
                        megatrain.explain(step).graphs[0].streamer.last_stats, opt, copy)
    (losses, params, stale_step, next_step, opt, copy), (ref_losses, ref_params, *_) = runs[True], runs[False]
    assert losses == ref_losses and torch.equal(params, ref_params)
    assert stale_step.fetch_paths["cpu"] >= 1  # the halved layer's region, from its master
    assert next_step.fetch_paths["cpu"] == 0  # rewritten by the update in between
    weight = copy.layers[1].mlp.up_proj.weight
    (shadow,) = opt.shadow_sources([weight])
    assert torch.equal(shadow, weight.detach().to(torch.bfloat16))


def test_an_update_that_skips_the_shadow_leaves_it_stale():
    """Defence in depth: an AdamW step that does not write the shadow (here the kernel
    called directly, which moves the step count but not the version counter) leaves it
    stale; a host update through submit() writes it and makes it current again."""
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(300, 7))
    opt = megatrain.AdamW([p], lr=1e-2)
    shadow = torch.empty(300, 7, dtype=torch.bfloat16)
    opt.keep_shadows([p], [shadow])
    assert opt.shadow_sources([p]) == [shadow] and torch.equal(shadow, p.detach().to(torch.bfloat16))
    opt.submit([p], [torch.randn(300, 7)]).result()
    opt.step()
    assert opt.shadow_sources([p]) == [shadow] and torch.equal(shadow, p.detach().to(torch.bfloat16))
    st = opt.state[p]
    functional.adamw_([p.detach()], [torch.randn(300, 7)], [st["exp_avg"]], [st["exp_avg_sq"]], [st["step"]],
                      lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
    assert p._version == 0 and opt.shadow_sources([p]) is None
    opt.submit([p], [torch.randn(300, 7)]).result()
    opt.step()
    assert opt.shadow_sources([p]) == [shadow] and torch.equal(shadow, p.detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"shaped \(300, 7\)"):
        opt.keep_shadows([p], [torch.empty(7, 300, dtype=torch.bfloat16).t()])


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_adamw_with_shadows_is_bitwise_adamw_and_casts(grad_dtype, monkeypatch):
    """functional.adamw_ with shadows: the parameters, moments and steps are bitwise those
    without, and each shadow is the cast of its updated parameter, across chunk edges and
    for a non-contiguous parameter (updated whole)."""
    monkeypatch.setattr(functional, "UPCAST_CHUNK", 64 * 5)
    g = torch.Generator().manual_seed(3)
    shapes = [(33, 17), (1000,), (64,), (9, 40)]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
    base = [torch.randn(s, generator=g) for s in shapes]
    base[3] = base[3].t().contiguous().t()  # non-contiguous
    grads = [torch.randn(s, generator=g).to(grad_dtype) for s in shapes]
    grads[3] = grads[3].t().contiguous().t()
    runs = []
    for with_shadows in (True, False):
        ps = [b.clone().t().contiguous().t() if not b.is_contiguous() else b.clone() for b in base]
        ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        steps = [torch.zeros(()) for _ in ps]
        shadows = [torch.empty(s, dtype=torch.bfloat16) for s in shapes] if with_shadows else None
        for _ in range(2):
            functional.adamw_(ps, grads, ms, vs, steps, shadows, **hyper)
        runs.append((ps, ms, vs, steps, shadows))
    (ps, ms, vs, steps, shadows), ref = runs
    for got, want in zip((ps, ms, vs, steps), ref[:4]):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(sh, p.to(torch.bfloat16)) for sh, p in zip(shadows, ps))


def test_weight_shadow_option_is_checked():
    model = Llama(small_llama_config(2))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(MegatrainValueError, match="weight_shadow='yes'"):
        compile_streamed(model, {"device": "cpu", "weight_shadow": "yes"})(ids)
    with pytest.raises(MegatrainValueError, match="weight_shadow=True with precision='fp32'"):
        compile_streamed(model, {"device": "cpu", "precision": "fp32", "weight_shadow": True})(ids)
