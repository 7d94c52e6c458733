"""One rank of a data-parallel test run (started as a subprocess by tests/distributed).

    python _worker.py SCENARIO RANK WORLD STORE_FILE OUT_FILE

Scenarios:
  train   - through the backend: 3 steps with ShardedAdamW, then 3 with clipping and two
            accumulated micro-batches (same compiled step, parameters reset); then 3 steps
            without the backend (gradients in p.grad). Saves parameters, state sizes, the
            full optimizer state and norms to OUT_FILE.
  kill    - through the backend; rank 1 SIGKILLs itself in the middle of step 2's backward.
  hang    - without the backend; rank 1 stops calling the optimizer (sleeps) at step 2.
The common model, data and the single-process reference live here too, so the test and
the ranks build exactly the same things.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import torch

import megatrain.config

# The graphs run as they are (a decision forced for every compiling call: fast to compile).
FORCED = {"lowering": "eager"}

VOCAB, SEQ, STEPS, LR = 128, 16, 3, 1e-2
RANK_ROWS, REF_ROWS = 2, 4  # rows per micro-batch: one rank of two / the single process
OPTIONS = {"device": "cpu", "precision": "fp32"}
TIMEOUT_S = 5.0  # the optimizer's timeout in the `hang` scenario (ranks in lockstep there)
SLACK_S = 120.0  # elsewhere: a rank may wait that long for its peer's compile under load


def make_model():
    from megatrain.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=VOCAB, hidden=32, layers=2, heads=2, kv_heads=1, ffn=64,
                             rope_theta=10000.0, tie_embeddings=True))


def global_batches(rows, n=STEPS):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, VOCAB, (rows, SEQ), generator=g),
             torch.randint(0, VOCAB, (rows, SEQ), generator=g)) for _ in range(n)]


def shard(batch, rank, world):
    """Rank `rank`'s contiguous share of a global batch (as `megatrain train` splits it)."""
    ids, labels = batch
    rows = ids.shape[0] // world
    return ids[rank * rows:(rank + 1) * rows], labels[rank * rows:(rank + 1) * rows]


def flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params]).clone()


def train(fn, model, opt, batches, accum=1, on_step=None):
    """`accum` micro-batches per step (all but the last inside opt.accumulate())."""
    for s, (ids, labels) in enumerate(batches):
        rows = ids.shape[0] // accum
        for m in range(accum):
            if on_step is not None:
                on_step(s, m)
            with megatrain.config.patch(**FORCED):
                loss = fn(ids[m * rows:(m + 1) * rows], labels=labels[m * rows:(m + 1) * rows])
            ctx = opt.accumulate() if m < accum - 1 else _null()
            with ctx:
                (loss / accum).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()  # with clipping, step() may leave updates running (megatrain.AdamW too)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# Variants through the backend: (name, optimizer kwargs, global rows per step). Every
# micro-batch has RANK_ROWS rows on a rank and REF_ROWS in the reference, so each process
# compiles one graph for all variants.
VARIANTS = [("fast", {}, 4), ("clip_accum", {"max_grad_norm": 0.05}, 8)]


def each_variant(model, make_opt):
    """(name, rows, optimizer) per VARIANTS entry, the model reset to its first weights."""
    init = [p.detach().clone() for p in model.parameters()]
    for name, kw, rows in VARIANTS:
        with torch.no_grad():
            for p, q in zip(model.parameters(), init):
                p.copy_(q)
        yield name, rows, make_opt(kw)


def reference():
    """Single-process megatrain.AdamW on the whole global batch, same variants."""
    import megatrain

    out = {}
    model = make_model()
    step = torch.compile(model, backend="megatrain", options=OPTIONS)
    make_opt = lambda kw: megatrain.AdamW(model.parameters(), lr=LR, weight_decay=0.1, **kw)  # noqa: E731
    for name, rows, opt in each_variant(model, make_opt):
        train(step, model, opt, global_batches(rows), accum=rows // REF_ROWS)
        out[name] = flat(model.parameters())
        out[name + "_state_bytes"] = sum(t.numel() * t.element_size() for st in opt.state.values()
                                         for t in st.values())
        out[name + "_norm"] = None if opt.last_grad_norm is None else float(opt.last_grad_norm)
        if name == "fast":
            out["fast_state"] = opt.state_dict()["state"]
        del opt
    plain = make_model()
    opt = megatrain.AdamW(plain.parameters(), lr=LR, weight_decay=0.1)
    train(plain, plain, opt, global_batches(4))
    out["plain"] = flat(plain.parameters())
    out["numel"] = sum(p.numel() for p in plain.parameters())
    return out


def main(scenario, rank, world, store, out_file):
    import torch.distributed as dist

    import megatrain
    from megatrain.distributed import ShardedAdamW

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=SLACK_S))
    def mine(rows):
        return [shard(b, rank, world) for b in global_batches(rows)]

    result = {"rank": rank}
    try:
        if scenario == "train":
            model = make_model()
            step = torch.compile(model, backend="megatrain", options=OPTIONS)

            def make_opt(kw):
                return ShardedAdamW(model.parameters(), lr=LR, weight_decay=0.1, timeout=SLACK_S, **kw)

            for name, rows, opt in each_variant(model, make_opt):
                accum = rows // world // RANK_ROWS
                train(step, model, opt, mine(rows), accum=accum)
                result[name] = flat(model.parameters())
                result[name + "_grads_none"] = all(p.grad is None for p in model.parameters())
                result[name + "_state_bytes"] = opt.host_state_bytes()
                result[name + "_norm"] = (None if opt.last_grad_norm is None
                                          else float(opt.last_grad_norm))
                if name == "fast":
                    result["fast_full_state"] = opt.full_state_dict(to_rank=0)
                    result["fast_backward_code"] = megatrain.explain(step).graphs[0].backward_code
                del opt
            plain = make_model()
            opt = ShardedAdamW(plain.parameters(), lr=LR, weight_decay=0.1, timeout=SLACK_S)
            train(plain, plain, opt, mine(4))
            result["plain"] = flat(plain.parameters())
            result["plain_state_bytes"] = opt.host_state_bytes()
            # the all-reduce fallback of reduce-scatter (a backend without it) gives the
            # same block as the native op
            from megatrain.distributed import reduce_scatter_sum
            x = torch.randn(world * 5, generator=torch.Generator().manual_seed(rank))
            native, fallback = torch.empty(5), torch.empty(5)
            reduce_scatter_sum(native, x.clone(), None, native=True)
            reduce_scatter_sum(fallback, x.clone(), None, native=False)
            result["reduce_scatter"] = (native, fallback)
        elif scenario in ("kill", "hang"):
            model = make_model()
            # a killed peer closes its connections: detected at once, not by the timeout
            timeout = TIMEOUT_S if scenario == "hang" else SLACK_S
            opt = ShardedAdamW(model.parameters(), lr=LR, weight_decay=0.1, timeout=timeout)
            fn = torch.compile(model, backend="megatrain", options=OPTIONS) \
                if scenario == "kill" else model

            def on_step(s, m):
                if s == 1 and rank == 1:
                    if scenario == "kill":
                        # die inside backward: after the first region's gradient hand-off
                        from megatrain.optim import registry
                        orig = opt.submit

                        def dying_submit(params, grads):
                            os.kill(os.getpid(), signal.SIGKILL)
                            return orig(params, grads)

                        opt.submit = dying_submit
                        assert registry.owner_of(next(model.parameters())) is opt
                    else:
                        time.sleep(120)
                if s == 1:
                    result["t_fail_start"] = time.time()
                    torch.save(result, out_file + ".partial")

            train(fn, model, opt, mine(4), on_step=on_step)
            result["finished"] = True
    except Exception as e:  # noqa: BLE001
        result["error_type"] = type(e).__name__
        result["error"] = "".join(traceback.format_exception_only(type(e), e))
        result["t_fail"] = time.time()
        traceback.print_exc()
    torch.save(result, out_file)
    if "error" in result:
        os._exit(3)  # no clean shutdown with a dead peer
    dist.destroy_process_group()


if __name__ == "__main__":
    scenario, rank, world, store, out_file = sys.argv[1:]
    main(scenario, int(rank), int(world), store, out_file)
