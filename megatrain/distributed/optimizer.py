"""ShardedAdamW: megatrain.AdamW for data parallelism, with the optimizer state split across
ranks (ZeRO stage 1/2 on the host).

Why a subclass and not ``megatrain.AdamW(..., process_group=...)``:

- The runtime needs nothing new: it finds a parameter's optimizer through the registry
  (``AdamW._reindex``) and calls ``submit(params, grads)`` per region and
  ``wait_params(params)`` before each fetch. A subclass is found the same way and
  ``isinstance(opt, megatrain.AdamW)`` still holds, so the backend takes the fast path.
- Its state has another shape (flat shards, not the parameter's shape) and another
  ``state_dict`` contract (per rank, plus a collective :meth:`full_state_dict`), and it needs
  a process group before it can exist: a different object, not a flag on the single-process
  one, whose hot path stays free of distributed branches (and of this file's changes).

Data flow of one step on rank r of N (each rank runs the same compiled model on its own
micro-batch; the parameters are full fp32 tensors on every rank, since each rank streams
the whole model to its own device):

1. The runtime submits a region's gradients from its hand-off thread. On the optimizer's
   host worker (one FIFO thread, so every rank issues its collectives in region order):
   pack the region rank-major (:mod:`.shards`), reduce-scatter, divide by N: rank r now
   holds the mean gradient of its shard of every parameter of the region.
2. AdamW on the shard: ``torch._fused_adamw_`` on views of the parameters' own elements,
   with m and v of shard size (the fp32 master is the parameter itself: every rank keeps
   the full fp32 weights to stream from, so a separate master shard would only add 4/N
   bytes per parameter).
3. All-gather the updated shards into every rank's parameters. This ends the worker's task
   for the region, and ``wait_params`` (called by the runtime before it prefetches the
   region in the next step) waits for exactly that task: no rank reads a region's weights
   before they hold every rank's update.

Host bytes per parameter per rank: 4 (the fp32 weights) + 8 / N (m, v) instead of 12, plus
two region-sized scratch buffers for the collectives. Communication per step: a
reduce-scatter and an all-gather of the fp32 parameters (with the all-reduce fallback of a
backend without reduce-scatter, one all-reduce instead of the reduce-scatter).

All collectives run on a process group of the optimizer's own (created at construction,
which every rank must therefore reach in the same order), issued only by the worker thread:
they cannot interleave with the user's collectives on the default group. A rank that dies
makes the others raise :class:`~megatrain.distributed.RankFailureError` (from ``backward``,
``wait_params``/the next forward, or ``step``) within the group's timeout instead of hanging.

Deferred paths, as in megatrain.AdamW: inside ``with opt.accumulate():`` gradients are
summed locally into ``p.grad`` (no communication, like DDP's ``no_sync``) and reduced with
the last micro-batch; with ``max_grad_norm``/``skip_nonfinite`` each region is still reduced
during backward, its mean gradient shard is kept (4 / N bytes per parameter) and ``step()``
takes the global norm with one all-reduce, then queues update + all-gather region by region
in the next forward's fetch order and returns (as megatrain.AdamW does: each fetch waits for
its own region; ``synchronize()`` for all). Gradients left in ``p.grad`` (no backend) are
reduced by ``step()`` in buckets, in param-group order, and updated before it returns.

Numerics: the mean gradient differs from a single process's gradient of the same global
batch only by summation order (~1e-7 relative); the update is then the same kernel on the
same values. Clipping uses the global 2-norm of the mean gradient, summed in float64 over
the shards (not bitwise ``clip_grad_norm_``, equal to rounding).
"""

from __future__ import annotations

import contextlib
import datetime
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from megatrain.optim import checks, functional
from megatrain.optim.adamw import AdamW
from megatrain.memory.host_store import host_zeros, is_homed

from .comm import Collectives, as_timedelta, backend_takes_cpu_tensors
from .launch import default_timeout
from .shards import RegionLayout, ShardSpec, new_row, own_view, region_tag

_SHARDING_KEY = "megatrain_sharding"


@dataclass
class _Kept:
    """A reduced region waiting for step(): its mean-gradient shards in ``row``."""

    params: list[Tensor]
    layout: RegionLayout
    row: Tensor
    submitted: bool  # came from submit() (the backend), not from p.grad in step()


class ShardedAdamW(AdamW):
    """``megatrain.AdamW`` whose state is sharded over the ranks of a process group, for
    data-parallel training (see the module docstring for the data flow and memory).

    Use it exactly like megatrain.AdamW, on every rank, after
    ``torch.distributed.init_process_group`` (or :func:`megatrain.distributed.init_from_env`
    under torchrun), with the same model on every rank::

        info = megatrain.distributed.init_from_env()          # torchrun env -> gloo / nccl
        opt = megatrain.ShardedAdamW(model.parameters(), lr=3e-4)
        step = torch.compile(model, backend="megatrain", options={"device": str(info.device)})
        for ids, labels in my_shard_of_the_data:               # each rank its own batch
            step(ids, labels=labels).backward(); opt.step(); opt.zero_grad()

    Gradients are averaged over ranks (like DDP), so the loss of each rank should be its
    micro-batch's mean; the result equals one process training on the union of the batches.

    Args (besides megatrain.AdamW's):
        process_group: the ranks to shard over (default: all). With ``None`` the optimizer
            creates its own group over all ranks (a collective: construct it on every rank
            in the same order); a group passed in is used as is and must not carry other
            collectives while the optimizer works.
        timeout: seconds (or a timedelta) a collective may wait for a peer before failing;
            default ``$MEGATRAIN_DIST_TIMEOUT`` or torch's process-group default.
        sync_params: broadcast rank 0's parameters to all ranks at construction (like DDP),
            so that ranks seeded differently still start equal.
        comm_device: where collectives run; default the backend's choice (CPU for gloo,
            the current CUDA device for NCCL, staged through it in blocks).

    State: ``state_dict()`` is this rank's shard (with a ``"megatrain_sharding"`` entry);
    ``full_state_dict()`` (a collective) assembles the whole state, loadable by
    ``torch.optim.AdamW``, ``megatrain.AdamW`` or a ShardedAdamW of any size;
    ``load_state_dict`` takes either form.
    """

    bucket_numel = 1 << 25  # elements per collective for gradients in p.grad and state

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = False,
        threads: int | None = None,
        process_group=None,
        timeout: float | datetime.timedelta | None = None,
        sync_params: bool = True,
        comm_device: str | torch.device | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "megatrain.ShardedAdamW needs torch.distributed initialised first: call "
                "megatrain.distributed.init_from_env() (under torchrun) or "
                "torch.distributed.init_process_group(...); for one process use megatrain.AdamW"
            )
        td = as_timedelta(timeout) if timeout is not None else default_timeout()
        if process_group is None:
            process_group = dist.new_group(timeout=td)
        self._comm = Collectives(process_group, _comm_device(process_group, comm_device),
                                 None if td is None else td.total_seconds())
        self.world_size, self.rank = self._comm.world, self._comm.rank
        self._specs: dict[Tensor, ShardSpec] = {}
        self._layouts: dict[tuple[int, ...], RegionLayout] = {}
        self._deferred: list[_Kept] = []  # reduced, waiting for step(); appended by the worker
        self._scratch: dict[str, Tensor] = {}
        super().__init__(params, lr, betas, eps, weight_decay, max_grad_norm=max_grad_norm,
                         skip_nonfinite=skip_nonfinite, threads=threads)
        if sync_params:
            self._worker.submit(self._broadcast_params).result()

    # ---- the region API (called by the runtime) -------------------------------------

    def submit(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> Future:
        """Hand in one region's gradients (this rank's micro-batch). Every rank must submit
        the same regions in the same order; see megatrain.AdamW.submit for the rest."""
        params, grads = list(params), list(grads)
        checks.check_region(params, grads, self._where.__contains__, self._describe)
        for p in params:
            if p in self._final:
                raise ValueError(
                    f"submit(): {self._describe(p)} already received its last gradient for "
                    "this step; call opt.step() between steps, and run every micro-batch's "
                    "backward but the last inside `with opt.accumulate():`"
                )
        if self._accumulating:
            return self._worker.submit(self._accumulate_region, params, grads, False,
                                       touches=params)
        for p in params:
            self._final[p] = True  # reduced with this task: step() must not reduce p.grad
        hypers = None
        if self.max_grad_norm is None and not self.skip_nonfinite:
            hypers = {gi: self._hyper(self.param_groups[gi])
                      for gi in {self._where[p][0] for p in params}}
        return self._worker.submit(self._reduce_region, params, grads, hypers, True,
                                   touches=params)

    # ---- torch.optim.Optimizer ------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Wait for submitted work; reduce gradients still in ``p.grad`` (every rank must
        have them for the same parameters); clip/skip over the global mean gradient; update
        this rank's shards and all-gather them.

        Like megatrain.AdamW, when every kept gradient came region by region from the
        backend (clipping or the finiteness check), the updates and all-gathers are queued
        region by region in the next forward's fetch order and ``step()`` returns: each
        fetch waits for its own region (``synchronize()`` waits for all). Otherwise
        ``step()`` returns with the parameters updated."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        note = None
        try:
            self._worker.wait_all()
            work = self._pending_grads()
            ps = [p for gi in sorted(work) for p in work[gi][0]]
            gs = [g for gi in sorted(work) for g in work[gi][1]]
            for b in self._buckets([p.numel() for p in ps]):
                self._worker.submit(self._reduce_region, ps[b], gs[b], None, False,
                                    touches=ps[b])
            self._worker.wait_all()
            deferred, self._deferred = self._deferred, []
            if deferred:
                coef, note = self._worker.submit(self._global_norm, deferred).result()
                if note is None:
                    self._queue_updates(deferred, coef)
        except BaseException:
            with contextlib.suppress(Exception):
                self._worker.wait_all()  # let queued tasks end before the state is reset
            raise
        finally:
            self._final.clear()
            self._deferred = []
        if note:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Queued updates hold their own gradient shards: dropping p.grad need not wait.
        super().zero_grad(set_to_none)
        self._deferred = []  # reduced gradients not applied by a step go with p.grad

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            if not p.is_contiguous():
                self.param_groups.pop()
                self._reindex()
                raise ValueError(
                    f"{self._label(group, len(self.param_groups), i, p)} is not contiguous; "
                    "megatrain.ShardedAdamW updates a flat slice of each parameter in place: "
                    "make it contiguous first (p.data = p.data.contiguous())"
                )

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (m, v as flat shards), tagged with the sharding.
        Not a collective; see :meth:`full_state_dict` for a portable checkpoint."""
        sd = super().state_dict()
        sd[_SHARDING_KEY] = {"world_size": self.world_size, "rank": self.rank,
                             "split": "flat-even"}
        return sd

    def full_state_dict(self, to_rank: int | None = 0) -> dict[str, Any] | None:
        """The whole optimizer state, m and v in the parameters' shapes: the state_dict of
        an equivalent single-process AdamW. A collective (call it on every rank); returns
        the dict on group rank ``to_rank`` and None elsewhere (``to_rank=None``: on all)."""
        self._worker.wait_all()
        base = Optimizer.state_dict(self)
        full = self._worker.submit(self._gather_state, base["state"]).result()
        if to_rank is not None and self.rank != to_rank:
            return None
        return {"state": full, "param_groups": base["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state_dict (from :meth:`full_state_dict`, torch.optim.AdamW or
        megatrain.AdamW: each rank keeps its shard) or this rank's own :meth:`state_dict`."""
        self._worker.wait_all()
        sd = dict(state_dict)
        meta = sd.pop(_SHARDING_KEY, None)
        if meta is not None:
            if (meta.get("world_size"), meta.get("rank")) != (self.world_size, self.rank):
                raise ValueError(
                    f"this state_dict is rank {meta.get('rank')}'s shard of a "
                    f"{meta.get('world_size')}-rank run; this is rank {self.rank} of "
                    f"{self.world_size}. Load each rank's own shard, or save with "
                    "full_state_dict() to change the number of ranks"
                )
        else:
            params = [p for g in self.param_groups for p in g["params"]]
            state = {}
            for idx, st in sd.get("state", {}).items():
                if not (isinstance(idx, int) and 0 <= idx < len(params)):
                    state[idx] = st  # torch's own check reports it
                    continue
                p, st = params[idx], dict(st)
                spec = self._spec(p)
                for k in ("exp_avg", "exp_avg_sq"):
                    if k not in st:
                        continue
                    t = st[k]
                    if not isinstance(t, Tensor) or tuple(t.shape) != tuple(p.shape):
                        raise ValueError(
                            f"loaded {k} for {self._describe(p)} has shape "
                            f"{tuple(getattr(t, 'shape', ()))}; the state_dict belongs to a "
                            "different model"
                        )
                    st[k] = t.detach().reshape(-1)[spec.lo:spec.hi].to(torch.float32).clone()
                state[idx] = st
            sd["state"] = state
        super().load_state_dict(sd)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "megatrain.ShardedAdamW holds a process group and cannot be pickled or deep-copied; "
            "save its state with full_state_dict() (on every rank) and load_state_dict()"
        )

    # ---- introspection --------------------------------------------------------------

    def host_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (m, v shards and step counts)."""
        return sum(t.numel() * t.element_size() for st in self.state.values()
                   for t in st.values() if isinstance(t, Tensor))

    def shard_spec(self, p: Tensor) -> ShardSpec:
        """Which flat elements of ``p`` this rank owns."""
        return self._spec(p)

    # ---- internals (worker thread unless said otherwise) ----------------------------

    def _spec(self, p: Tensor) -> ShardSpec:
        spec = self._specs.get(p)
        if spec is None:
            spec = self._specs[p] = ShardSpec(p.numel(), self.world_size, self.rank)
        return spec

    def _layout(self, params: list[Tensor]) -> RegionLayout:
        key = tuple(id(p) for p in params)
        lay = self._layouts.get(key)
        if lay is None:
            order = [self._index(p) for p in params]
            lay = self._layouts[key] = RegionLayout([self._spec(p) for p in params],
                                                    region_tag(order))
        return lay

    def _index(self, p: Tensor) -> int:
        gi, i = self._where[p]
        return sum(len(g["params"]) for g in self.param_groups[:gi]) + i

    def _buf(self, name: str, n: int) -> Tensor:
        """A scratch buffer reused across regions (the worker runs one task at a time)."""
        t = self._scratch.get(name)
        if t is None or t.numel() < n:
            pin = self._comm.device.type == "cuda"
            t = self._scratch[name] = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        return t[:n]

    def _buckets(self, sizes: list[int]) -> list[slice]:
        """Consecutive runs of at most ``bucket_numel`` elements (or one larger tensor)."""
        out, start, total = [], 0, 0
        for i, n in enumerate(sizes):
            if i > start and total + n > self.bucket_numel:
                out.append(slice(start, i))
                start, total = i, 0
            total += n
        if start < len(sizes):
            out.append(slice(start, len(sizes)))
        return out

    def _where_str(self, params: list[Tensor]) -> str:
        first = self._describe(params[0])
        more = f" and {len(params) - 1} more" if len(params) > 1 else ""
        return f"{first}{more}"

    def _reduce_region(self, params: list[Tensor], grads: list[Tensor],
                       hypers: dict[int, dict[str, float]] | None, add_p_grad: bool) -> None:
        """Reduce-scatter one region's gradients (plus what earlier micro-batches left in
        p.grad); then update and all-gather at once (``hypers``), or keep the mean shard for
        step() (``hypers`` None: clipping, the finiteness check, or p.grad from step())."""
        if add_p_grad:
            grads = [p.grad.add_(g) if p.grad is not None else g for p, g in zip(params, grads)]
        lay = self._layout(params)
        send = self._buf("wide", self.world_size * lay.row)
        lay.pack_full(grads, send)
        row = self._buf("narrow", lay.row) if hypers is not None else new_row(lay)
        what = f"reduce-scatter of the gradients of {self._where_str(params)}"
        self._comm.reduce_scatter_sum(row, send, what)
        self._check_tag(lay, row, self.world_size * lay.tag, what)
        row[:-1].div_(self.world_size)
        if hypers is None:
            self._deferred.append(_Kept(params, lay, row, add_p_grad))
            return
        self._apply(params, lay, row, hypers, None)
        self._all_gather(params, lay)

    def _check_tag(self, lay: RegionLayout, row: Tensor, expected: float, what: str) -> None:
        try:
            lay.check_tag(row, expected, what)
        except RuntimeError as e:
            self._comm.failed = str(e).splitlines()[0][:300]  # later collectives refuse at once
            raise

    def _apply(self, params: list[Tensor], lay: RegionLayout, row: Tensor,
               hypers: dict[int, dict[str, float]], coef: Tensor | None) -> None:
        """AdamW on this rank's shards (mean gradients in ``row``)."""
        by_group: dict[int, tuple[list, list, list, list, list]] = {}
        empty_steps = []
        for p, g in zip(params, lay.own(row)):
            st = self._shard_state(p)
            if g.numel() == 0:
                empty_steps.append(st["step"])  # step counts stay equal on every rank
                continue
            lists = by_group.setdefault(self._where[p][0], ([], [], [], [], []))
            for lst, t in zip(lists, (own_view(p, self._spec(p)), g, st["exp_avg"],
                                      st["exp_avg_sq"], st["step"])):
                lst.append(t)
        if empty_steps:
            torch._foreach_add_(empty_steps, 1)
        if coef is not None:
            row[:-1].mul_(coef)
        for gi, (ps, gs, ms, vs, steps) in by_group.items():
            functional.adamw_(ps, gs, ms, vs, steps, **hypers[gi])

    def _shard_state(self, p: Tensor) -> dict[str, Tensor]:
        st = self.state[p]
        if not st:
            size = self._spec(p).size
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = host_zeros(size, torch.float32)
            st["exp_avg_sq"] = host_zeros(size, torch.float32)
        return st

    def _all_gather(self, params: list[Tensor], lay: RegionLayout) -> None:
        send = self._buf("narrow", lay.row)
        lay.pack_own([own_view(p, self._spec(p)) for p in params], send)
        rows = self._buf("wide", self.world_size * lay.row)
        what = f"all-gather of the updated {self._where_str(params)}"
        self._comm.all_gather(rows, send, what)
        tags = rows.view(self.world_size, -1)[:, -1]
        self._check_tag(lay, tags.sum().view(1), self.world_size * lay.tag, what)
        lay.unpack_full(rows, [p.detach() for p in params])

    def _global_norm(self, deferred: list[_Kept]) -> tuple[Tensor | None, str | None]:
        """Worker: the global 2-norm and finiteness of the kept mean-gradient shards, with
        one all-reduce; returns (clip coefficient or None, skip message or None)."""
        if self.max_grad_norm is None and not self.skip_nonfinite:
            return None, None
        sq = torch.zeros((), dtype=torch.float64)
        for kept in deferred:
            sq += functional.grad_norm(kept.row[:-1]).double() ** 2
        bad = 0.0
        if not bool(torch.isfinite(sq)):
            bad = float(any(not bool(torch.isfinite(k.row[:-1]).all()) for k in deferred))
        both = torch.stack([sq, torch.tensor(bad, dtype=torch.float64)])
        self._comm.all_reduce_sum(both, "all-reduce of the gradient norm")
        total = both[0].sqrt().float()
        if self.skip_nonfinite and float(both[1]) > 0:
            self.skipped_steps += 1
            return None, (
                "megatrain.ShardedAdamW: non-finite gradient (mean over "
                f"{self.world_size} ranks); step skipped on every rank, parameters and "
                "moments unchanged (lower the learning rate or check the loss scale if "
                "this repeats)"
            )
        coef = None
        if self.max_grad_norm is not None:
            self.last_grad_norm = total
            coef = functional.clip_coefficient(total, self.max_grad_norm)
            if coef.item() == 1.0:
                coef = None
        return coef, None

    def _queue_updates(self, deferred: list[_Kept], coef: Tensor | None) -> None:
        """Queue update + all-gather per kept region: regions from the backend last-
        submitted first (the next forward's fetch order, identical on every rank), then
        p.grad buckets. Wait unless every parameter is streamed by the backend."""
        hypers = {gi: self._hyper(g) for gi, g in enumerate(self.param_groups)}
        submitted = [k for k in deferred if k.submitted]
        order = submitted[::-1] + [k for k in deferred if not k.submitted]
        for k in order:
            self._worker.submit(self._apply_and_gather, k, hypers, coef, touches=k.params)
        if len(submitted) < len(deferred) or not all(
                is_homed(p) for k in submitted for p in k.params):
            self._worker.wait_all()

    def _apply_and_gather(self, kept: _Kept, hypers: dict[int, dict[str, float]],
                          coef: Tensor | None) -> None:
        self._apply(kept.params, kept.layout, kept.row, hypers, coef)
        self._all_gather(kept.params, kept.layout)

    def _broadcast_params(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        for b in self._buckets([p.numel() for p in params]):
            bps = params[b]
            flat = torch.cat([p.detach().reshape(-1) for p in bps])
            self._comm.broadcast(flat, 0, "broadcast of rank 0's initial parameters")
            off = 0
            for p in bps:
                p.detach().view(-1).copy_(flat[off:off + p.numel()])
                off += p.numel()

    def _gather_state(self, state: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        params = [p for g in self.param_groups for p in g["params"]]
        have = [i for i in sorted(state) if state[i]]
        out: dict[int, dict[str, Any]] = {}
        for b in self._buckets([params[i].numel() for i in have]):
            bidx = have[b]
            bps = [params[i] for i in bidx]
            lay = self._layout(bps)
            for key in ("exp_avg", "exp_avg_sq"):
                send = self._buf("narrow", lay.row)
                lay.pack_own([state[i][key] for i in bidx], send)
                rows = self._buf("wide", self.world_size * lay.row)
                self._comm.all_gather(rows, send, f"all-gather of the optimizer state ({key})")
                fulls = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in bps]
                lay.unpack_full(rows, fulls)
                for i, t in zip(bidx, fulls):
                    out.setdefault(i, {"step": state[i]["step"].clone()})[key] = t
        return out

    def _adopt_moments(self, p: Tensor, st: dict[str, Any]) -> None:
        """Loaded moments as this rank's flat shard."""
        size = self._spec(p).size
        for k in ("exp_avg", "exp_avg_sq"):
            if tuple(st[k].shape) != (size,):
                raise ValueError(
                    f"loaded {k} for {self._describe(p)} has shape {tuple(st[k].shape)}, "
                    f"this rank's shard has ({size},); the state_dict belongs to another "
                    "model or sharding"
                )
            st[k] = st[k].to(torch.float32).contiguous()


def _comm_device(group, comm_device) -> torch.device:
    if comm_device is not None:
        return torch.device(comm_device)
    if backend_takes_cpu_tensors(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
