"""Which megatrain.AdamW owns a parameter, so the backend can hand it gradients directly."""

from __future__ import annotations

import weakref

from .protocol import GradientConsumer

_OWNER: dict[int, weakref.ref] = {}


def register(params, optimizer: GradientConsumer) -> None:
    """``optimizer`` owns ``params`` from now on. A previous owner keeping some of them on
    the device (updates="resident") brings their newest values home first."""
    assert isinstance(optimizer, GradientConsumer), type(optimizer)
    params = list(params)
    previous: dict[int, tuple] = {}
    for p in params:
        old = owner_of(p)
        if old is not None and old is not optimizer:
            previous.setdefault(id(old), (old, []))[1].append(p)
    for old, ps in previous.values():
        old.drop_resident(ps)
    ref = weakref.ref(optimizer)
    for p in params:
        _OWNER[id(p)] = ref
        weakref.finalize(p, _OWNER.pop, id(p), None)


def owner_of(p) -> GradientConsumer | None:
    ref = _OWNER.get(id(p))
    return ref() if ref is not None else None


def sole_owner(params) -> GradientConsumer | None:
    """The one optimizer owning all of ``params``; None where they have several owners or
    none."""
    owners = {id(o): o for o in map(owner_of, params)}
    return next(iter(owners.values())) if len(owners) == 1 else None


def by_owner(params) -> list[tuple[GradientConsumer, list]]:
    """``params`` grouped by the optimizer that owns them, in first-seen order; parameters
    no optimizer owns are left out."""
    groups: dict[int, tuple] = {}
    for p in params:
        opt = owner_of(p)
        if opt is not None:
            groups.setdefault(id(opt), (opt, []))[1].append(p)
    return list(groups.values())
