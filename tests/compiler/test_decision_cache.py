"""The kept-activations choice remembered across compiles (compiler/decision_cache.py): a
second compile of the same graph, in this process or another, plans the remembered pair
without searching; a changed budget searches again; a remembered choice that does not fit
falls back to recomputing; every one of them trains like eager."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import megatrain
from megatrain.compiler import decision_cache
from megatrain.compiler import keep as compiler_keep
from megatrain.compiler import rates as rates_mod
from megatrain.models import Llama, LlamaConfig

from .helpers import random_batches, rel, train_side_by_side
from .test_activation_offload import BUDGET as OFFLOAD_BUDGET
from .test_activation_offload import model as offload_model

REPO = Path(__file__).resolve().parents[2]
CFG = dict(vocab_size=96, hidden=48, layers=3, heads=4, kv_heads=2, ffn=96, rope_theta=10000.0)
BUDGET = 64 << 20


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """The chooser runs (the CPU counted as calibrated) with the cache on, in a fresh folder;
    `searches` counts the chooser's searches."""
    monkeypatch.setattr(rates_mod, "CALIBRATED", ("cuda", "cpu"))
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(megatrain.config, "decision_cache", True)
    searches = []
    real = compiler_keep._decide

    def counted(*args, **kwargs):
        searches.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler_keep, "_decide", counted)
    return tmp_path, searches


def _opts(gpu_memory=BUDGET, **extra):
    # host_memory given: its default follows the free RAM, which other tests move
    return {"device": "cpu", "precision": "fp32", "lowering": "eager", "gpu_memory": gpu_memory,
            "host_memory": "8GiB", **extra}


def _assert_like_eager(out):
    for a, b in zip(out["loss"], out["loss_ref"]):
        assert abs(a - b) <= 1e-5 * abs(b), (out["loss"], out["loss_ref"])
    assert rel(out["grads"], out["grads_ref"]) < 1e-5
    assert rel(out["params"], out["params_ref"]) < 1e-3


def _train(model, batches, options):
    torch._dynamo.reset()
    out = train_side_by_side(model, batches, options)
    _assert_like_eager(out)
    return out["plan"].graphs[0]


def test_a_second_compile_plans_the_remembered_choice_without_searching(cache):
    folder, searches = cache
    torch.manual_seed(0)
    model, batches = Llama(LlamaConfig(**CFG)), random_batches(96, 3, batch=2, seq=32)
    first = _train(model, batches, _opts())
    assert len(searches) == 1 and first.kept_regions, "the budget is generous: some region keeps"
    assert len(list((folder / "decisions").glob("keep-*.json"))) == 1
    again = _train(model, batches, _opts())
    assert len(searches) == 1, "the second compile searched again"
    assert again.kept_regions == first.kept_regions
    assert again.keep_choice == first.keep_choice   # explain's scores come back too
    _train(model, batches, _opts(gpu_memory=BUDGET // 2))   # another budget: another key
    assert len(searches) == 2


@pytest.mark.slow  # a compile more; the default run keeps the remembered and the changed-key cases
def test_an_unreadable_entry_is_chosen_afresh(cache):
    folder, searches = cache
    torch.manual_seed(0)
    model, batches = Llama(LlamaConfig(**CFG)), random_batches(96, 3, batch=2, seq=32)
    first = _train(model, batches, _opts())
    (entry,) = (folder / "decisions").glob("keep-*.json")
    entry.write_text("{not json")
    again = _train(model, batches, _opts())
    assert len(searches) == 2 and again.kept_regions == first.kept_regions


def test_a_remembered_choice_that_does_not_fit_recomputes(cache, monkeypatch):
    """A stale entry keeping every region, at a budget (no offload) that holds only the
    recomputing plan: the plan falls back to the recompute pair and trains like eager."""
    _, searches = cache
    torch.manual_seed(0)
    batches = random_batches(64, 3, batch=8, seq=64)
    monkeypatch.setattr(decision_cache, "load", lambda key: (frozenset(range(64)), None))
    g = _train(offload_model(), batches, {**_opts(OFFLOAD_BUDGET * 2), "offload": False})
    assert not g.kept_regions and not searches


@pytest.mark.slow  # test_warm_start.py's second process reads its key too
def test_the_key_is_the_same_in_another_process(cache):
    """The fingerprint names ops and callables, never addresses: a second Python process
    compiling the same model finds this one's entry (its chooser, replaced by an exit,
    never runs) and keeps the same regions."""
    folder, searches = cache
    torch.manual_seed(0)
    model, batches = Llama(LlamaConfig(**CFG)), random_batches(96, 3, batch=2, seq=32)
    first = _train(model, batches, _opts())
    assert len(searches) == 1
    script = textwrap.dedent(f"""
        import torch, megatrain
        from megatrain.compiler import keep, rates
        from megatrain.models import Llama, LlamaConfig
        from tests.compiler.helpers import compile_streamed, random_batches
        megatrain.config.probe_rates = False
        rates.CALIBRATED = ("cuda", "cpu")
        def searched(*a, **k):
            raise SystemExit("searched: the entry was not found")
        keep._decide = searched
        torch.manual_seed(0)
        model = Llama(LlamaConfig(**{CFG!r}))
        ids, labels = random_batches(96, 1, batch=2, seq=32)[0]
        step = compile_streamed(model, {_opts()!r})
        step(ids, labels=labels).backward()
        print("KEPT", sorted(megatrain.explain(step).graphs[0].kept_regions))
    """)
    env = {**os.environ, "MEGATRAIN_CACHE": str(folder), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"KEPT {sorted(first.kept_regions)}" in done.stdout


def test_the_fingerprint_sees_shapes_not_values():
    """Two traces of one model agree; other weights' values do not change it, another
    sequence length does."""
    from torch._functorch.aot_autograd import aot_module_simplified

    prints = []

    def backend(gm, inputs):
        def partition(joint, joint_inputs, **kwargs):
            from torch._functorch.partitioners import default_partition

            prints.append(decision_cache.graph_fingerprint(joint))
            return default_partition(joint, joint_inputs, **kwargs)

        return aot_module_simplified(gm, inputs, fw_compiler=lambda g, _: g, partition_fn=partition)

    for seed, seq in ((0, 16), (1, 16), (0, 24)):
        torch._dynamo.reset()
        torch.manual_seed(seed)
        model = Llama(LlamaConfig(**CFG))
        ids = torch.randint(0, 96, (2, seq))
        torch.compile(model, backend=backend)(ids, labels=ids).backward()
    assert prints[0] == prints[1] != prints[2]
