"""Data-parallel training with megatrain, in a script of your own.

    python examples/data_parallel.py                                  # one process
    torchrun --standalone --nproc-per-node 2 examples/data_parallel.py   # two ranks

The same script runs both ways: `init_from_env` reads torchrun's environment (nothing
outside torchrun) and starts gloo on the CPU or NCCL on CUDA (each rank on
cuda:LOCAL_RANK). Every rank builds the same model on the CPU, compiles it with the
megatrain backend for its own device and trains on its share of each global batch;
`megatrain.ShardedAdamW` averages gradients over the ranks and keeps 1/N of the optimizer
state per rank. Only rank 0 prints and saves.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import megatrain
from megatrain.distributed import init_from_env, shutdown
from megatrain.models import PRESETS, Llama, LlamaConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", help="cuda or cpu [cuda if available]")
    ap.add_argument("--model", default="small", help="'small' (a 2-layer toy) or a preset")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--precision", default=None, help="fp32 or bf16 [bf16 on cuda]")
    ap.add_argument("--lowering", default=None, help="backend lowering: eager or inductor")
    ap.add_argument("--out", help="write losses and final weights here (rank 0)")
    args = ap.parse_args()

    info = init_from_env(args.device)  # one rank outside torchrun
    if args.batch % info.world_size:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {info.world_size} ranks")
    torch.manual_seed(0)  # the same model on every rank (ShardedAdamW also broadcasts rank 0's)
    cfg = (LlamaConfig(vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1, ffn=64)
           if args.model == "small" else PRESETS[args.model])
    model = Llama(cfg)
    kwargs = dict(lr=args.lr, weight_decay=0.1, max_grad_norm=1.0)
    opt = (megatrain.ShardedAdamW(model.parameters(), **kwargs) if info.distributed
           else megatrain.AdamW(model.parameters(), **kwargs))
    options = {"device": str(info.device)}
    if args.precision:
        options["precision"] = args.precision
    if args.lowering:  # a debugging knob, forced for the graphs compiled by the first call
        megatrain.config.lowering = args.lowering
    step = torch.compile(model, backend="megatrain", options=options)

    data = torch.Generator().manual_seed(1)  # the same global batches on every rank
    losses = []
    for i in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=data)
        mine = tokens.chunk(info.world_size)[info.rank]  # this rank's share
        loss = step(mine[:, :-1], labels=mine[:, 1:])
        loss.backward()  # each region's gradient: averaged over ranks, then this rank's shard updated
        opt.step()
        opt.zero_grad()
        mean = loss.detach().double()
        if info.distributed:
            dist.all_reduce(mean)  # the user's own collective: the default group
            mean /= info.world_size
        losses.append(float(mean))
        if info.is_main:
            print(f"step {i + 1}: loss {losses[-1]:.4f}  grad norm {float(opt.last_grad_norm):.3f}",
                  flush=True)
    opt.synchronize()  # step() may still be applying the last (clipped) updates
    if info.is_main and args.out:
        torch.save({"losses": losses, "world_size": info.world_size,
                    "params": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                   args.out)
        print(json.dumps({"world_size": info.world_size, "final_loss": losses[-1]}))
    shutdown(info)


if __name__ == "__main__":
    main()
