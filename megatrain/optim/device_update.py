"""One region's AdamW step on the compute device instead of the host, and when to choose it.

Where a region's update runs is a planner choice. The host update reads
and writes fp32 master, m and v in host memory (~28 bytes per parameter of host memory
traffic). The device update moves the same three tensors over PCIe instead (12 bytes per
parameter each way), runs the same kernel on the device and writes the results back:

    host (pinned) master, m, v --H2D stream--> device buffer [master | m | v]  (one region)
    compute stream: grads ready (event) --+
                                          v
    update stream: wait(copied in, grads ready); upcast 16-bit grads; steps += 1;
                   torch._fused_adamw_ per param group   (megatrain.optim.functional.adamw_)
    D2H stream:    wait(updated); device buffer --> host master, m, v   (event: copied back)
    waiter thread: wait(updated) -> let the gradients go; wait(copied back) -> free the
                   device buffer, resolve the handle (a Future)

The host master, m and v must not be read or written by anyone from the call until the
copy back has completed; the optimizer's worker tracks the handle like one of its own tasks,
so ``AdamW.wait_params`` (the runtime calls it before it fetches the region again),
``step()``, ``synchronize()`` and ``state_dict()`` wait for it. On ``device="cpu"`` (CI) the
very same code runs with plain copies on the waiter thread, so the update is asynchronous
there too and results are bitwise those of the host path (the same kernel on the same
device; a 16-bit gradient upcast whole is bitwise the host path's chunked upcast).

Numbers: step counts and hyperparameters exactly as the host path (the step is incremented
once, when the update is enqueued; lr, betas, eps, weight_decay are read from the param
group at the call, like ``submit``). On CUDA the fused kernel rounds differently from the CPU
one (FMA contraction, another operation order), a few ulp per step; see
tests/gpu/test_device_update_cuda.py.

Memory: device bytes per region = 12 per parameter (the buffer, 64-element aligned per
tensor) + 4 per parameter whose gradient is not fp32 (the upcast) + 4 per tensor (steps);
:func:`device_bytes` estimates it for the planner, ``handle.device_bytes`` reports it. On
CUDA, m and v are moved once into page-locked host memory of their own (one buffer per
region holding m then v, so they cross the link as one copy), page-locked in place like the
host store's masters (not torch's pinned allocator, which rounds up to a power of two).

The decision (:func:`update_site`): a pure cost model over the probed ``Rates``; see its
docstring for a worked example and what it picks there.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from megatrain.plan.costs import ADAMW_BYTES_PER_PARAM, DEVICE_LINK_BYTES, host_bandwidth
from megatrain.optim import checks, functional
from megatrain.memory.host_store import host_zeros, is_page_locked, page_locked
from megatrain.memory.layout import FlatLayout

if TYPE_CHECKING:
    from megatrain.plan.costs import Rates

Site = Literal["host", "device"]

# ---- the cost model -------------------------------------------------------------------

# Host memory bytes per parameter of the host update (fused AdamW: 7 x fp32), and the
# bandwidth the probe's AdamW reached: the planner's cost model, one definition for both.
HOST_UPDATE_BYTES = ADAMW_BYTES_PER_PARAM
# The device update moves master, m and v (fp32) each way over PCIe (DEVICE_LINK_BYTES,
# costs.py) and the DMA engines read those 12 bytes from host memory and write 12 back: host
# memory traffic too, charged at the same bandwidth (a conservative assumption: DRAM may
# serve DMA beyond what 16 cores reach, which would only favour the device).
DEVICE_HOST_BYTES = 24
# Fixed cost of one device update, seconds: a few copy launches, one upcast per 16-bit
# gradient, one fused kernel per param group, events, a thread wake-up (an estimate, not a
# measurement; it only keeps tiny regions on the host: ~0.2 M parameters of transfer time).
DEVICE_UPDATE_OVERHEAD_S = 50e-6


@dataclass(frozen=True)
class PhaseLoad:
    """Bytes other work puts, during the phase the update runs in (normally the backward),
    on each PCIe direction and on host memory (CPU and DMA traffic alike)."""

    h2d: float = 0.0
    d2h: float = 0.0
    host: float = 0.0

    def __add__(self, other: "PhaseLoad") -> "PhaseLoad":
        return PhaseLoad(self.h2d + other.h2d, self.d2h + other.d2h, self.host + other.host)

    @classmethod
    def streaming(cls, params: int, weight_bytes: int = 4) -> "PhaseLoad":
        """Fetching ``params`` parameters' weights at ``weight_bytes`` each (the runtime
        DMAs fp32 masters, 4, and casts on the device): link H2D and the DMA's reads."""
        return cls(h2d=params * weight_bytes, host=params * weight_bytes)

    def seconds(self, rates: "Rates") -> float:
        """The phase's bound from these bytes: the slower of the link and host memory."""
        return max(link_seconds(rates, self.h2d, self.d2h), self.host / host_bandwidth(rates))


def link_seconds(rates: "Rates", h2d: float, d2h: float) -> float:
    """Each direction at most its own rate, both together at most the duplex rate."""
    return max(h2d / rates.h2d, d2h / rates.d2h, (h2d + d2h) / rates.duplex)


def update_load(region_params: int, site: Site, grad_bytes: int = 2) -> PhaseLoad:
    """What updating ``region_params`` parameters at ``site`` adds to the phase. The host
    update needs the gradient on the host (``grad_bytes`` per parameter D2H, and their DMA
    write); the device update replaces that with master, m and v both ways."""
    n = region_params
    if site == "host":
        return PhaseLoad(d2h=n * grad_bytes, host=n * (HOST_UPDATE_BYTES + grad_bytes))
    if site == "device":
        return PhaseLoad(h2d=n * DEVICE_LINK_BYTES, d2h=n * DEVICE_LINK_BYTES,
                         host=n * DEVICE_HOST_BYTES)
    raise ValueError(f"site must be 'host' or 'device', got {site!r}")


def device_bytes(region_params: int, grad_bytes: int = 2, tensors: int = 0) -> int:
    """Device memory one device update holds while in flight: master, m, v in fp32, the
    fp32 upcast of 16-bit gradients, the step counts (64-element alignment not counted)."""
    upcast = 4 if grad_bytes != 4 else 0
    return region_params * (DEVICE_LINK_BYTES + upcast) + 4 * tensors


def held_bytes(shapes: Sequence[Sequence[int]]) -> int:
    """Device bytes the megatrain runtime holds for one region's device update, exactly:
    the region's gradients gathered as fp32 in one flat buffer (it copies each gradient
    there as it is produced, because Inductor reuses a gradient's memory right after the
    hand-off), plus what :meth:`DeviceUpdater.launch` allocates for fp32 contiguous
    gradients (master, m, v laid out flat, no upcast, the step counts). About 16 bytes per
    parameter, like :func:`device_bytes` with 16-bit gradients."""
    grads = FlatLayout.of(shapes).numel
    return 4 * (grads + FlatLayout.of(list(shapes) * 3).numel + len(shapes))


def update_seconds(region_params: int, rates: "Rates", site: Site, *,
                   load: PhaseLoad = PhaseLoad(), grad_bytes: int = 2) -> float:
    """The phase's bound once this region's update runs at ``site``."""
    t = (load + update_load(region_params, site, grad_bytes)).seconds(rates)
    return t + (DEVICE_UPDATE_OVERHEAD_S if site == "device" and region_params else 0.0)


def update_site(region_params: int, rates: "Rates", *, load: PhaseLoad = PhaseLoad(),
                grad_bytes: int = 2, device_free_bytes: int | None = None) -> Site:
    """Where one region's AdamW should run: ``"device"`` when that ends the phase sooner.

    The phase (the backward, where updates overlap compute) is bounded by the slower of
    two resources, the PCIe link and host memory; ``load`` is what else uses them then
    (the weight fetches: :meth:`PhaseLoad.streaming`; updates already placed). Host update:
    28 B/param of host memory (what ``Rates.adamw`` measures) plus the 16-bit gradient's
    D2H (2 B/param) and its DMA write. Device update: 12 B/param H2D + 12 B/param D2H at
    the probed one-way and both-at-once rates, 24 B/param of host DMA traffic, and a
    fixed ~50 us. Ties, and regions whose device buffers would not fit in
    ``device_free_bytes``, stay on the host. Pure: same inputs, same answer; a faster link
    never moves a region to the host, faster host memory never moves one to the device.

    A worked example at plan/costs.py's default CUDA rates: pinned H2D 55 GB/s, D2H 55 GB/s,
    both at once ~90 GB/s; host fused AdamW 3.8 G params/s = 106 GB/s (faster host memory
    runs it at up to ~125 GB/s). Per parameter, with the region's own fp32 weight fetch in
    the phase (4 B H2D, 4 B DMA):

    - host:   link max(4/55, 2/55, 6/90) = 0.073 ns; host memory (4+28+2)/106 = 0.320 ns
    - device: link max(16/55, 12/55, 28/90) = 0.311 ns; host memory (4+24)/106 = 0.263 ns

    so ``update_site`` picks "device" at 106 GB/s (0.311 < 0.320 ns/param, 3% better) and
    "host" at 125 GB/s (0.272 ns/param < 0.311): one region alone is a toss-up within the
    spread of host rates, because the device update saves host memory only 6 of its 34 B/param
    (its DMA is host memory traffic too) while adding 22 B/param to the link. What pays is
    the mix: host memory is the backward's bottleneck and the link has room, so placing
    regions one by one against the running load (:func:`assign_sites`) puts 68-82% of the
    parameters on the device and lowers the backward's transfer floor by 12-15%: for 28
    layers of 100 M parameters (a 3B model) the model gives 0.89 s all-host, 0.87 s
    all-device, 0.77 s mixed (23 of 28 on the device) at 106 GB/s; 0.76, 0.87, 0.67 s
    (19 of 28) at 125 GB/s.
    Tiny regions stay on the host (below ~3 M parameters the fixed cost decides).
    """
    if region_params < 0:
        raise ValueError(f"region_params must be >= 0, got {region_params!r}")
    need = device_bytes(region_params, grad_bytes)
    if device_free_bytes is not None and need > device_free_bytes:
        return "host"
    host = update_seconds(region_params, rates, "host", load=load, grad_bytes=grad_bytes)
    device = update_seconds(region_params, rates, "device", load=load, grad_bytes=grad_bytes)
    return "device" if device < host else "host"


def assign_sites(region_params: Sequence[int], rates: "Rates", *, load: PhaseLoad = PhaseLoad(),
                 grad_bytes: int = 2, device_free_bytes: int | None = None,
                 ) -> tuple[list[Site], PhaseLoad]:
    """:func:`update_site` region by region (in the order given: the backward's), each
    against the load of those placed before it. Returns the sites and the phase's load."""
    sites: list[Site] = []
    for n in region_params:
        site = update_site(n, rates, load=load, grad_bytes=grad_bytes,
                           device_free_bytes=device_free_bytes)
        sites.append(site)
        load = load + update_load(n, site, grad_bytes)
    return sites, load


# ---- the mechanism --------------------------------------------------------------------

MOMENTS = ("exp_avg", "exp_avg_sq")


def resolve_device(device: Any) -> torch.device:
    """``device`` as a torch.device with an index (CUDA), or a ValueError naming it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"submit_on_device(): device={device!r} is not a device ({e})") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"submit_on_device(): device={device!r} but CUDA is not available; use "
                "submit() (host update), or device='cpu' to run the device path on the CPU"
            )
        return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    raise ValueError(
        f"submit_on_device(): device={device!r}: device updates run on 'cuda' (or on 'cpu', "
        "the same code with plain copies, for tests)"
    )


def check_region(params: Sequence[Any], grads: Sequence[Any], device: torch.device,
                 owned, namer) -> None:
    """One ``submit_on_device`` call: distinct owned parameters the update can copy as flat
    memory (contiguous; page-locked on CUDA), and their gradients on ``device``."""
    for p, g in checks.region_members(params, grads, owned, namer, api="submit_on_device"):
        name = namer(p)
        if not p.is_contiguous():
            raise ValueError(
                f"submit_on_device(): {name} is not contiguous (strides {p.stride()}); the "
                "device update copies parameters as flat memory (the megatrain backend homes "
                "streamed parameters contiguously): use submit() for this parameter"
            )
        if device.type == "cuda" and not is_page_locked(p):
            raise ValueError(
                f"submit_on_device(): {name} is not in page-locked host memory, which the "
                "non-blocking copies need: home it with megatrain.memory.host_store."
                "home_parameters(params, pin=True) (the megatrain backend does this for the "
                "parameters it streams), or use submit()"
            )
        checks.check_grad(g, p, name, device)


def ensure_state(state: dict, params: Sequence[Tensor], pin: bool) -> None:
    """Give ``params`` AdamW state the device update can copy: created when missing (step
    0, zero moments, as the host path would), and moved (values unchanged) when a moment
    is not contiguous or, with ``pin``, not page-locked. Moved or new moments of one call
    share one buffer laid out like the region (every m, then every v), so they cross the
    link as one copy. Runs once per parameter in practice; the host path uses the result
    as it is."""
    todo = [
        p for p in params
        if not state[p]
        or not all(state[p][k].is_contiguous() for k in MOMENTS)
        or (pin and not all(is_page_locked(state[p][k]) for k in MOMENTS))
    ]
    if not todo:
        return
    layout = FlatLayout.of([p.shape for p in todo] * 2)
    lock = None
    if pin:
        buf, lock = page_locked(layout.numel, torch.float32, users=2 * len(todo))
    else:
        buf = host_zeros(layout.numel, torch.float32)
    views = layout.views(buf)
    k = len(todo)
    with torch.no_grad():
        for i, p in enumerate(todo):
            st = state[p]
            m, v = views[i], views[k + i]
            if st:
                m.copy_(st["exp_avg"])
                v.copy_(st["exp_avg_sq"])
            else:
                st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"], st["exp_avg_sq"] = m, v
            if lock is not None:
                weakref.finalize(m, lock.drop)
                weakref.finalize(v, lock.drop)


def _follows(run: Tensor, t: Tensor) -> bool:
    """``t`` starts in memory exactly where the 1-D ``run`` ends."""
    return (
        t.dtype == run.dtype
        and t.is_contiguous()
        and t.untyped_storage().data_ptr() == run.untyped_storage().data_ptr()
        and t.data_ptr() == run.data_ptr() + run.numel() * run.element_size()
    )


def copy_runs(tensors: Sequence[Tensor], layout: FlatLayout) -> list[tuple[int, int, Tensor]]:
    """(offset in the device buffer, numel, 1-D host view) copies that cover exactly
    ``tensors``: neighbours back to back both in host memory and in ``layout`` share one
    copy. Never padding: the copy back must not write host memory outside the region's own
    tensors (another parameter may live there and be updated meanwhile)."""
    runs: list[tuple[int, int, Tensor]] = []
    for t, off in zip(tensors, layout.offsets):
        n = t.numel()
        if n == 0:
            continue
        if runs:
            o, k, run = runs[-1]
            if o + k == off and _follows(run, t):
                runs[-1] = (o, k + n, run.as_strided((k + n,), (1,), run.storage_offset()))
                continue
        runs.append((off, n, t.view(-1)))
    return runs


class DeviceUpdateHandle(Future):
    """A Future that resolves (to None) once the updated master, m and v are back in host
    memory and the device buffers are freed; it carries the error if the update failed.

    Attributes for the runtime: ``params``; ``device``; ``numel`` (parameters updated);
    ``device_bytes`` (device memory held until the handle resolves, for pool accounting);
    on CUDA ``updated`` (event: the kernel ran, the gradients are no longer read) and
    ``copied_back`` (event on the D2H stream: the host copies are complete; a stream may
    ``wait_event`` it instead of the host waiting). Cannot be cancelled."""

    def __init__(self, params: Sequence[Tensor], device: torch.device, numel: int, nbytes: int):
        super().__init__()
        self.params = tuple(params)
        self.device = device
        self.numel = numel
        self.device_bytes = nbytes
        self.updated = None
        self.copied_back = None

    def cancel(self) -> bool:
        return False


@dataclass
class _Job:
    """Everything one update needs, built on the caller's thread."""

    device: torch.device
    layout: FlatLayout  # [master..., m..., v...] in the device buffer
    runs: list  # copy_runs of the host master, m, v
    grads: list  # device gradients, in params order
    groups: list  # (indices into params, hyper) per param group
    old_steps: Tensor  # fp32 [k], the steps before this update (page-locked on CUDA)
    k: int


class DeviceUpdater:
    """Per optimizer: default streams per device and one waiter thread that runs the CPU
    path and, on CUDA, waits for each update's events (in issue order) to free its device
    memory and resolve its handle."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="megatrain-device-update")
        self._streams: dict[torch.device, tuple] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, self._executor.shutdown, wait=False)

    def streams(self, device: torch.device) -> tuple:
        """(H2D, D2H, update) streams of ``device``, created on first use."""
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = tuple(torch.cuda.Stream(device) for _ in range(3))
            return s

    def launch(self, state: dict, params: list[Tensor], grads: list[Tensor],
               groups: list[tuple[list[int], dict[str, float]]], device: torch.device,
               copy_streams: Sequence[Any] | None = None, ready: Any = None) -> DeviceUpdateHandle:
        """Enqueue the update of ``params`` (state made ready here); see the module
        docstring. The host step counts are incremented once the update is enqueued."""
        cuda = device.type == "cuda"
        h2d = d2h = upd = None
        if cuda:
            h2d, d2h, upd = self.streams(device)
            if copy_streams is not None:
                h2d, d2h = _check_streams(copy_streams, device)
        elif copy_streams is not None or ready is not None:
            raise ValueError(
                "submit_on_device(): copy_streams and ready are CUDA streams/events; pass "
                "neither with device='cpu'"
            )
        if not params:
            handle = DeviceUpdateHandle((), device, 0, 0)
            handle.set_result(None)
            return handle
        ensure_state(state, params, pin=cuda)
        k = len(params)
        hosts = [p.detach() for p in params]
        hosts += [state[p]["exp_avg"] for p in params] + [state[p]["exp_avg_sq"] for p in params]
        layout = FlatLayout.of([p.shape for p in params] * 3)
        steps = [state[p]["step"] for p in params]
        old_steps = torch.stack([s.detach().reshape(()).float() for s in steps])
        if cuda:
            old_steps = old_steps.pin_memory()
        numel = sum(p.numel() for p in params)
        upcast = sum(g.numel() for g in grads if g.dtype != torch.float32 or not g.is_contiguous())
        handle = DeviceUpdateHandle(params, device, numel, 4 * (layout.numel + upcast + k))
        job = _Job(device, layout, copy_runs(hosts, layout), grads, groups, old_steps, k)
        if cuda:
            if ready is None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(device))
            with torch.cuda.device(device):
                updated, copied, first, second = _execute(job, h2d, upd, d2h, ready)
            handle.updated, handle.copied_back = updated, copied
            del job
            torch._foreach_add_(steps, 1)
            self._executor.submit(_finish_cuda, handle, updated, copied, first, second)
        else:
            torch._foreach_add_(steps, 1)
            self._executor.submit(_run_cpu, handle, job)
        return handle


def _check_streams(copy_streams: Sequence[Any], device: torch.device) -> tuple:
    streams = tuple(copy_streams)
    if len(streams) != 2 or not all(isinstance(s, torch.cuda.Stream) for s in streams):
        raise TypeError(
            "submit_on_device(): copy_streams must be (h2d_stream, d2h_stream), two "
            f"torch.cuda.Stream, got {copy_streams!r}"
        )
    for s in streams:
        if s.device != device:
            raise ValueError(f"submit_on_device(): copy stream {s} is on {s.device}, not {device}")
    return streams


def _on(stream: Any):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _event(stream: Any):
    """A blocking-sync event recorded on ``stream`` (the waiter thread sleeps on it rather
    than spinning a core the host optimizer's threads need); None on the CPU."""
    if stream is None:
        return None
    e = torch.cuda.Event(blocking=True)
    e.record(stream)
    return e


@torch.no_grad()
def _execute(job: _Job, h2d: Any, upd: Any, d2h: Any, ready: Any):
    """Copy in, update, copy back: on CUDA enqueued on the three streams (returns at once),
    on the CPU done in place. Returns (updated, copied back) events (None on the CPU) and
    what must stay alive until each: the gradients and small buffers, the device buffer."""
    cuda = job.device.type == "cuda"
    k = job.k
    with _on(h2d):
        dev = torch.empty(job.layout.numel, dtype=torch.float32, device=job.device)
        dev_steps = torch.empty(k, dtype=torch.float32, device=job.device)
        dev_steps.copy_(job.old_steps, non_blocking=cuda)
        for off, n, host in job.runs:
            dev[off:off + n].copy_(host, non_blocking=cuda)
        copied_in = _event(h2d)
    views = job.layout.views(dev)
    step_views = list(dev_steps.unbind(0))
    upcast: list[Tensor] = []
    with _on(upd):
        if cuda:
            upd.wait_event(copied_in)
            upd.wait_event(ready)
        for idx, hyper in job.groups:
            # Upcast and lay out like the buffer's views (contiguous; an expanded or
            # transposed gradient would be read as raw memory by the fused kernel).
            gs = [job.grads[i].to(torch.float32).contiguous() for i in idx]
            upcast += gs
            functional.adamw_(
                [views[i] for i in idx],
                gs,
                [views[k + i] for i in idx],
                [views[2 * k + i] for i in idx],
                [step_views[i] for i in idx],
                **hyper,
            )
        updated = _event(upd)
    with _on(d2h):
        if cuda:
            d2h.wait_event(updated)
        for off, n, host in job.runs:
            host.copy_(dev[off:off + n], non_blocking=cuda)
        copied = _event(d2h)
    first = [job.grads, upcast, dev_steps, step_views, job.old_steps]
    return updated, copied, first, [dev, views]


def _finish_cuda(handle: DeviceUpdateHandle, updated, copied, first: list, second: list) -> None:
    """Waiter thread: release the device memory in two stages, then resolve the handle."""
    try:
        updated.synchronize()
        first.clear()
        copied.synchronize()
        second.clear()
    except BaseException as e:  # noqa: BLE001 - the handle carries it to wait_params/step
        handle.set_exception(e)
        return
    handle.set_result(None)


def _run_cpu(handle: DeviceUpdateHandle, job: _Job) -> None:
    """Waiter thread, device='cpu': the whole update, then resolve the handle."""
    try:
        _execute(job, None, None, None, None)
    except BaseException as e:  # noqa: BLE001
        handle.set_exception(e)
        return
    handle.set_result(None)


__all__ = [
    "DEVICE_HOST_BYTES",
    "DEVICE_LINK_BYTES",
    "DEVICE_UPDATE_OVERHEAD_S",
    "HOST_UPDATE_BYTES",
    "DeviceUpdateHandle",
    "DeviceUpdater",
    "PhaseLoad",
    "assign_sites",
    "device_bytes",
    "held_bytes",
    "host_bandwidth",
    "link_seconds",
    "update_load",
    "update_seconds",
    "update_site",
]
