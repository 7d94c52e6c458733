"""The gradient backlog on CUDA (option backlog, megatrain.runtime.deadlines and
grad_backlog): sealed regions are handed to the host optimizer earliest deadline first
(readiness: their D2H copies' events), with the updates deferred past the end of backward;
with "device" gradients that find no free host slab are copied into a device buffer on the
compute stream, later copied to a slab on the D2H stream from the hand-off thread. Checked
against no backlog.

Tolerance: both runs do the same math, but CUDA reductions with atomics are not
deterministic run to run, so from step 2 the gradients may differ by ~1e-7 relative; AdamW
amplifies that by up to lr / (4 eps) per unit of g where |g| ~ eps (see
test_device_update_cuda.py): rtol=atol=1e-5. A stale weight (a fetch that did not wait for
its deferred update), a lost, doubled or out-of-date gradient moves parameters by ~lr = 3e-3.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

import megatrain
from megatrain.optim import engine

from .compare import assert_runs_agree, seeded_llama_and_batches
from ..compiler.helpers import compile_streamed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]


@pytest.fixture
def slow_optimizer(monkeypatch):
    """Each worker task takes >= 30 ms: slabs run out and regions wait on the GPU."""
    inner = engine._run_no_grad

    def slow(*args, **kwargs):
        time.sleep(0.03)
        return inner(*args, **kwargs)

    monkeypatch.setattr(engine, "_run_no_grad", slow)


def _train(model, batches, backlog: str | None, precision: str):
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    opt = megatrain.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    step = compile_streamed(model, {"device": "cuda", "precision": precision, "backlog": backlog,
                                   "updates": "host"})
    losses, deferred = [], []
    for ids, labels in batches:
        loss = step(ids, labels=labels)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        deferred.append(len({id(d) for d in opt._promised_to.values()}))
        for group in opt.param_groups:
            group["lr"] *= 0.5  # like a scheduler stepped after opt.step()
        opt.zero_grad()
    opt.synchronize()
    plan = megatrain.explain(step).graphs[0]
    return [p.detach().clone() for p in model.parameters()], losses, plan, deferred


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_backlog_matches_no_backlog_on_cuda(slow_optimizer, precision, where):
    model, batches = seeded_llama_and_batches()
    on, on_losses, plan, deferred = _train(model, batches, where, precision)
    off, off_losses, off_plan, _ = _train(model, batches, None, precision)
    streamer = plan.streamer
    assert max(deferred) > 0, "step() should return with updates still deferred"
    assert any(waiting for _, waiting in streamer._sealed.served), "the hand-off never had a choice"
    if where == "device":
        backlog = streamer.backlog
        assert backlog.backlogged >= 3, "the slowed optimizer must push regions into the backlog"
        served = list(backlog.queue.served)
        assert all(r < w for r, waiting in served for w in waiting), served
        assert backlog.reserve.live == 0
    else:
        assert streamer._slabs.allocated > 2, "host slabs grow while the host lags"
    assert plan.measured_peak_bytes <= plan.budget
    # bf16: a ulp of the compute dtype can differ, so losses within 2e-2 and no param check
    assert_runs_agree(model, on, off, on_losses, off_losses, loss_rtol=1e-5 if precision == "fp32" else 2e-2,
                      compare_params=precision == "fp32")
