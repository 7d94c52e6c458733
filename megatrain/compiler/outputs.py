"""The consent option ``outputs="loss"``: a training graph hands back its scalars only.

By default every tensor a graph returns comes back to the CPU with its values, like eager.
For a Hugging Face causal LM called with labels that includes the [tokens, vocab] logits:
megatrain must make them, copy them to the host every step (a gigabyte of bf16 at a
32k vocabulary and 16k tokens) and cannot fuse the loss with the linear that produces
them, since the logits themselves are asked for. A training loop reads only the loss.

With ``outputs="loss"`` a graph that returns at least one 0-dim tensor (the loss, an
auxiliary loss) returns those with their values, and each of its other tensor outputs as a
meta tensor: the same shape, dtype and ``requires_grad``, no data, so reading it raises
("Cannot copy out of meta tensor") instead of handing back something made up. A graph
with no 0-dim output (an evaluation without labels) and a graph that ends at a graph
break (its outputs are the live values of the Python code that resumes after it) return
everything, as without the option.

The dropped outputs leave dynamo's graph before anything else looks at it, so the
pattern pass sees logits used by the loss alone and the partitioner drops what only they
needed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

OUTPUTS = ("all", "loss")


@dataclass(frozen=True)
class Dropped:
    """Where the dropped outputs were and what they looked like, to put meta stand-ins back."""

    width: int                                           # outputs dynamo expects
    kept: tuple[int, ...]                                # positions the compiled graph returns
    stand_ins: dict[int, tuple[torch.Size, torch.dtype, bool]]  # position -> shape, dtype, grad


def _value(node) -> torch.Tensor | None:
    v = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def drop_non_scalar_outputs(gm: fx.GraphModule) -> Dropped | None:
    """Edit ``gm`` (dynamo's graph) to return only its 0-dim tensor outputs and the
    non-tensor ones; None where it keeps every output (see the module docstring)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and reason.graph_break:
        return None
    output = gm.graph.find_nodes(op="output")[0]
    outs = output.args[0]
    if not isinstance(outs, (tuple, list)):
        return None
    values = [_value(o) for o in outs]
    if not any(v is not None and v.dim() == 0 for v in values):
        return None
    drop = {i: (v.shape, v.dtype, v.requires_grad) for i, v in enumerate(values)
            if v is not None and v.dim() > 0}
    if not drop:
        return None
    kept = tuple(i for i in range(len(outs)) if i not in drop)
    output.args = (type(outs)(outs[i] for i in kept),)
    gm.graph.lint()
    gm.recompile()
    return Dropped(width=len(outs), kept=kept, stand_ins=drop)


def with_stand_ins(compiled: Callable, dropped: Dropped) -> Callable:
    """``compiled``'s outputs at their old positions, meta stand-ins at the dropped ones.
    The arguments pass through as given (boxed or not), and ``compiled``'s attributes
    (AOTAutograd's ``zero_grad``, ``named_parameters``, ``serialize``) are kept."""

    @functools.wraps(compiled)
    def run(*args):
        got = compiled(*args)
        out: list = [None] * dropped.width
        for i, v in zip(dropped.kept, got):
            out[i] = v
        for i, (shape, dtype, grad) in dropped.stand_ins.items():
            out[i] = torch.empty(shape, dtype=dtype, device="meta").requires_grad_(grad)
        return out

    return run
