"""AdamW.defer: the runtime's gradient backlog hands a region's final gradients in after
backward (and after step()) returned. The update must be the one submit() during backward
would have made, bitwise; step() must not wait for it; wait_params and synchronize must."""

from __future__ import annotations

import threading

import pytest
import torch

import megatrain.optim as mo


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(7, 5), (5,), (3, 7)]]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]
    return params, grads


def run(deferred: bool):
    """Three steps, lr changed after every step() like an LR scheduler; the last region's
    gradients come late (after step()) when ``deferred``."""
    params, grads = problem()
    opt = mo.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 0.02}], lr=0.01)
    for gs in grads:
        opt.submit(params[:1], gs[:1]).result()
        if deferred:
            d = opt.defer(params[1:])
            assert d is not None
            opt.step()
            for group in opt.param_groups:
                group["lr"] *= 0.5
            d.submit(gs[1:])
            opt.wait_params(params)
        else:
            opt.submit(params[1:], gs[1:]).result()
            opt.step()
            for group in opt.param_groups:
                group["lr"] *= 0.5
    opt.synchronize()
    return [p.detach().clone() for p in params], opt


def test_deferred_updates_equal_submitted_ones_bitwise():
    late, opt = run(True)
    now, _ = run(False)
    for a, b in zip(late, now):
        assert torch.equal(a, b)
    assert all(float(opt.state[p]["step"]) == 3 for p in opt.state)


def test_step_does_not_wait_but_wait_params_and_synchronize_do():
    params, grads = problem()
    opt = mo.AdamW(params, lr=0.01)
    d = opt.defer(params)
    opt.step()  # returns: the deferred update is this step's and immediate
    before = [p.detach().clone() for p in params]
    done = threading.Event()

    def waiter():
        opt.wait_params(params[:1])
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not done.wait(0.2), "wait_params returned before the deferred update was queued"
    d.submit(grads[0])
    t.join(5)
    assert done.is_set()
    assert not torch.equal(params[0].detach(), before[0]), "wait_params returned before the update ran"
    opt.synchronize()
    opt.defer(params[:1])
    with pytest.raises(ValueError, match="already received its last gradient"):
        opt.submit(params[:1], grads[1][:1])  # no step() between: the error submit twice gives


def test_the_next_step_waits_for_a_deferred_update():
    params, grads = problem()
    opt = mo.AdamW(params, lr=0.01)
    d = opt.defer(params)
    opt.step()
    threading.Timer(0.1, d.submit, (grads[0],)).start()
    opt.step()  # an older deferred: waited for
    assert all(float(opt.state[p]["step"]) == 1 for p in params)


@pytest.mark.parametrize("case", ["accumulate", "clip", "skip_nonfinite", "grad_buffer"])
def test_defer_declines_where_the_update_is_not_immediate(case):
    params, grads = problem()
    opt = mo.AdamW(params, lr=0.01, max_grad_norm=1.0 if case == "clip" else None,
                   skip_nonfinite=case == "skip_nonfinite")
    if case == "accumulate":
        with opt.accumulate():
            assert opt.defer(params) is None
    else:
        if case == "grad_buffer":
            with opt.accumulate():
                opt.submit(params, grads[0]).result()
        assert opt.defer(params) is None
    assert not opt._final, "a declined defer must leave no trace"


def test_a_failed_deferred_update_surfaces_from_the_waits():
    params, _ = problem()
    opt = mo.AdamW(params, lr=0.01)
    d = opt.defer(params)
    d.fail(RuntimeError("copy failed"))
    with pytest.raises(RuntimeError, match="copy failed"):
        opt.wait_params(params)
    with pytest.raises(RuntimeError, match="copy failed"):
        opt.synchronize()
