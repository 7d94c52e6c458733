"""Which megatrain.AdamW owns a parameter, so the backend can hand it gradients directly."""

from __future__ import annotations

import weakref

_OWNER: dict[int, weakref.ref] = {}


def register(params, optimizer) -> None:
    ref = weakref.ref(optimizer)
    for p in params:
        _OWNER[id(p)] = ref
        weakref.finalize(p, _OWNER.pop, id(p), None)


def owner_of(p):
    ref = _OWNER.get(id(p))
    return ref() if ref is not None else None
