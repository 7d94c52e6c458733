"""A token-wise subgraph run a chunk of tokens at a time, `megatrain::token_chunks`.

At long sequence lengths one layer's MLP dominates its working set: its up-projections
are several times wider than the hidden states (8B at 128k tokens: four [tokens, 14336]
bf16 intermediates of 3.5 GiB in the forward, as many gradients in the backward). Every
row of a token-wise subgraph depends only on the same row of its input, so it can run
over the tokens in chunks: the forward keeps only its input and output, the backward
recomputes one chunk's forward and backpropagates it, then the next. The intermediates
then never exceed one chunk's, at the price of the subgraph's forward once more in the
backward (mini-sequence training).

The subgraph is a GraphModule (inputs: the activations, then the parameters; a list of
outputs, each keeping the activations' token dims)
registered under a key derived from its code, so the same subgraph gets the same key in
every process (a compiled graph cached by Inductor names it by that key). The pass that
finds such subgraphs and swaps them in is compiler/token_chunks.py.

Parameter gradients are summed over the chunks in fp32 and cast once to the parameter's
dtype; each chunk's product is rounded to that dtype first (autograd's), so a bf16 weight's
gradient is rounded once per chunk where the unchunked GEMM rounds once.
"""

from __future__ import annotations

import hashlib
import threading

import torch
import torch.fx as fx

_SUBGRAPHS: dict[str, fx.GraphModule] = {}
_LOCK = threading.Lock()


def register(gm: fx.GraphModule) -> str:
    """The key `token_chunks` runs `gm` under: a digest of its code, which holds every
    constant (the pass admits no tensor constants), so equal subgraphs share one entry."""
    key = hashlib.sha256(gm.code.encode()).hexdigest()[:16]
    with _LOCK:
        _SUBGRAPHS.setdefault(key, gm)
    return key


def _autograd_bits() -> int:
    """The dispatch keys a custom op's kernel runs with autograd excluded by (what
    torch._C._AutoDispatchBelowAutograd adds to the thread's excluded set)."""
    outside = torch._C._dispatch_tls_local_exclude_set().raw_repr()
    with torch._C._AutoDispatchBelowAutograd():
        inside = torch._C._dispatch_tls_local_exclude_set().raw_repr()
    return inside & ~outside


_AUTOGRAD_BITS = _autograd_bits()


def _autograd_on():
    """A guard under which autograd records again inside this op's kernel: the backward
    differentiates one chunk's recomputed forward, and a custom op's kernel runs below
    autograd (the op's own formula is what autograd sees from outside)."""
    exclude = torch._C._dispatch_tls_local_exclude_set().raw_repr() & ~_AUTOGRAD_BITS
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C.DispatchKeySet.from_raw_repr(exclude))


def _subgraph(key: str) -> fx.GraphModule:
    try:
        return _SUBGRAPHS[key]
    except KeyError:
        raise RuntimeError(f"megatrain::token_chunks: no subgraph registered under {key!r}; the "
                           f"compiled graph comes from a cache of a process that ran the pass, "
                           f"this one did not") from None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as [1, ..., 1, tokens, features], its rank kept: the subgraph was traced at that
    rank, and its reductions may name a dimension by index."""
    return x.reshape(*([1] * (x.dim() - 2)), -1, x.shape[-1])


def _spans(tokens: int, chunk: int):
    for start in range(0, tokens, chunk):
        yield start, min(start + chunk, tokens)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    """Autocast to `dtype` on `device`, or off where `dtype` is None."""
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def run_in_chunks(x: torch.Tensor, params: list[torch.Tensor], key: str, chunk: int) -> list[torch.Tensor]:
    """What the pass's node calls: `token_chunks` under the autocast of the trace (read
    here, while AOTAutograd traces, and handed to the op, whose kernel runs outside it)."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return token_chunks(x, params, key, chunk, dtype)


def _outputs(y) -> tuple[torch.Tensor, ...]:
    return tuple(y) if isinstance(y, (tuple, list)) else (y,)


@torch.library.custom_op("megatrain::token_chunks", mutates_args=())
def token_chunks(x: torch.Tensor, params: list[torch.Tensor], key: str, chunk: int,
                 autocast: torch.dtype | None) -> list[torch.Tensor]:
    """The subgraph `key`'s outputs on `x`'s tokens, `chunk` at a time (the same as one
    call), under `autocast` (a dtype, or None: off)."""
    gm = _subgraph(key)
    rows = _rows(x)
    tokens = rows.shape[-2]
    outs = None
    with torch.no_grad(), _autocast(x.device, autocast):
        for start, end in _spans(tokens, chunk):
            ys = _outputs(gm(rows[..., start:end, :], *params))
            if outs is None:
                outs = [y.new_empty(*y.shape[:-2], tokens, y.shape[-1]) for y in ys]
            for out, y in zip(outs, ys):
                out[..., start:end, :] = y
        if outs is None:  # no tokens: the subgraph on none of them gives the outputs' widths
            outs = list(_outputs(gm(rows, *params)))
    return [out.reshape(*x.shape[:-1], out.shape[-1]) for out in outs]


@token_chunks.register_fake
def _(x, params, key, chunk, autocast):
    with _autocast(x.device, autocast):
        return list(_outputs(_subgraph(key)(x, *params)))


@torch.library.custom_op("megatrain::token_chunks_backward", mutates_args=())
def token_chunks_backward(grads: list[torch.Tensor], x: torch.Tensor, params: list[torch.Tensor], key: str,
                          chunk: int, autocast: torch.dtype | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """d loss / d x and d loss / d params of `token_chunks` given its outputs' gradients,
    recomputing one chunk's forward at a time. Parameter gradients sum over the chunks in
    fp32 (or their own dtype, if wider)."""
    gm = _subgraph(key)
    rows, grad_rows = _rows(x), [_rows(g) for g in grads]
    tokens = rows.shape[-2]
    grad_x = torch.empty_like(rows)
    sums = [torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device)
            for p in params]
    with _autograd_on(), torch.enable_grad(), _autocast(x.device, autocast):
        leaves = [p.detach().requires_grad_() for p in params]
        for start, end in _spans(tokens, chunk):
            xc = rows[..., start:end, :].detach().requires_grad_()
            ys = _outputs(gm(xc, *leaves))
            grad_xc, *pieces = torch.autograd.grad(ys, [xc, *leaves], [g[..., start:end, :] for g in grad_rows],
                                                   allow_unused=True)
            grad_x[..., start:end, :] = grad_xc
            for total, g in zip(sums, pieces):
                if g is not None:
                    total += g
    return grad_x.reshape(x.shape), [s.to(p.dtype) for s, p in zip(sums, params)]


@token_chunks_backward.register_fake
def _(grads, x, params, key, chunk, autocast):
    return torch.empty_like(x), [torch.empty_like(p) for p in params]


def _setup_context(ctx, inputs, output):
    x, params, key, chunk, autocast = inputs
    ctx.save_for_backward(x, *params)
    ctx.key, ctx.chunk, ctx.autocast = key, chunk, autocast
    ctx.shapes = [(o.shape, o.dtype) for o in output]


def _backward(ctx, grads):
    x, *params = ctx.saved_tensors
    # an output the loss does not reach has no gradient: zeros stand in
    grads = [g.contiguous() if g is not None else x.new_zeros(shape, dtype=dtype)
             for g, (shape, dtype) in zip(grads, ctx.shapes)]
    grad_x, grad_params = token_chunks_backward(grads, x, params, ctx.key, ctx.chunk, ctx.autocast)
    return grad_x, grad_params, None, None, None


token_chunks.register_autograd(_backward, setup_context=_setup_context)


def reference(gm: fx.GraphModule, x: torch.Tensor, params) -> list[torch.Tensor]:
    """What `token_chunks` computes: the subgraph on every token at once."""
    return list(_outputs(gm(x, *params)))


__all__ = ["reference", "register", "run_in_chunks", "token_chunks", "token_chunks_backward"]
