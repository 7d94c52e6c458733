"""A second process compiling the same model reuses Inductor's FX graph cache for the
forward and the backward, and trains the same (lower.INDUCTOR_PATCHES marks the backward's
effectful gradient hand-off cacheable; before, every process recompiled the whole backward:
27 of a 47 s first step at 24 layers on the CPU, a 55-85 s first step per benchmark child
on the H200)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch._inductor")

_CHILD = textwrap.dedent("""
    import json, torch
    import megatrain
    from megatrain.models import Llama
    from torch._dynamo.utils import counters
    from tests.compiler.helpers import SMALL_VOCAB, random_batches, small_llama_config

    torch.manual_seed(0)
    model = Llama(small_llama_config(layers=2))
    opt = megatrain.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    step = torch.compile(model, backend="megatrain",
                         options={"device": "cpu", "precision": "fp32"})
    losses = []
    for ids, labels in random_batches(SMALL_VOCAB, 2, 2, 16, torch.Generator().manual_seed(1)):
        loss = step(ids, labels=labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.synchronize()
    print(json.dumps({"counters": dict(counters["inductor"]), "losses": losses,
                      "params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()[:64]}))
""")


def _run(cache_dir) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "MEGATRAIN_CACHE": str(cache_dir / "mt")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env,
                       cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a minute; test_warm_start.py's second process asks the same cache in the default run
def test_second_process_hits_the_fx_graph_cache_for_forward_and_backward(tmp_path):
    first = _run(tmp_path)
    second = _run(tmp_path)
    assert first["counters"].get("fxgraph_cache_bypass", 0) == 0, first["counters"]
    assert first["counters"].get("fxgraph_cache_miss", 0) == 2, first["counters"]
    assert second["counters"].get("fxgraph_cache_bypass", 0) == 0, second["counters"]
    assert second["counters"].get("fxgraph_cache_hit", 0) == 2, second["counters"]
    assert second["counters"].get("fxgraph_cache_miss", 0) == 0, second["counters"]
    # the cached code trains exactly as the freshly compiled one
    assert second["losses"] == first["losses"]
    assert second["params"] == first["params"]
