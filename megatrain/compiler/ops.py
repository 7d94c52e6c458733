"""megatrain's transfer ops, as torch.library custom ops so every compiler stage sees them.

Before AOTAutograd (torch-level graph):
    fetch(param, streamer, region, param_id) -> device copy of `param` in the compute dtype.
    Its backward is `grad_to_host`, so each weight gradient leaves the device right after
    the op that produces it, inside the compiled backward.

After partitioning (inserted by `passes.insert_transfers`; `token` orders them):
    prefetch(token!, host_params, streamer, region)      start the host-to-device copy
    wait(token!, streamer, region, numel) -> flat         compute stream waits; the flat
                                                          device buffer (views follow)
    evict(token!, flat, streamer, region)                 region's weights leave the pool
    grad_to_host(grad, streamer, param_id) -> host grad   device-to-host copy on its stream
    drain(token!, host_grads, streamer)                   host grads complete (end of bw)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..runtime import streamer as _streamer


def _s(index: int) -> "_streamer.Streamer":
    return _streamer.get(index)


@torch.library.custom_op("megatrain::fetch", mutates_args=())
def fetch(param: Tensor, streamer: int, region: int, param_id: int) -> Tensor:
    return _s(streamer).fetch_now(param)


@fetch.register_fake
def _(param, streamer, region, param_id):
    s = _s(streamer)
    return torch.empty(param.shape, dtype=s.compute_dtype, device=s.device)


def _fetch_setup(ctx, inputs, output):
    _, ctx.streamer, _, ctx.param_id = inputs


def _fetch_backward(ctx, grad):
    return torch.ops.megatrain.grad_to_host(grad, ctx.streamer, ctx.param_id), None, None, None


torch.library.register_autograd("megatrain::fetch", _fetch_backward, setup_context=_fetch_setup)


@torch.library.custom_op("megatrain::grad_to_host", mutates_args=())
def grad_to_host(grad: Tensor, streamer: int, param_id: int) -> Tensor:
    return _s(streamer).grad_to_host(grad, param_id)


@grad_to_host.register_fake
def _(grad, streamer, param_id):
    p = _s(streamer).params[param_id]
    return torch.empty(grad.shape, dtype=p.dtype, device=p.device)


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


@torch.library.custom_op("megatrain::drain", mutates_args=("token",))
def drain(token: Tensor, host_grads: list[Tensor], streamer: int) -> None:
    _s(streamer).drain()


@drain.register_fake
def _(token, host_grads, streamer):
    return None


FETCH = torch.ops.megatrain.fetch.default
GRAD_TO_HOST = torch.ops.megatrain.grad_to_host.default
PREFETCH = torch.ops.megatrain.prefetch.default
WAIT = torch.ops.megatrain.wait.default
EVICT = torch.ops.megatrain.evict.default
DRAIN = torch.ops.megatrain.drain.default
TRANSFER_OPS = (PREFETCH, WAIT, EVICT, GRAD_TO_HOST, DRAIN)
