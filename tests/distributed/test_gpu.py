"""NCCL: the sharded optimizer's collectives staged through the GPU (not run on CPU CI).

- one GPU: a one-rank NCCL group drives the whole staged path (pinned scratch, H2D, native
  reduce-scatter, all-gather in several column blocks, D2H on a side stream) through the
  backend on CUDA, against megatrain.AdamW on the same GPU;
- two GPUs: torchrun runs examples/data_parallel.py on cuda:0 and cuda:1 and matches one
  process on one GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatrain
from megatrain.distributed import ShardedAdamW

from . import _worker
from .test_torchrun import EXAMPLE, _finish, _rel, _start
from ..compiler.helpers import compile_streamed

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_one_rank(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_nccl_staged_collectives_match_megatrain_adamw(nccl_one_rank):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    options = {"device": "cuda", "precision": "fp32"}
    model_a, model_b = _worker.make_model(), _worker.make_model()
    opt_a = megatrain.AdamW(model_a.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = ShardedAdamW(model_b.parameters(), lr=1e-2, weight_decay=0.1, timeout=60)
    assert opt_b._comm.device.type == "cuda" and opt_b._comm.native_reduce_scatter
    opt_b._comm.block_numel = 1000  # several staged blocks per region
    step_a = compile_streamed(model_a, options)
    step_b = compile_streamed(model_b, options)
    batches = _worker.global_batches(4)
    _worker.train(step_a, model_a, opt_a, batches)
    _worker.train(step_b, model_b, opt_b, batches)
    a = torch.cat([p.detach().reshape(-1) for p in model_a.parameters()])
    b = torch.cat([p.detach().reshape(-1) for p in model_b.parameters()])
    assert ((a - b).norm() / a.norm()).item() <= 1e-5
    full = opt_b.full_state_dict()
    for i, st in opt_a.state_dict()["state"].items():
        assert torch.allclose(full["state"][i]["exp_avg"], st["exp_avg"], rtol=1e-4, atol=1e-9)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_torchrun_two_gpus_match_one(tmp_path):
    common = [str(EXAMPLE), "--device", "cuda", "--precision", "fp32", "--steps", "3",
              "--batch", "4"]
    _finish([_start([*common, "--out", str(tmp_path / "dp.pt")], tmp_path, torchrun=True)], 600)
    _finish([_start([*common, "--out", str(tmp_path / "one.pt")], tmp_path, torchrun=False)], 600)
    dp, one = (torch.load(tmp_path / f, weights_only=False) for f in ("dp.pt", "one.pt"))
    assert dp["world_size"] == 2
    assert dp["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert _rel(dp["params"], one["params"]) <= 1e-4
