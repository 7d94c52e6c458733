"""The Streamer's weight path on CUDA: fp32 pinned masters arrive as exact bf16 copies,
whether cast on the device (staging chunk) or on the host (fallback when the budget has
no room for the chunk), including regions larger than one chunk."""

from __future__ import annotations

import pytest
import torch

import megatrain
from megatrain.runtime import streamer as streamer_mod
from megatrain.memory.host_store import home_parameters, is_page_locked
from megatrain.memory.layout import FlatLayout
from ..compiler.helpers import compile_streamed

pytestmark = pytest.mark.gpu


def _region(shapes):
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    home_parameters(params, pin=True)
    return params


@pytest.mark.parametrize("chunk", [1000, 16 << 20])
@pytest.mark.parametrize("budget", [1 << 30, None])
def test_fetched_weights_equal_a_bf16_cast(monkeypatch, chunk, budget):
    monkeypatch.setattr(streamer_mod, "CAST_CHUNK", chunk)
    shapes = [(37, 129), (4099,), (3, 5, 7)]
    params = _region(shapes)
    numel = FlatLayout.of(shapes).numel
    # None: room for the region's bf16 buffer only, so the device chunk is refused.
    budget = budget or numel * 2
    s = streamer_mod.Streamer(torch.device("cuda"), torch.bfloat16, budget, params)
    for step in range(2):
        s.begin_step()
        s.prefetch(0, params)
        flat = s.wait(0, numel)
        views = FlatLayout.of(shapes).views(flat)
        for p, v in zip(params, views):
            assert torch.equal(v, p.detach().to("cuda", torch.bfloat16)), (step, p.shape)
        s.evict(0, flat)
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p))  # the next fetch must see the update
        torch.cuda.synchronize()
    assert (s._cast_chunk is not None) == (budget > numel * 2)
    assert dict(s.stats.fetch_paths) == {"device-cast" if budget > numel * 2 else "host-cast": 1}
    assert s.stats.transfer_stall_s() >= 0.0


def test_homed_masters_are_page_locked_without_power_of_two_rounding():
    # 3 MB + a bit: the pinned allocator would round this up to 4 MB.
    params = [torch.nn.Parameter(torch.randn(786_433)), torch.nn.Parameter(torch.randn(7))]
    buf = home_parameters(params, pin=True)
    # is_page_locked, not Tensor.is_pinned(): torch need not recognise registered memory
    assert is_page_locked(buf) and all(is_page_locked(p) for p in params)
    assert buf.untyped_storage().nbytes() <= buf.numel() * 4 + 2 * 4096
    del buf
    params.clear()  # the last user unregisters the pages; nothing to observe but no error
    torch.cuda.synchronize()


@pytest.mark.skipif(not hasattr(torch.cuda, "host_memory_stats"), reason="torch has no host_memory_stats")
def test_first_backward_gives_back_what_the_pinned_allocator_caches_unused(monkeypatch):
    """Blocks torch's pinned allocator caches but nobody uses (Inductor's autotuner leaves
    one, 1 GiB at 1.3B, in the first backward) go back to the system as soon as the first
    region's gradients have left, before the optimizer's moments grow (so they do not add
    to the host peak), not only when the backward ends; a pinned tensor still in use keeps
    its block and its bytes."""
    from megatrain.models import Llama, LlamaConfig

    kept = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8).pin_memory()
    expected = kept.clone()
    dropped = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    del dropped
    cached = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    assert cached >= (64 << 20) + (1 << 20), cached  # the dropped block is still held

    after_each_region = []
    release = streamer_mod.release_unused_pinned_blocks

    def watched():
        release()
        after_each_region.append(torch.cuda.host_memory_stats()["allocated_bytes.current"])

    monkeypatch.setattr(streamer_mod, "release_unused_pinned_blocks", watched)
    torch._dynamo.reset()
    cfg = LlamaConfig(vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=4, ffn=128)
    model = Llama(cfg)
    opt = megatrain.AdamW(model.parameters(), lr=1e-3)  # gradients leave region by region
    step = compile_streamed(model, {"device": "cuda", "lowering": "eager"})
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    step(ids, labels=ids).backward()
    opt.step()

    assert after_each_region, "no region handed gradients out"
    assert after_each_region[0] <= cached - (64 << 20), (cached, after_each_region)
    held = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    assert held <= cached - (64 << 20), (cached, held)
    assert torch.equal(kept, expected)


def test_shadowed_weights_are_the_masters_cast_and_train_alike_on_cuda():
    """Option weight_shadow on CUDA: after the first step every host fetch copies the
    page-locked bf16 shadows (path "shadow", no device cast), each fetched weight is
    bitwise the bf16 cast of its master, and training agrees with the fp32-master path
    like any two bf16 CUDA runs (test_backlog_cuda.py: a ulp of bf16 may differ, so the
    losses within 2e-2, the parameters not compared)."""
    from megatrain.optim import AdamW

    from .compare import assert_runs_agree, seeded_llama_and_batches
    from ..compiler.helpers import train_megatrain

    model, batches = seeded_llama_and_batches()
    options = {"device": "cuda", "precision": "bf16", "gpu_memory": "2GiB", "updates": "host"}
    shadowed = train_megatrain(model, batches, {**options, "weight_shadow": True})
    masters = train_megatrain(model, batches, options)
    paths = shadowed["plan"].streamer.last_stats.fetch_paths
    # every path named: "host-cast (pageable)" is where shadows that lost their page lock went
    assert paths["shadow"] > 0 and {k for k, n in paths.items() if n} <= {"shadow", "resident"}, dict(paths)
    opt = shadowed["opt"]
    assert isinstance(opt, AdamW)
    for p in shadowed["model"].parameters():
        (shadow,) = opt.shadow_sources([p]) or (None,)
        assert shadow is not None and is_page_locked(shadow)
        assert torch.equal(shadow, p.detach().to(torch.bfloat16))
    assert_runs_agree(model, [p.detach() for p in shadowed["model"].parameters()],
                      [p.detach() for p in masters["model"].parameters()], shadowed["losses"], masters["losses"],
                      loss_rtol=2e-2, compare_params=False)
