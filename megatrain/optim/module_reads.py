"""A model's ``state_dict()`` reads the newest values, wherever megatrain.AdamW holds them.

The optimizer may hold a parameter's newest value away from the tensor the model holds:
an update still queued on its host worker (``step()`` returns before deferred updates run)
or master and moments kept on the compute device (resident regions, optim/resident.py).
``module.state_dict()`` is how users and libraries read a model (checkpoints, evaluation
harnesses, Hugging Face's ``save_pretrained``), so every module holding a parameter the
backend streams gets a state_dict pre-hook that first makes the owning optimizer's values
current: queued updates applied, resident values copied home (the device copies stay, so
training goes on without re-uploading them). The one rule left for users: read or write
``p.data`` / ``model.parameters()`` directly only after ``opt.synchronize()``.

Why a scan of the collector's objects: the backend is handed tensors, not modules (dynamo
lifts parameters to graph inputs; its sources name an attribute path, not the root object),
so the modules holding a parameter are found among the modules the garbage collector
tracks, by their ``_parameters``. Done once per compiled graph, for all its parameters at
once: one listing of the tracked objects, cheaper than ``gc.get_referrers``, which walks
every container's contents once per call.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from .registry import by_owner

_hooked: weakref.WeakKeyDictionary[nn.Module, object] = weakref.WeakKeyDictionary()


def holders(params: Iterable[torch.Tensor]) -> list[nn.Module]:
    """The modules whose own ``_parameters`` hold any of ``params``."""
    ids = {id(p) for p in params}
    if not ids:
        return []
    # type() rather than isinstance(): isinstance reads ``__class__``, which some library
    # objects answer with a deprecation warning
    return [o for o in gc.get_objects()
            if issubclass(type(o), nn.Module)
            and any(id(v) in ids for v in (vars(o).get("_parameters") or {}).values())]


def keep_state_dict_current(params: Iterable[torch.Tensor]) -> int:
    """Hook every module holding one of ``params`` (once per module); returns how many
    modules were newly hooked."""
    new = 0
    for module in holders(params):
        if module not in _hooked:
            _hooked[module] = module.register_state_dict_pre_hook(_make_current)
            new += 1
    return new


def _make_current(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """state_dict pre-hook: the owners' pending updates of this module's own parameters
    done and their resident values copied home."""
    for opt, ps in by_owner(p for p in module._parameters.values() if p is not None):
        opt.wait_params(ps)
        opt.flush_resident(ps)
