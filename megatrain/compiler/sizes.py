"""Byte counts of fake tensors, symbolic sizes resolved to their current hints."""

from __future__ import annotations

import torch


def hint(x) -> int:
    if isinstance(x, torch.SymInt):
        node = x.node
        if node.hint is not None:
            return int(node.hint)
        return int(node.shape_env.size_hint(node.expr))
    return int(x)


def tensor_nbytes(val: torch.Tensor) -> int:
    n = 1
    for s in val.shape:
        n *= hint(s)
    return n * val.element_size()
