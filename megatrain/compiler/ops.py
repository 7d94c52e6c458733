"""megatrain's transfer ops, as torch.library custom ops so every compiler stage sees them.

Before AOTAutograd (torch-level graph):
    fetch(param, streamer, region, param_id, to_optimizer) -> device copy of `param` in the
    compute dtype. Its backward is `grad_to_host` (the gradient lands in `p.grad`), or, when
    a megatrain.AdamW owns the parameter, the effectful `grad_to_optimizer` (the gradient is
    handed to the optimizer, no `p.grad`); either way each weight gradient leaves the device
    right after the op that produces it, inside the compiled backward.

After partitioning (inserted by `passes.insert_transfers`; `token` orders them):
    begin_step(token!, streamer)                          a forward starts a step (first op)
    prefetch(token!, host_params, streamer, region)      start the host-to-device copy
    wait(token!, streamer, region, numel) -> flat         compute stream waits; the flat
                                                          device buffer (views follow)
    evict(token!, flat, streamer, region)                 region's weights leave the pool
    grad_to_host(grad, streamer, param_id) -> host grad   device-to-host copy on its stream
    drain(token!, host_grads, streamer)                   host grads complete (end of bw)
    offload(token!, t, streamer, key)                     start t's copy to host (forward)
    offload_wait(token!, t!, streamer, key)               wait for it; t's storage emptied
    reload(token!, t!, streamer, key)                     refill t's storage, start the copy
    reload_wait(token!, t!, streamer, key)                compute stream waits (backward)
  (runtime/activation_offload.py; `t!`: declared mutated, so every reader of t stays on
  its side of the op)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..runtime import streamer as _streamer


def _s(index: int) -> "_streamer.Streamer":
    return _streamer.get(index)


@torch.library.custom_op("megatrain::fetch", mutates_args=())
def fetch(param: Tensor, streamer: int, region: int, param_id: int, to_optimizer: bool) -> Tensor:
    return _s(streamer).fetch_now(param)


@fetch.register_fake
def _(param, streamer, region, param_id, to_optimizer):
    s = _s(streamer)
    return torch.empty(param.shape, dtype=s.compute_dtype, device=s.device)


def _fetch_setup(ctx, inputs, output):
    param, ctx.streamer, ctx.region, ctx.param_id, ctx.to_optimizer = inputs
    if ctx.to_optimizer:
        ctx.save_for_backward(param)


def _fetch_backward(ctx, grad):
    if ctx.to_optimizer:
        # Fast path: the gradient goes straight to megatrain.AdamW; no p.grad is kept. The
        # parameter travels with the call: dynamo may run one graph for several modules of
        # the same code (a graph break inside a layer compiles the layer's forward once
        # and calls it for every layer, each with its own parameters), so `param_id` names
        # a slot of the graph, not a parameter.
        (param,) = ctx.saved_tensors
        torch.ops.megatrain.grad_to_optimizer(grad, ctx.streamer, ctx.region, ctx.param_id, param)
        return None, None, None, None, None
    return torch.ops.megatrain.grad_to_host(grad, ctx.streamer, ctx.param_id), None, None, None, None


torch.library.register_autograd("megatrain::fetch", _fetch_backward, setup_context=_fetch_setup)


@torch.library.custom_op("megatrain::grad_to_host", mutates_args=())
def grad_to_host(grad: Tensor, streamer: int, param_id: int) -> Tensor:
    return _s(streamer).grad_to_host(grad, param_id)


@grad_to_host.register_fake
def _(grad, streamer, param_id):
    p = _s(streamer).params[param_id]
    return torch.empty(grad.shape, dtype=p.dtype, device=p.device)


@torch.library.custom_op("megatrain::grad_to_optimizer", mutates_args=())
def grad_to_optimizer(grad: Tensor, streamer: int, region: int, param_id: int, param: Tensor) -> None:
    _s(streamer).grad_to_optimizer(grad, region, param_id, param)


@grad_to_optimizer.register_fake
def _(grad, streamer, region, param_id, param):
    return None


# ORDERED: AOTAutograd threads an effect token through it, so it is kept (it returns
# nothing) and stays where the gradient is produced.
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op  # noqa: E402

_register_effectful_op(torch.ops.megatrain.grad_to_optimizer.default, _EffectType.ORDERED)


@torch.library.custom_op("megatrain::begin_step", mutates_args=("token",))
def begin_step(token: Tensor, streamer: int) -> None:
    # The forward's first op: a step of this graph starts (Streamer.begin_step). It is part
    # of the graph, not a Python wrapper around the compiled forward, so that the compiled
    # forward is Inductor's output as it is, which AOTAutograd's cache can save and load
    # (compiler/aot_cache.py).
    _s(streamer).begin_step()


@begin_step.register_fake
def _(token, streamer):
    return None


@torch.library.custom_op("megatrain::prefetch", mutates_args=("token",))
def prefetch(token: Tensor, host_params: list[Tensor], streamer: int, region: int) -> None:
    _s(streamer).prefetch(region, host_params)


@prefetch.register_fake
def _(token, host_params, streamer, region):
    return None


@torch.library.custom_op("megatrain::wait", mutates_args=("token",))
def wait(token: Tensor, streamer: int, region: int, numel: int) -> Tensor:
    return _s(streamer).wait(region, numel)


@wait.register_fake
def _(token, streamer, region, numel):
    s = _s(streamer)
    return torch.empty(numel, dtype=s.compute_dtype, device=s.device)


@torch.library.custom_op("megatrain::evict", mutates_args=("token",))
def evict(token: Tensor, flat: Tensor, streamer: int, region: int) -> None:
    _s(streamer).evict(region, flat)


@evict.register_fake
def _(token, flat, streamer, region):
    return None


@torch.library.custom_op("megatrain::keep", mutates_args=("token",))
def keep(token: Tensor, flat: Tensor, streamer: int, region: int) -> None:
    # The forward's last use of a region whose weights the plan keeps for its backward:
    # the streamer holds `flat` (still counted against the budget) for that backward's wait.
    _s(streamer).keep(region, flat)


@keep.register_fake
def _(token, flat, streamer, region):
    return None


@torch.library.custom_op("megatrain::claim", mutates_args=("token",))
def claim(token: Tensor, host_params: list[Tensor], streamer: int, region: int) -> None:
    # In a backward, for a region the plan keeps: take the forward's buffer if it holds
    # these parameters (else fetch them), for the wait that follows.
    _s(streamer).claim(region, host_params)


@claim.register_fake
def _(token, host_params, streamer, region):
    return None


@torch.library.custom_op("megatrain::prefetch_next", mutates_args=("token",))
def prefetch_next(token: Tensor, streamer: int, phase: str) -> None:
    # After the graph's last region is resident: fetch the first region of the graph that
    # ran next last time (runtime/graph_order.py), so a graph boundary costs no stall.
    _s(streamer).prefetch_next(phase)


@prefetch_next.register_fake
def _(token, streamer, phase):
    return None


@torch.library.custom_op("megatrain::drain", mutates_args=("token",))
def drain(token: Tensor, host_grads: list[Optional[Tensor]], streamer: int) -> None:
    # host_grads: grad_to_host outputs and the effect tokens of grad_to_optimizer calls
    # (None at run time once Inductor unlifts tokens): inputs only to order drain last.
    _s(streamer).drain()


@drain.register_fake
def _(token, host_grads, streamer):
    return None


def _activation_op(name: str, mutates: tuple[str, ...]):
    """megatrain::<name>(token, t, streamer, key): ActivationStore.<name>(key, t). The four
    differ only in the method they call and in whether `t` is declared mutated."""

    @torch.library.custom_op(f"megatrain::{name}", mutates_args=mutates)
    def op(token: Tensor, t: Tensor, streamer: int, key: int) -> None:
        getattr(_s(streamer).activations, name)(key, t)

    op.register_fake(lambda token, t, streamer, key: None)
    return op


offload = _activation_op("offload", ("token",))  # only reads t
offload_wait = _activation_op("offload_wait", ("token", "t"))
reload = _activation_op("reload", ("token", "t"))
reload_wait = _activation_op("reload_wait", ("token", "t"))


FETCH = torch.ops.megatrain.fetch.default
BEGIN_STEP = torch.ops.megatrain.begin_step.default
GRAD_TO_HOST = torch.ops.megatrain.grad_to_host.default
GRAD_TO_OPTIMIZER = torch.ops.megatrain.grad_to_optimizer.default
PREFETCH = torch.ops.megatrain.prefetch.default
WAIT = torch.ops.megatrain.wait.default
EVICT = torch.ops.megatrain.evict.default
KEEP = torch.ops.megatrain.keep.default
CLAIM = torch.ops.megatrain.claim.default
PREFETCH_NEXT = torch.ops.megatrain.prefetch_next.default
DRAIN = torch.ops.megatrain.drain.default
OFFLOAD = torch.ops.megatrain.offload.default
OFFLOAD_WAIT = torch.ops.megatrain.offload_wait.default
RELOAD = torch.ops.megatrain.reload.default
RELOAD_WAIT = torch.ops.megatrain.reload_wait.default
ACTIVATION_OPS = {"offload": OFFLOAD, "offload_wait": OFFLOAD_WAIT, "reload": RELOAD, "reload_wait": RELOAD_WAIT}
TRANSFER_OPS = (BEGIN_STEP, PREFETCH, WAIT, EVICT, PREFETCH_NEXT, GRAD_TO_HOST, DRAIN, *ACTIVATION_OPS.values())
