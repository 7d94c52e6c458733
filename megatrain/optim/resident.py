"""AdamW state that stays on the compute device between steps (``updates="resident"``).

Why: where the host's memory bandwidth bounds the step (~38 B/param of host memory traffic
per step can take longer at DRAM rates than the step's compute on the device), moving bytes
between host and device cannot help much: a device-site update
(device_update.py) still reads and writes master, m and v in host memory, by DMA. A
parameter whose fp32 master, m and v live on the device costs no host memory traffic, no
link bytes and ~0.1 ms of device time per step: its weight fetch is a cast on the device,
its update runs in stream order when its gradient is handed off. The planner spends on it
only the device memory the plan leaves free (compiler/update_sites.py), 12 B/param.

The host copy is the authority at rest, the device copy while training:

- ``adopt``: master, m, v (zeros at step 0, as the host path would create them) and the
  step count are copied to the device; the host's ``p._version`` is remembered.
- ``update``: the same fused kernel as every other path (functional.adamw_) on the device
  tensors, with the group's hyperparameters read now; the host copy is now stale. A
  gradient not in fp32 (the runtime's bf16) is upcast into the runtime's scratch piece by
  piece (at most UPCAST_PIECE elements, 64 MiB: the scratch does not grow with the
  largest parameter), each piece updated right after its upcast; the step count moves
  once, before the first piece, and pieces round like the whole tensor (``update``).
- ``accumulate`` / ``pending``: where the update must wait (micro-batches under
  ``accumulate()``, clipping, the non-finite check) the gradient is summed into a device
  buffer the runtime lends (as the host path sums into ``p.grad``), and ``AdamW.step()``
  takes its norm beside the host's and applies it there.
- ``drop`` (``AdamW.synchronize()``, pickling; a host path touching the
  parameter; the runtime's demotion): the device values are copied into the host
  parameter and host state, which are current again (a waiting gradient becomes
  ``p.grad``), and the device copies are freed; the runtime adopts the host's values
  afresh at the region's next fetch. So anything written on the host after ``synchronize()`` (``p.data`` included,
  which no version counter sees; moments, steps) is what training continues from. Read or
  write parameters directly only after ``synchronize()`` (the rule deferred updates
  already impose, AdamW's docstring). A host write that bumps ``p._version`` while the
  device holds newer values raises, saying to call ``synchronize()`` first.
- ``flush`` (the runtime, before another graph fetches the parameter from the host;
  ``AdamW.state_dict()``; a module's ``state_dict()``, optim/module_reads.py): the host
  copy made current, the device copy kept.
- ``drop_for_load`` (``load_state_dict``): the newest weights come home unless the host
  parameter was written since (a model state_dict loaded first), moments are replaced.

Numbers: on the CPU (CI) the very same kernel runs on separate CPU tensors, so results are
bitwise those of the host path. On CUDA the fused kernel rounds like the device-site
update (a few ulp per step from the CPU's; tests/gpu/test_resident_cuda.py holds the two
device paths bitwise equal).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import functional
from ..memory.host_store import host_zeros_like

# Per tensor: the caching allocator rounds every block up to 512 bytes; the step count.
_BLOCK = 512
# The most elements of a low-precision gradient upcast (into the runtime's fp32 scratch:
# 64 MiB) and applied in one fused call; a larger parameter is updated piece by piece. A
# multiple of functional.PIECE_ALIGN (the CPU kernel's pieces round like the whole tensor)
# and of CUDA's multi_tensor_apply chunk (65536 elements: the kernel's blocks cover the
# same elements, aligned alike, as for the whole tensor). Large enough that the two
# launches per piece cost little beside its memory traffic (~0.1 ms on a current GPU).
UPCAST_PIECE = 1 << 24


def upcast_scratch_numel(numels: Iterable[int]) -> int:
    """Elements of the fp32 scratch the runtime upcasts gradients of parameters of
    ``numels`` elements into: the largest, at most UPCAST_PIECE."""
    return min(UPCAST_PIECE, max(numels, default=0))


def resident_bytes(shapes: Sequence[Sequence[int]]) -> int:
    """Device bytes that making parameters of ``shapes`` resident holds (three fp32
    tensors and a step count each, rounded up to the allocator's 512-byte blocks)."""
    return sum(3 * (-(-4 * math.prod(shape) // _BLOCK) * _BLOCK) + _BLOCK for shape in shapes)


def sharing_groups(regions: dict[int, list[int]]) -> dict[int, frozenset[int]]:
    """Per region, the regions that share a parameter with it, transitively, itself
    included (a tied embedding's two regions): resident together or not at all, since a
    parameter's state lives once."""
    owner: dict[int, int] = {}
    parent = {r: r for r in regions}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for r, pids in regions.items():
        for p in pids:
            if p in owner:
                parent[find(r)] = find(owner[p])
            else:
                owner[p] = r
    members: dict[int, set[int]] = {}
    for r in regions:
        members.setdefault(find(r), set()).add(r)
    return {r: frozenset(members[find(r)]) for r in regions}


def group_bytes(regions: dict[int, list[int]], params: list) -> tuple[int, dict[int, int]]:
    """(device bytes of the state of the parameters of ``regions``, each once; per region
    holding a parameter another of them holds too, the bytes of the fp32 buffer laid out
    like the region that its gradient pieces wait in, as the runtime lends them)."""
    pids = list(dict.fromkeys(p for ps in regions.values() for p in ps))
    state = resident_bytes([params[p].shape for p in pids])
    count: dict[int, int] = {}
    for ps in regions.values():
        for p in set(ps):
            count[p] = count.get(p, 0) + 1
    return state, {r: 4 * sum(params[p].numel() for p in ps) for r, ps in regions.items()
                   if any(count[p] > 1 for p in ps)}


@dataclass
class _Entry:
    master: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: Tensor
    host_version: int  # p._version when the host copy was last current
    dirty: bool = False  # the device holds values the host has not seen
    updated: Any = None  # CUDA event after the last update (None on the CPU)
    # The gradient kept on the device where the update must wait (micro-batches under
    # accumulate(), clipping, the non-finite check): a buffer the runtime lends for good,
    # whether it holds this step's sum, and whether that sum is final (step() applies it).
    grad: Tensor | None = None
    has_grad: bool = False
    pending: bool = False


class ResidentState:
    """Per optimizer: the parameters whose AdamW state is on the device."""

    def __init__(self) -> None:
        self._entries: dict[Tensor, _Entry] = {}

    def __contains__(self, p: Tensor) -> bool:
        return p in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @torch.no_grad()
    def adopt(self, state: dict, p: Tensor, device: torch.device) -> None:
        """Copy ``p``'s master, moments and step to ``device`` (state created as the host
        path would: zero moments, step 0)."""
        st = state[p]
        on = lambda t: t.detach().to(device, torch.float32, copy=True).contiguous()  # noqa: E731
        if st:
            m, v, step = on(st["exp_avg"]), on(st["exp_avg_sq"]), on(st["step"])
        else:  # created where they live (no host zeros to upload); the host's at the flush
            m, v = (torch.zeros(p.shape, dtype=torch.float32, device=device) for _ in range(2))
            step = torch.zeros((), dtype=torch.float32, device=device)
        self._entries[p] = _Entry(on(p), m, v, step, p._version)

    def master(self, p: Tensor, describe) -> Tensor:
        """The device master of ``p`` for a weight fetch, uploaded again if the host copy
        was written (a version bump) since the adoption. Raises where both sides changed."""
        e = self._entries[p]
        if p._version != e.host_version:
            self._refuse_if_newer(p, e, describe)
            with torch.no_grad():
                e.master.copy_(p.detach())
            e.host_version = p._version
        return e.master

    @staticmethod
    def _refuse_if_newer(p: Tensor, e: _Entry, describe) -> None:
        if e.dirty:
            raise RuntimeError(
                f"megatrain.AdamW: {describe(p)} was written on the host while its newest "
                "value lived on the device (updates='resident'): call opt.synchronize() "
                "before reading or writing parameters directly")

    def ready_event(self, p: Tensor) -> Any:
        return self._entries[p].updated

    @torch.no_grad()
    def update(self, params: Sequence[Tensor], grads: Sequence[Tensor], hyper: dict[str, float],
               scratch: Tensor | None = None) -> None:
        """One AdamW step of ``params`` on their device state, on the current stream.
        ``grads``: on the device, the params' shapes. One in fp32 and contiguous (like the
        master) is read where it is; any other is upcast into ``scratch`` (fp32, reused in
        stream order) piece by piece, each piece's update right after its upcast. Every
        step count moves once, before any piece (each piece's kernel reads it for the bias
        correction), and a parameter is cut only at multiples of PIECE_ALIGN, so results
        are bitwise those of one call on the whole upcast gradient (AdamW is elementwise;
        functional.adamw_at_step_)."""
        entries = [self._entries[p] for p in params]
        if not entries:
            return
        grads = list(grads)
        direct = [_in_place(g) for g in grads]
        if not all(direct):
            _check_scratch(scratch, [e.master for e, d in zip(entries, direct) if not d])
        torch._foreach_add_([e.step for e in entries], 1)
        pick = [(e, g) for e, g, d in zip(entries, grads, direct) if d]
        functional.adamw_at_step_(
            [e.master for e, _ in pick], [g for _, g in pick], [e.exp_avg for e, _ in pick],
            [e.exp_avg_sq for e, _ in pick], [e.step for e, _ in pick], **hyper)
        for e, g, d in zip(entries, grads, direct):
            if d:
                continue
            master, m, v = (t.view(-1) for t in (e.master, e.exp_avg, e.exp_avg_sq))
            for start, k in _pieces(master.numel(), scratch):
                functional.adamw_at_step_(
                    [master[start:start + k]], [_flat_range(scratch[:k], g, start)],
                    [m[start:start + k]], [v[start:start + k]], [e.step], **hyper)
        event = None
        device = entries[0].master.device
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        for e in entries:
            e.dirty, e.updated = True, event

    # -- gradients that wait on the device ------------------------------------------------
    def needs_buffers(self, params: Sequence[Tensor]) -> bool:
        return any(self._entries[p].grad is None for p in params)

    def give_buffers(self, params: Sequence[Tensor], buffers: Sequence[Tensor]) -> None:
        for p, b in zip(params, buffers):
            self._entries[p].grad = b

    def has_grads(self, params: Sequence[Tensor]) -> bool:
        return any(self._entries[p].has_grad for p in params)

    @torch.no_grad()
    def accumulate(self, p: Tensor, grad: Tensor, scratch: Tensor | None = None) -> Tensor:
        """Sum ``grad`` into ``p``'s device buffer like autograd into p.grad (copy when
        empty, else add: the host path's bits); returns the sum. A ``grad`` not in fp32
        and contiguous is copied (upcasting is exact), or added from ``scratch`` piece by
        piece as ``update`` reads it."""
        e = self._entries[p]
        if not e.has_grad:
            e.grad.copy_(grad)
            e.has_grad = True
        elif _in_place(grad):
            e.grad.add_(grad)
        else:
            _check_scratch(scratch, [e.grad])
            flat = e.grad.view(-1)
            for start, k in _pieces(flat.numel(), scratch):
                flat[start:start + k].add_(_flat_range(scratch[:k], grad, start))
        return e.grad

    def mark_pending(self, params: Sequence[Tensor]) -> None:
        for p in params:
            self._entries[p].pending = True

    def pending(self) -> dict[Tensor, Tensor]:
        """Final gradients waiting for step(), by parameter."""
        return {p: e.grad for p, e in self._entries.items() if e.pending}

    def clear_grads(self, params: Sequence[Tensor] | None = None) -> None:
        """Applied, or dropped by zero_grad()."""
        for p in list(self._entries) if params is None else params:
            e = self._entries[p]
            e.has_grad = e.pending = False

    @torch.no_grad()
    def flush(self, state: dict, params: Sequence[Tensor] | None = None, describe=repr) -> None:
        """Copy newer device values into the host parameters and state; raises where the
        host parameter was written meanwhile (which of the two is right is unknowable)."""
        for p in list(self._entries) if params is None else params:
            e = self._entries.get(p)
            if e is None or not e.dirty:
                continue
            if p._version != e.host_version:
                self._refuse_if_newer(p, e, describe)
            if e.updated is not None:
                e.updated.synchronize()
            st = state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = host_zeros_like(p)
                st["exp_avg_sq"] = host_zeros_like(p)
            p.detach().copy_(e.master)
            st["exp_avg"].copy_(e.exp_avg)
            st["exp_avg_sq"].copy_(e.exp_avg_sq)
            st["step"].copy_(e.step)
            e.dirty, e.host_version = False, p._version

    def drop(self, state: dict, params: Sequence[Tensor] | None = None, describe=repr) -> None:
        """Stop keeping ``params`` (default all) on the device, newer values flushed to the
        host first; the device copies are freed once nothing queued can read them."""
        params = list(self._entries) if params is None else [p for p in params if p in self._entries]
        self.flush(state, params, describe)
        self._free(params)

    @torch.no_grad()
    def drop_for_load(self, params: Sequence[Tensor] | None = None) -> None:
        """Before ``load_state_dict`` replaces the moments and steps: keep the newest
        weights (an optimizer state_dict holds none) unless the host parameter was written
        since (a model state_dict loaded first: the host's then win); free the rest."""
        params = list(self._entries) if params is None else [p for p in params if p in self._entries]
        for p in params:
            e = self._entries[p]
            if e.dirty and p._version == e.host_version:
                if e.updated is not None:
                    e.updated.synchronize()
                p.detach().copy_(e.master)
        self._free(params)

    @torch.no_grad()
    def _grads_home(self, params: list[Tensor]) -> None:
        """A gradient summed on the device and not applied yet continues on the host path
        as ``p.grad`` (where that path would have summed it)."""
        for p in params:
            e = self._entries[p]
            if e.has_grad:
                g = e.grad.to("cpu", copy=True)
                p.grad = g if p.grad is None else p.grad.add_(g)
                e.has_grad = e.pending = False

    def _free(self, params: list[Tensor]) -> None:
        self._grads_home(params)
        devices = {self._entries[p].master.device for p in params}
        for device in devices:
            if device.type == "cuda":
                # a fetch on a copy stream may still read a master: no block of theirs may
                # return to the allocator (and be reused) before it is done
                torch.cuda.synchronize(device)
        for p in params:
            del self._entries[p]


def _in_place(grad: Tensor) -> bool:
    """Whether the update reads ``grad`` where it is: fp32, laid out like the master."""
    return grad.dtype == torch.float32 and grad.is_contiguous()


def _check_scratch(scratch: Tensor | None, masters: list[Tensor]) -> None:
    if scratch is None or scratch.dtype != torch.float32 or not scratch.is_contiguous() or any(
            t.device != scratch.device for t in masters):
        raise ValueError("megatrain.AdamW: a resident gradient not in fp32 laid out like its "
                         "parameter needs an fp32 scratch on the device to be upcast into")
    if any(t.numel() > scratch.numel() for t in masters) and scratch.numel() < functional.PIECE_ALIGN:
        raise ValueError(f"megatrain.AdamW: an upcast scratch of {scratch.numel()} elements "
                         f"cannot hold a piece of {functional.PIECE_ALIGN}")


def _pieces(numel: int, scratch: Tensor) -> list[tuple[int, int]]:
    """(start, elements) of the pieces a tensor of ``numel`` elements is updated in: one,
    if the scratch holds it; else cut at multiples of PIECE_ALIGN (rounding like the whole)."""
    if numel <= scratch.numel():
        return [(0, numel)] if numel else []
    size = scratch.numel() // functional.PIECE_ALIGN * functional.PIECE_ALIGN
    return [(start, min(size, numel - start)) for start in range(0, numel, size)]


def _flat_range(out: Tensor, t: Tensor, start: int) -> Tensor:
    """``out.copy_(t.reshape(-1)[start:start + out.numel()])`` (returned) without the copy
    of all of ``t`` that reshape makes of a non-contiguous ``t``: whole rows at once, the
    partial first and last rows recursively."""
    k = out.numel()
    if k == 0:
        return out
    if t.is_contiguous() or t.dim() <= 1:
        return out.copy_(t.reshape(-1)[start:start + k])
    row = t[0].numel()
    i, end, pos = start // row, start + k, 0
    if start % row:
        pos = min(k, row - start % row)
        _flat_range(out[:pos], t[i], start % row)
        i += 1
    full = end // row - i
    if pos < k and full > 0:
        out[pos:pos + full * row].view(full, *t.shape[1:]).copy_(t[i:i + full])
        pos, i = pos + full * row, i + full
    if pos < k:
        _flat_range(out[pos:], t[i], 0)
    return out
