"""The first step of a second process compiling the same model (warm caches), with and
without the plan cached beside AOTAutograd's entry (compiler/aot_cache.py).

Three children share one cache folder: a cold one that fills the caches, then a warm one
with `megatrain.config.aot_cache` off (planned afresh, Inductor's kernels from its FX
graph cache) and one with it on. Each prints its first step's wall time (compile and the
step: forward, backward and the optimizer) and its compile phases (phases.py); what the
phases leave of the first step is dynamo's tracing, AOTAutograd's own bookkeeping and the
step itself. The three steps' losses must agree, and the weights after them too under
OMP_NUM_THREADS=1 (with several threads Inductor's CPU embedding backward accumulates a
token id's repeats in thread order: a few last bits differ run to run, cache or none).

    python bench/warm_start.py --layers 24 --hidden 64 --seq 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(args) -> None:
    import hashlib
    import time

    import torch

    import megatrain
    from megatrain.models import Llama, LlamaConfig

    megatrain.config.aot_cache = args.aot_cache == "on"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                      ffn=2 * args.hidden, rope_theta=10000.0)
    model = Llama(cfg)
    opt = megatrain.AdamW(model.parameters(), lr=1e-3)
    step = torch.compile(model, backend="megatrain", options={"device": args.device, "precision": args.precision})
    ids = torch.randint(0, args.vocab, (2, args.seq))
    losses, first = [], None
    t0 = time.perf_counter()
    for _ in range(3):   # the first step timed; all three's losses and the weights compared
        loss = step(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        first = first or time.perf_counter() - t0
    opt.synchronize()
    plan = megatrain.explain(step)
    weights = hashlib.sha256(torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().tobytes())
    print(json.dumps({"first_step_s": round(first, 2), "losses": losses, "weights": weights.hexdigest()[:16],
                      "phases": {k: round(v, 2) for k, v in plan.compile_seconds.items()},
                      "cached": [g.cached for g in plan.graphs]}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--aot-cache", default="on", choices=("on", "off"))
    args = p.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory(prefix="megatrain-warm-start-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "MEGATRAIN_CACHE": os.path.join(cache, "mt"),
               "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
        for name, cached in (("cold", "on"), ("warm, aot_cache off", "off"), ("warm, aot_cache on", "on")):
            cmd = [sys.executable, __file__, "--child", "--aot-cache", cached, "--layers", str(args.layers),
                   "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--seq", str(args.seq),
                   "--device", args.device, "--precision", args.precision]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
            if r.returncode:
                sys.exit(r.stderr[-3000:])
            print(f"{name}: {r.stdout.strip().splitlines()[-1]}", flush=True)


if __name__ == "__main__":
    main()
