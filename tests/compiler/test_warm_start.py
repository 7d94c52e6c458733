"""A second process compiling the same model gets AOTAutograd's cache hit and megatrain's
plan stored beside it (compiler/aot_cache.py): no joint trace, no planning, no lowering,
and it trains bitwise as the first process and as a compile without the cache. A changed
option, knob or streamer numbering is a miss, and so is a stored plan whose inputs no
longer hold or that is not the plan of the graphs torch loaded: each compiles afresh and
trains the same."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatrain.models import Llama

from .helpers import SMALL_VOCAB, small_llama_config

pytest.importorskip("torch._inductor")

REPO = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent("""
    import dataclasses, hashlib, json, sys, torch
    import megatrain
    from megatrain.compiler import aot_cache
    from megatrain.models import Llama
    from torch._dynamo.utils import counters
    from tests.compiler.helpers import SMALL_VOCAB, random_batches, small_llama_config

    args = json.loads(sys.argv[1])
    megatrain.config.probe_rates = False
    megatrain.config.decision_cache = False
    if args.get("calibrated"):   # the CPU planned as a GPU is: its probe, kernel timings, the keep choice
        from megatrain.compiler import rates
        rates.CALIBRATED = ("cuda", "cpu")
    if args.get("calibrated") or args.get("cuda"):   # the defaults a GPU compile runs with
        megatrain.config.probe_rates = megatrain.config.decision_cache = True
    megatrain.config.aot_cache = args.get("aot_cache", True)
    if args.get("refused"):   # torch's cache would bypass the graph
        aot_cache.torch_refuses = lambda gm: "a test's reason"
    if args.get("unmatched"):   # torch's entry is not the stored plan's graphs
        aot_cache._loaded_fx_keys = lambda compiled: ("another", "graph")
    if args.get("unrepeatable"):   # planning did something a later compile might not repeat
        from megatrain.compiler import keep
        from megatrain.plan import inputs as plan_inputs
        choose = keep.choose
        keep.choose = lambda *a, **k: (plan_inputs.note_unrepeatable("a test"), choose(*a, **k))[1]
    options = {"device": "cpu", "precision": "fp32", **args.get("options", {})}
    if args.get("other_first"):   # another model compiles first: streamer indices shift
        other = torch.compile(torch.nn.Linear(8, 8), backend="megatrain", options=options)
        other(torch.randn(2, 8)).sum().backward()
    torch.manual_seed(0)
    model = Llama(small_llama_config(layers=2))
    opt = megatrain.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    with megatrain.config.patch(**args.get("knobs", {})):
        step = torch.compile(model, backend="megatrain", options=options)
        losses = []
        for ids, labels in random_batches(SMALL_VOCAB, 3, 2, 16, torch.Generator().manual_seed(1)):
            loss = step(ids, labels=labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        planned = megatrain.explain(step).graphs   # the training graph
        with torch.no_grad():   # an inference graph, cached too
            losses.append(step(ids, labels=labels).item())
        planned += megatrain.explain(step).graphs   # the newest for these parameters
    opt.synchronize()
    assert len(planned) == 2 and planned[0] is not planned[1]
    graphs = []
    for g in planned:
        s = g.step_plan
        needs = sum(v for k, v in s.host_needs if not k.startswith("gradient slabs"))
        assert s.host_memory is None or s.gradients.host_slab_bytes == s.host_memory - needs
        s = dataclasses.replace(s, host_memory=None, gradients=dataclasses.replace(s.gradients, host_slab_bytes=None))
        graphs.append({"cached": g.cached, "step_plan": repr(s), "events": [g.forward_events, g.backward_events],
                       "code": g.code, "peak": g.predicted_peak_bytes, "saved": g.saved_activations,
                       "phases": sorted(g.compile_seconds)})
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    print(json.dumps({"aot": dict(counters["aot_autograd"]), "megatrain": dict(aot_cache.counters),
                      "losses": losses, "params": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
                      "graphs": graphs}))
""")


def _run(cache: Path, **args) -> dict:
    # One thread: Inductor's CPU embedding backward accumulates a token id's repeats in the
    # order its threads reach them, so with several the weights differ run to run in the
    # last bits, cache or none.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "MEGATRAIN_CACHE": str(cache / "mt"),
           "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two more processes; tests/gpu/test_warm_start_cuda.py holds the GPU's own
def test_a_calibrated_plan_is_restored_too(tmp_path):
    """Planned as on a GPU (the probe's rates, kernel timings, the kept-activations choice
    remembered in the decision cache): the second process still restores the plan."""
    first = _run(tmp_path, calibrated=True)
    assert first["megatrain"] == {"no entry": 2, "stored": 2}, first["megatrain"]
    second = _run(tmp_path, calibrated=True)
    assert second["megatrain"] == {"reused": 2}, second["megatrain"]
    assert second["aot"].get("autograd_cache_hit", 0) == 2, second["aot"]
    _trains_like(second, first)


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """One cold process (it fills the caches, Inductor's C++ kernels included, which the
    later processes share) and its result."""
    cache = tmp_path_factory.mktemp("warm-start")
    return cache, _run(cache)


def _trains_like(out: dict, ref: dict) -> None:
    assert out["losses"] == ref["losses"]
    assert out["params"] == ref["params"]


def _planned_afresh(out: dict) -> None:
    assert out["aot"].get("autograd_cache_hit", 0) == 0, out["aot"]
    assert out["megatrain"].get("reused", 0) == 0, out["megatrain"]
    assert all("planning" in g["phases"] and not g["cached"] for g in out["graphs"]), out["graphs"]


def test_a_second_process_restores_the_plan_and_trains_bitwise_the_same(cold):
    cache, first = cold
    assert first["aot"].get("autograd_cache_saved", 0) == 2, first["aot"]   # training and inference graphs
    assert first["megatrain"] == {"no entry": 2, "stored": 2}, first["megatrain"]
    second = _run(cache)
    assert second["aot"].get("autograd_cache_hit", 0) == 2, second["aot"]
    assert second["aot"].get("autograd_cache_miss", 0) == 0, second["aot"]
    assert second["megatrain"] == {"reused": 2}, second["megatrain"]
    for g in second["graphs"]:   # nothing traced, planned or lowered
        assert g["cached"] and not {"planning", "lowering"} & set(g["phases"]), g["phases"]
    for mine, theirs in zip(second["graphs"], first["graphs"]):
        for k in ("step_plan", "events", "code", "peak", "saved"):
            assert mine[k] == theirs[k], k
    _trains_like(second, first)
    without = _run(cache, aot_cache=False)   # planned afresh; Inductor's kernels from its cache
    assert without["aot"].get("autograd_cache_saved", 0) == 0 and without["megatrain"] == {"off": 2}
    _trains_like(without, first)


@pytest.mark.parametrize("change", [
    pytest.param({"options": {"gpu_memory": "3GiB"}}, marks=pytest.mark.slow),  # a key of ours, as the knob's
    pytest.param({"knobs": {"grad_slabs": 3}}, marks=pytest.mark.slow),  # keyed as options are
    pytest.param({"other_first": True}, marks=pytest.mark.slow),  # a part of torch's key, not ours
], ids=["gpu_memory", "knob", "streamer_numbering"])
def test_a_changed_option_knob_or_streamer_misses(cold, change):
    cache, first = cold
    out = _run(cache, **change)
    _planned_afresh(out)
    assert out["aot"].get("autograd_cache_miss", 0) >= 2, out["aot"]
    _trains_like(out, first)


def test_a_stored_plan_whose_inputs_no_longer_hold_is_not_used(cold, tmp_path):
    """The host room the plan was made for is gone (as if the free RAM fell): compiled
    afresh, without asking torch's cache, and trained the same."""
    cache, first = cold
    copy = tmp_path / "cache"
    subprocess.run(["cp", "-r", str(cache), str(copy)], check=True)
    for path in (copy / "megatrain").glob("plan-*.pkl"):
        entry = pickle.loads(path.read_bytes())
        entry.inputs.room_ceiling = -1
        path.write_bytes(pickle.dumps(entry))
    out = _run(copy)
    _planned_afresh(out)
    assert out["megatrain"].get("stale", 0) == 2, out["megatrain"]
    assert out["megatrain"].get("stale: host room", 0) == 2, out["megatrain"]
    _trains_like(out, first)


@pytest.mark.slow  # a guard against another configuration's entry under the same tag
def test_a_plan_not_of_the_loaded_graphs_is_not_used(cold):
    cache, first = cold
    out = _run(cache, unmatched=True)
    assert out["aot"].get("autograd_cache_hit", 0) == 2, out["aot"]
    assert out["megatrain"] == {"unmatched": 2}, out["megatrain"]
    assert all("planning" in g["phases"] and not g["cached"] for g in out["graphs"]), out["graphs"]
    _trains_like(out, first)


@pytest.mark.slow  # two more processes; a speed matter (no stale plan is ever used)
def test_a_plan_that_cannot_be_stored_leaves_no_entry_of_torch_either(cold):
    """Else every later process would load torch's entry only to compile afresh. Here the
    training graph's planning is marked unrepeatable; the inference graph's is not."""
    cache, first = cold
    once = _run(cache, unrepeatable=True, options={"gpu_memory": "2GiB"})
    assert once["aot"] == {"autograd_cache_miss": 2, "autograd_cache_saved": 1}, once["aot"]
    assert once["megatrain"] == {"no entry": 2, "stored": 1, "not stored: unrepeatable": 1}, once["megatrain"]
    again = _run(cache, unrepeatable=True, options={"gpu_memory": "2GiB"})
    assert again["aot"] == {"autograd_cache_miss": 1, "autograd_cache_hit": 1}, again["aot"]
    assert again["megatrain"] == {"no entry": 1, "reused": 1, "not stored: unrepeatable": 1}, again["megatrain"]
    training = again["graphs"][0]
    assert "planning" in training["phases"] and not training["cached"], training
    _trains_like(once, first)
    _trains_like(again, first)


def _captured_for(device: torch.device, model: torch.nn.Module, *inputs) -> torch.fx.GraphModule:
    """The graph capture.rehome makes of `model` for `device`. Only capture runs, never the
    graph, so a GPU's capture is made on the CPU too (dynamo's fake values need no GPU)."""
    from megatrain.compiler.capture import rehome

    captured = []

    def backend(gm, example_inputs):
        captured.append(rehome(gm, example_inputs, device, 0).gm)
        raise _Captured()

    with pytest.raises(Exception, match="_Captured"):
        torch.compile(model, backend=backend)(*inputs)
    return captured[0]


class _Captured(Exception):
    pass


def test_a_graph_captured_for_a_gpu_is_one_torchs_cache_keeps():
    """On a GPU capture moves each input to the device (and the outputs back); a moved node
    without its fake value made AOTAutograd's cache bypass every GPU graph, so no warm GPU
    process found an entry."""
    from megatrain.compiler.aot_cache import torch_refuses

    torch.manual_seed(0)
    ids = torch.randint(0, SMALL_VOCAB, (2, 16))
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        gm = _captured_for(device, Llama(small_llama_config(layers=2)), ids, ids)
        moved = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"
                 and "device" in n.kwargs]
        assert len(moved) >= (2 if device.type == "cuda" else 0), gm.code
        for n in moved:
            assert n.meta["example_value"].device == n.kwargs["device"], n
        assert torch_refuses(gm) is None, torch_refuses(gm)


def test_a_graph_torch_would_bypass_is_named():
    """A method called on a node with no fake value (a symbolic trace gives none) is what
    torch's cache bypasses; the counters name it instead of a silent miss."""
    from megatrain.compiler.aot_cache import torch_refuses

    gm = torch.fx.symbolic_trace(lambda x: x.relu().sum())
    assert "call_method" in (torch_refuses(gm) or ""), torch_refuses(gm)


def test_a_graph_torchs_cache_would_bypass_is_counted_and_compiles_without_it(cold):
    cache, first = cold
    out = _run(cache, refused=True)
    counted = out["megatrain"]
    assert counted.get("not stored: torch bypasses the graph: a test's reason") == 2, counted
    assert not {"reused", "stored"} & set(counted), counted
    assert not {"autograd_cache_saved", "autograd_cache_hit"} & set(out["aot"]), out["aot"]
    _trains_like(out, first)
