"""Data parallelism with the sharded host optimizer, on the CPU with gloo.

Two ranks run as subprocesses (tests/distributed/_worker.py) rendezvousing through a
FileStore in a temporary folder (no ports to pick); every process started is killed in a
`finally`. The single-process reference runs in this process meanwhile.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import megatrain
from megatrain.distributed import RankFailureError, ShardedAdamW
from megatrain.distributed.shards import RegionLayout, ShardSpec

from . import _worker

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")
WORLD = 2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _launch(scenario: str, folder: Path) -> list[subprocess.Popen]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # two ranks share the test machine's cores
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    procs = []
    for rank in range(WORLD):
        log = open(folder / f"log{rank}.txt", "w")
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(rank), str(WORLD),
             str(folder / "store"), str(folder / f"rank{rank}.pt")],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=folder))
    return procs


def _logs(folder: Path) -> str:
    return "\n".join(f"--- rank {r} ---\n" + (folder / f"log{r}.txt").read_text()[-3000:]
                     for r in range(WORLD) if (folder / f"log{r}.txt").exists())


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _result(folder: Path, rank: int, suffix: str = "") -> dict:
    return torch.load(folder / f"rank{rank}.pt{suffix}", weights_only=False)


# ---------------------------------------------------------------- training equals one process

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dp_train")
    procs = _launch("train", folder)
    try:
        torch._dynamo.reset()
        ref = _worker.reference()  # overlaps with the ranks' start-up and compile
        for p in procs:
            p.wait(timeout=150)
        assert all(p.returncode == 0 for p in procs), _logs(folder)
    finally:
        _kill(procs)
        torch._dynamo.reset()
    return ref, [_result(folder, r) for r in range(WORLD)]


@pytest.mark.parametrize("variant", ["fast", "clip_accum"])
def test_backend_training_equals_one_process_on_the_global_batch(trained, variant):
    """3 steps through torch.compile(backend="megatrain") with ShardedAdamW on 2 ranks,
    each on half of every global batch, equal 3 single-process steps on the whole batch
    (``clip_accum``: max_grad_norm, and 2 micro-batches per step on each rank)."""
    ref, ranks = trained
    for r in ranks:
        assert rel(r[variant], ref[variant]) <= 1e-5, (variant, r["rank"])
    assert torch.equal(ranks[0][variant], ranks[1][variant]), "ranks must hold the same weights"
    # the run took the backend's fast path: gradients handed to the optimizer, no p.grad
    assert "grad_to_optimizer" in ranks[0]["fast_backward_code"]
    assert ranks[0]["fast_grads_none"]
    if variant == "clip_accum":
        assert ref["clip_accum_norm"] > 0.05  # clipping was active
        for r in ranks:
            assert abs(r["clip_accum_norm"] - ref["clip_accum_norm"]) <= 1e-5 * ref["clip_accum_norm"]


def test_training_without_the_backend_equals_one_process(trained):
    ref, ranks = trained
    for r in ranks:
        assert rel(r["plain"], ref["plain"]) <= 1e-5
    assert torch.equal(ranks[0]["plain"], ranks[1]["plain"])


def test_each_rank_holds_half_of_the_optimizer_state(trained):
    ref, ranks = trained
    single = ref["fast_state_bytes"]
    n_tensors = 2 * len(ref["fast_state"])
    for r in ranks:
        for key in ("fast_state_bytes", "plain_state_bytes"):
            # m and v of 1/2 of the elements (+ at most one padding element per tensor and
            # the 4-byte step counts, which every rank keeps)
            assert abs(r[key] - single / WORLD) <= 4 * n_tensors + 4 * len(ref["fast_state"])
    # the gathered state is the single-process state
    full = ranks[0]["fast_full_state"]["state"]
    assert ranks[1]["fast_full_state"] is None
    assert full.keys() == ref["fast_state"].keys()
    for i, st in ref["fast_state"].items():
        assert float(full[i]["step"]) == float(st["step"]) == 3
        for k in ("exp_avg", "exp_avg_sq"):
            assert full[i][k].shape == st[k].shape
            assert rel(full[i][k], st[k]) <= 1e-5, (i, k)


def test_reduce_scatter_fallback_equals_the_native_op(trained):
    _, ranks = trained
    for r in ranks:
        native, fallback = r["reduce_scatter"]
        assert torch.allclose(native, fallback, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------- failures

def _fails_fast(tmp_path, scenario):
    procs = _launch(scenario, tmp_path)
    try:
        procs[0].wait(timeout=120)
        t_exit = time.time()
    finally:
        _kill(procs)
    r0 = _result(tmp_path, 0)
    started = _result(tmp_path, 0, ".partial")["t_fail_start"]
    assert procs[0].returncode == 3, _logs(tmp_path)
    assert r0["error_type"] == RankFailureError.__name__, r0["error"]
    assert "rank 0 of 2" in r0["error"] and "Another rank most likely died" in r0["error"]
    return r0, t_exit - started


def test_a_killed_rank_makes_the_other_fail_with_a_clear_error(tmp_path):
    """Rank 1 is SIGKILLed inside step 2's backward (as its first region is handed to the
    optimizer); rank 0, in the same backward, fails at once with RankFailureError instead
    of hanging, and exits."""
    r0, elapsed = _fails_fast(tmp_path, "kill")
    assert "reduce-scatter of the gradients" in r0["error"]
    assert elapsed < 10, elapsed  # the optimizer's timeout is 120 s here: not waited out


def test_a_stuck_rank_makes_the_other_fail_after_the_timeout(tmp_path):
    """Rank 1 stops calling the optimizer (sleeps) at step 2; rank 0 fails once the
    optimizer's process-group timeout (5 s here) has passed."""
    r0, elapsed = _fails_fast(tmp_path, "hang")
    assert "Timed out" in r0["error"] or "timeout" in r0["error"].lower()
    assert _worker.TIMEOUT_S - 1 < elapsed < _worker.TIMEOUT_S + 10, elapsed


# ------------------------------------------------------------ one process: the API contract

@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_from_env"):
        ShardedAdamW([torch.nn.Parameter(torch.zeros(3))])


def test_one_rank_is_megatrain_adamw_and_state_dicts_move_between_them(one_rank_group):
    model_a, model_b = _worker.make_model(), _worker.make_model()
    opt_a = megatrain.AdamW(model_a.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = ShardedAdamW(model_b.parameters(), lr=1e-2, weight_decay=0.1, timeout=10)
    assert isinstance(opt_b, megatrain.AdamW)
    batches = _worker.global_batches(2)
    _worker.train(model_a, model_a, opt_a, batches)
    _worker.train(model_b, model_b, opt_b, batches)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
    # full_state_dict == megatrain.AdamW's state_dict; and it loads back into either
    full, plain = opt_b.full_state_dict(), opt_a.state_dict()
    for i, st in plain["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(full["state"][i][k], st[k])
    opt_c = ShardedAdamW(model_b.parameters(), lr=1e-2, weight_decay=0.1)
    opt_c.load_state_dict(plain)
    local = opt_c.state_dict()
    assert local["megatrain_sharding"] == {"world_size": 1, "rank": 0, "split": "flat-even"}
    opt_c.load_state_dict(local)
    opt_a.load_state_dict(full)
    _worker.train(model_a, model_a, opt_a, batches[:1])
    _worker.train(model_b, model_b, opt_c, batches[:1])
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
    # a shard of another sharding is refused, naming both
    with pytest.raises(ValueError, match="rank 1's shard of a 2-rank run"):
        opt_c.load_state_dict({**local, "megatrain_sharding": {"world_size": 2, "rank": 1}})
    with pytest.raises(TypeError, match="full_state_dict"):
        __import__("copy").deepcopy(opt_c)


def test_non_contiguous_parameters_are_refused(one_rank_group):
    p = torch.nn.Parameter(torch.zeros(4, 3).t())
    with pytest.raises(ValueError, match="not contiguous"):
        ShardedAdamW([p])


def test_pack_and_unpack_over_odd_sizes():
    """Every element lands in exactly one rank's slot, padding is zero, the round trip is
    exact, and the shards of all ranks tile each tensor."""
    shapes = [(7,), (3, 5), (1,), (0,), (2, 2, 3)]
    for world in (1, 2, 3, 4, 5):
        tensors = [torch.randn(s) for s in shapes]
        lays = [RegionLayout([ShardSpec(t.numel(), world, r) for t in tensors], 7.0)
                for r in range(world)]
        buf = torch.full((world * lays[0].row,), float("nan"))
        lays[0].pack_full(tensors, buf)
        rows = buf.view(world, -1)
        assert torch.isfinite(rows).all() and (rows[:, -1] == 7.0).all()
        out = [torch.empty_like(t) for t in tensors]
        lays[0].unpack_full(buf, out)
        assert all(torch.equal(a, b) for a, b in zip(out, tensors))
        for i, t in enumerate(tensors):
            pieces = [lays[r].own(rows[r])[i] for r in range(world)]
            assert torch.equal(torch.cat(pieces), t.reshape(-1))
            assert sum(lays[r].specs[i].size for r in range(world)) == t.numel()
