"""Input checks for the host AdamW: each names the offending value and says how to fix it.

Kept apart from the optimizer so the hot path reads as arithmetic, and so every message is
written once. Checks cost O(number of tensors), never a pass over their elements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

Namer = Callable[[Tensor], str]

# Group keys torch.optim.AdamW stores; megatrain.AdamW stores them too so state_dicts move
# both ways. The ones below must keep these values: the host kernel implements no other.
UNSUPPORTED_FLAGS = {"amsgrad": False, "maximize": False, "differentiable": False}


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_hyperparameters(group: dict, where: str) -> None:
    """lr, betas, eps and weight_decay of one group (or of the defaults)."""
    lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if isinstance(lr, Tensor) or not _is_number(lr) or not lr >= 0.0:
        raise ValueError(
            f"{where}: lr must be a non-negative Python float, got {lr!r} "
            "(a tensor lr is not supported by the host optimizer; pass float(lr))"
        )
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(_is_number(b) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"{where}: betas must be two floats in [0, 1), got {betas!r}")
    if not _is_number(eps) or not eps >= 0.0:
        raise ValueError(f"{where}: eps must be a non-negative float, got {eps!r}")
    if not _is_number(wd) or not wd >= 0.0:
        raise ValueError(f"{where}: weight_decay must be a non-negative float, got {wd!r}")
    for key, allowed in UNSUPPORTED_FLAGS.items():
        if group.get(key, allowed) != allowed:
            raise ValueError(
                f"{where}: {key}={group[key]!r} is not supported by megatrain.AdamW; "
                f"set {key}={allowed} (or use torch.optim.AdamW for this group)"
            )


def check_options(max_grad_norm: object, skip_nonfinite: object, threads: object) -> None:
    if max_grad_norm is not None and (
        not _is_number(max_grad_norm) or not (0.0 < max_grad_norm < math.inf)
    ):
        raise ValueError(
            f"max_grad_norm must be None or a positive finite float, got {max_grad_norm!r}"
        )
    if not isinstance(skip_nonfinite, bool):
        raise TypeError(f"skip_nonfinite must be a bool, got {skip_nonfinite!r}")
    if threads is not None and (
        not isinstance(threads, int) or isinstance(threads, bool) or threads < 1
    ):
        raise ValueError(f"threads must be None or a positive int, got {threads!r}")


def check_no_duplicates(params: Sequence[object], seen: set[int], where: str) -> None:
    """Raise on a tensor listed twice in ``params`` or already in ``seen`` (ids)."""
    local: set[int] = set()
    for i, p in enumerate(params):
        t = p[1] if isinstance(p, tuple) and len(p) == 2 else p
        name = f" '{p[0]}'" if t is not p else ""
        if id(t) in local or id(t) in seen:
            raise ValueError(
                f"{where}: parameter{name} at index {i} is listed twice "
                f"(shape {tuple(getattr(t, 'shape', ()))}); each parameter must appear in "
                "exactly one param group once (deduplicate, e.g. tied weights, "
                "with list(dict.fromkeys(params)))"
            )
        local.add(id(t))


def check_param(p: Tensor, name: str) -> None:
    """A parameter the host optimizer can own: a dense real fp32 CPU tensor."""
    if p.layout != torch.strided:
        raise TypeError(f"{name} has layout {p.layout}; megatrain.AdamW needs dense parameters")
    if p.is_complex():
        raise TypeError(
            f"{name} is {p.dtype}; megatrain.AdamW keeps real fp32 master weights: store it "
            "as a real tensor with torch.view_as_real and a trailing dimension of 2"
        )
    if p.dtype != torch.float32:
        raise TypeError(
            f"{name} is {p.dtype}; megatrain.AdamW keeps fp32 master weights on the host: "
            "call model.float() before building the optimizer (megatrain computes in bf16 "
            "on the GPU from the fp32 master)"
        )
    if p.device.type != "cpu":
        raise ValueError(
            f"{name} is on {p.device}; megatrain.AdamW keeps parameters in host memory: "
            "leave the model on the CPU (the megatrain backend moves weights to the GPU)"
        )


# fp32, or the runtime's 16-bit gradients, upcast exactly by functional.adamw_.
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_grad(g: object, p: Tensor, name: str, device: torch.device | None = None) -> None:
    """A gradient for parameter ``p``: a dense tensor of p's shape, fp32 or 16-bit, in host
    memory (``submit``/``step``) or on ``device`` (``submit_on_device``)."""
    if not isinstance(g, Tensor):
        raise TypeError(f"gradient for {name} must be a Tensor, got {type(g).__name__}")
    if g.layout != torch.strided:
        raise TypeError(
            f"gradient for {name} is sparse ({g.layout}); megatrain.AdamW needs dense "
            "gradients: use nn.Embedding(sparse=False) or convert with grad.to_dense()"
        )
    if g.dtype not in GRAD_DTYPES:
        raise TypeError(
            f"gradient for {name} is {g.dtype}; pass fp32 (or bf16/fp16, upcast exactly "
            "inside the update) gradients: grad.float()"
        )
    if device is None and g.device.type != "cpu":
        raise ValueError(
            f"gradient for {name} is on {g.device}; copy it to host memory first"
        )
    if device is not None and g.device != device:
        raise ValueError(
            f"gradient for {name} is on {g.device}, but submit_on_device(..., "
            f"device={str(device)!r}) updates there; pass the gradient on that device "
            "(submit() takes host gradients)"
        )
    if g.shape != p.shape:
        raise ValueError(
            f"gradient for {name} has shape {tuple(g.shape)}, the parameter "
            f"{tuple(p.shape)}; pass one gradient per parameter, in the same order"
        )


def region_members(
    params: Sequence[Tensor], grads: Sequence[object], owned: Callable[[Tensor], bool],
    namer: Namer, api: str = "submit",
) -> Iterator[tuple[Tensor, object]]:
    """The (param, grad) pairs of one ``api(params, grads)`` call, checked to be matching
    lists of distinct parameters this optimizer owns."""
    if len(params) != len(grads):
        raise ValueError(
            f"{api}() got {len(params)} parameters and {len(grads)} gradients; "
            "pass one gradient per parameter"
        )
    seen: set[int] = set()
    for i, (p, g) in enumerate(zip(params, grads)):
        if not isinstance(p, Tensor) or not owned(p):
            shape = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
            raise ValueError(
                f"{api}(): params[{i}] ({shape}) is not managed by this optimizer; "
                "add it with add_param_group() or pass the model's own parameters"
            )
        if id(p) in seen:
            raise ValueError(
                f"{api}(): {namer(p)} appears twice in one region; sum its gradients first"
            )
        seen.add(id(p))
        yield p, g


def check_region(
    params: Sequence[Tensor], grads: Sequence[object], owned: Callable[[Tensor], bool], namer: Namer
) -> None:
    """One ``submit`` call: matching lists of distinct owned parameters and their grads."""
    for p, g in region_members(params, grads, owned, namer):
        if not grad_ok(g, p):
            check_grad(g, p, namer(p))


def grad_ok(g: object, p: Tensor) -> bool:
    """The fast form of :func:`check_grad` (no message built), for the hot path."""
    return (
        isinstance(g, Tensor)
        and g.dtype in GRAD_DTYPES
        and g.is_cpu
        and g.layout == torch.strided
        and g.shape == p.shape
    )


def check_piece(p: object, start: object, g: object, owned: Callable[[Tensor], bool], namer: Namer) -> None:
    """One ``submit_pieces`` item: an owned contiguous parameter, an aligned start, and a
    1-D host gradient piece that stays inside the parameter."""
    from .functional import PIECE_ALIGN

    if not isinstance(p, Tensor) or not owned(p):
        shape = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
        raise ValueError(f"submit_pieces(): a parameter ({shape}) is not managed by this optimizer")
    name = namer(p)
    if not p.is_contiguous():
        raise ValueError(f"submit_pieces(): {name} is not contiguous; use submit() for it")
    if not isinstance(g, Tensor) or g.dim() != 1 or g.layout != torch.strided:
        raise TypeError(f"submit_pieces(): the piece for {name} must be a 1-D dense tensor")
    if g.dtype not in GRAD_DTYPES or not g.is_cpu:
        raise TypeError(f"submit_pieces(): the piece for {name} is {g.dtype} on {g.device}; "
                        "pass fp32 (or bf16/fp16) pieces in host memory")
    if not isinstance(start, int) or start < 0 or start % PIECE_ALIGN:
        raise ValueError(f"submit_pieces(): start={start!r} for {name} must be a multiple of "
                         f"{PIECE_ALIGN} (so pieces round like the whole tensor)")
    if start + g.numel() > p.numel() or g.numel() == 0:
        raise ValueError(f"submit_pieces(): a piece of {g.numel()} elements from {start} does "
                         f"not fit {name} ({p.numel()} elements)")
