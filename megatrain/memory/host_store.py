"""Host store: each region's own fp32 parameters in one contiguous (page-locked) buffer.

The user's `nn.Parameter` objects stay the same objects (their optimizers keep working);
only their `.data` is moved into the region buffer, laid out as the device buffer will be,
so a region is one host-to-device copy. Page-locked memory (CUDA only) is set up once: it
is slow to lock (~2-3 s per 4 GiB) and the only memory PCIe reads at full speed.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import mmap
import os
import weakref

import torch

from .layout import FlatLayout

_homed: set[int] = set()


def _forget(pid: int) -> None:
    _homed.discard(pid)


def is_homed(p: torch.Tensor) -> bool:
    return id(p) in _homed


def home_parameters(params: list[torch.nn.Parameter], pin: bool) -> torch.Tensor | None:
    """Move the not-yet-homed `params` into one new contiguous buffer; return it."""
    todo = [p for p in params if id(p) not in _homed]
    if not todo:
        return None
    dtypes = {p.dtype for p in todo}
    if len(dtypes) != 1:
        # Mixed dtypes in one region: give each dtype its own buffer.
        for dt in dtypes:
            home_parameters([p for p in todo if p.dtype == dt], pin)
        return None
    layout = FlatLayout.of([p.shape for p in todo])
    dtype = todo[0].dtype
    lock = None
    if pin:
        buf, lock = page_locked(layout.numel, dtype, users=len(todo))
    else:
        buf = host_zeros(layout.numel, dtype)
    with torch.no_grad():
        for p, view in zip(todo, layout.views(buf)):
            view.copy_(p.data)
            p.data = view
            _homed.add(id(p))
            weakref.finalize(p, _forget, id(p))
            if lock is not None:
                weakref.finalize(p, lock.drop)
    return buf


def host_memory() -> tuple[int, int] | None:
    """(available, total) bytes of host RAM now: psutil if importable, else /proc/meminfo;
    None where neither answers."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:
        pass
    fields = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    fields[key] = int(rest.split()[0]) * 1024
    except OSError:
        return None
    if len(fields) < 2:
        return None
    return fields["MemAvailable"], fields["MemTotal"]


# The host RAM megatrain leaves to everything else: an eighth of the host's, at least 2 GiB
# (the page cache, the data loader, the Python heap, other processes).
HOST_FREE_FRACTION = 1 / 8
HOST_FREE_MIN = 2 << 30


def host_margin(total: int) -> int:
    """Bytes of a host with ``total`` bytes of RAM that megatrain's defaults keep free."""
    return max(int(total * HOST_FREE_FRACTION), HOST_FREE_MIN)


def available_host_bytes() -> int | None:
    """Host RAM available now (None: unknown)."""
    mem = host_memory()
    return None if mem is None else mem[0]


# Host buffers from this size up get their own anonymous mapping on transparent huge pages.
HUGE_PAGE = 1 << 21
_HUGE_PAGES_ENV = "MEGATRAIN_HUGE_PAGES"


def huge_pages_enabled() -> bool:
    """Whether `host_zeros` advises huge pages: yes unless MEGATRAIN_HUGE_PAGES=0 (an A/B,
    or a host whose page compaction stalls allocations) or the platform has no THP."""
    return os.environ.get(_HUGE_PAGES_ENV, "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def host_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D host tensor for state streamed at DRAM speed every step (masters,
    moments, gradient slabs). From HUGE_PAGE bytes up it lives in a private anonymous
    mapping of its own, advised onto 2 MiB transparent huge pages, and starts on a 2 MiB
    boundary. Why: the host AdamW and the DMA stream these arrays every step, and torch's
    allocator leaves them on 4 KiB pages where THP is "madvise" (a common default): torch's
    fused CPU AdamW runs noticeably faster on huge pages (fewer TLB misses while streaming;
    bench/probe_rates.py times it on both).
    Why aligned: only whole aligned 2 MiB windows of a mapping can be huge pages, and
    where the kernel puts a mapping depends on its version and its length (a 3 MiB one
    holds no aligned window about half the time), so the mapping is one huge page longer
    than needed and the tensor starts at its first boundary; the unused head is never
    touched and costs no memory. The tensor's storage is exactly the tensor (torch.save
    writes no slack). The kernel's zero pages: nothing is written until first use."""
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or not huge_pages_enabled():
        return torch.zeros(numel, dtype=dtype)
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no room: torch's allocator fails the same way as without huge pages
        return torch.zeros(numel, dtype=dtype)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # a kernel without THP: ordinary pages, still zeroed
    start = (-torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()) % HUGE_PAGE
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=start)  # keeps it alive


_MADV_COLLAPSE = 25  # Linux 6.1+: back advised memory with huge pages now, in place


def advise_huge_pages(t: torch.Tensor) -> None:
    """Move the whole 2 MiB pages inside a contiguous host tensor that torch allocated
    (state loaded from a checkpoint) onto huge pages, in place: madvise MADV_HUGEPAGE,
    then MADV_COLLAPSE where the kernel has it (else khugepaged gets to them in its own
    time). Not a copy into `host_zeros`: a loaded state_dict stays referenced by its
    caller during the load, so a copy would hold the moments twice. Contents and
    addresses do not change; failures leave ordinary pages."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or not t.is_contiguous() or nbytes < HUGE_PAGE or not huge_pages_enabled():
        return
    lo = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    hi = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return
    libc = _libc()
    if libc is None:
        return
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_HUGEPAGE) == 0:
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_COLLAPSE)


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def host_zeros_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.zeros_like(t, dtype=dtype)` (same strides) for a host tensor, through
    `host_zeros` where `t` is contiguous."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return torch.zeros_like(t, dtype=dtype, memory_format=torch.preserve_format)
    return host_zeros(t.numel(), dtype or t.dtype).view(t.shape)


_PAGE = 4096
# (bytes, CUDA error code) of each page_locked() whose registration failed and fell back to
# torch's pinned allocator (which rounds up to a power of two): bench/train.py reports it.
register_failures: list[tuple[int, int]] = []


def page_locked(numel: int, dtype: torch.dtype, users: int) -> tuple[torch.Tensor, "_PageLock | None"]:
    """A zeroed host buffer whose pages belong to it alone, page-locked in place with
    cudaHostRegister. Why not `pin_memory=True`: torch's pinned allocator rounds every
    block up to a power of two and keeps it, so a 262 MB embedding would hold 512 MB of
    locked RAM (about +1 byte per parameter over a model). Whole pages of our own keep the
    registered range from overlapping anyone else's. Falls back to the pinned allocator if
    registering fails."""
    nbytes = numel * dtype.itemsize
    span = -(-max(nbytes, 1) // _PAGE) * _PAGE
    raw = host_zeros(span + _PAGE, torch.uint8)
    start = (-raw.data_ptr()) % _PAGE
    pages = raw[start:start + span]
    rc = int(torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), span, 0))
    if rc != 0:
        register_failures.append((nbytes, rc))
        return torch.zeros(numel, dtype=dtype, pin_memory=True), None
    return pages[:nbytes].view(dtype), _PageLock(pages.data_ptr(), span, users)


def page_locked_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`page_locked` for a buffer with one owner: the returned tensor; its pages are
    unlocked when it is collected (before its storage can be freed)."""
    buf, lock = page_locked(numel, dtype, users=1)
    if lock is not None:
        weakref.finalize(buf, lock.drop)
    return buf


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed host buffer that the DMA streams: page-locked (`page_locked_tensor`) where
    it copies to or from a CUDA device, else `host_zeros` (the CPU path and the tests)."""
    return page_locked_tensor(numel, dtype) if pin else host_zeros(numel, dtype)


def host_views(layout: FlatLayout, dtype: torch.dtype, pin: bool) -> list[torch.Tensor]:
    """`host_buffer` carved into `layout`'s views, for an owner that keeps only the views
    (AdamW's weight shadows): page-locked pages stay locked until the last view is
    collected. Why not `layout.views(host_buffer(...))`: `page_locked_tensor` unlocks when
    the flat tensor object is collected, which is as soon as the caller drops it, while the
    views still read the memory (every shadowed fetch then fell to the pageable host-cast
    path)."""
    if not pin:
        return layout.views(host_zeros(layout.numel, dtype))
    buf, lock = page_locked(layout.numel, dtype, users=len(layout.shapes))
    views = layout.views(buf)
    if lock is not None:
        for view in views:
            weakref.finalize(view, lock.drop)
    return views


def pinned_allocator_bytes() -> int:
    """Bytes torch's pinned allocator holds: blocks in use, cached, or freed with copies
    whose completion it has not checked yet (0 without CUDA)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()
            and hasattr(torch.cuda, "host_memory_stats")):
        return 0
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


def release_unused_pinned_blocks() -> None:
    """Give torch's cached, unused page-locked blocks back to the system. Why: Inductor's
    autotuner, benchmarking a backward kernel that writes one of its inputs where cloning
    the input on the device would raise the peak, parks it in a fresh block of torch's
    pinned allocator (triton_heuristics' copy_args_to_cpu_if_needed) and drops it, and that
    allocator keeps the block for the life of the process: a sizeable share of the host
    peak at long sequences (bench/train.py's watch of the allocator names the autotuner).
    The streamer calls this as each region's gradients leave during the first
    backward: the autotuner runs at a kernel's first launch, and given back then the
    block is gone before the optimizer's moments exist, so it does not add to the step's
    host peak. Not gated on the allocator's "active" bytes: a block freed with copies
    queued on it counts as active until an allocation or an empty-cache checks their
    events (so such a gate never fires in practice). Blocks whose copies have not
    completed are kept, so no sync is needed; with nothing to free, the empty-cache only
    queries those events."""
    if pinned_allocator_bytes() > 0:
        torch._C._host_emptyCache()


def release_cached_pinned_blocks(device: torch.device | None = None) -> None:
    """`release_unused_pinned_blocks` after a device sync (a block freed with copies still
    queued is reusable only once they complete) and a garbage collection (a block whose
    tensor only a reference cycle holds): the streamer's backstop at the end of the first
    backward. A block still in use after this can be held by a debugging aid, such as
    bench/train.py's watch of the allocator (it keeps the other threads' frames)."""
    if pinned_allocator_bytes() > 0:  # else nothing to give back: no sync, no collection
        torch.cuda.synchronize(device)
        gc.collect()
        release_unused_pinned_blocks()


_registered: dict[int, int] = {}  # start address -> end address of ranges page_locked() holds


def is_page_locked(t: torch.Tensor) -> bool:
    """Whether `t`'s bytes are page-locked, i.e. a copy from them runs at full PCIe speed
    and asynchronously. Ranges page_locked() registered count without asking torch: its
    `is_pinned()` need not recognise memory registered with cudaHostRegister."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    if any(lo <= start and end <= hi for lo, hi in _registered.items()):
        return True
    return t.is_pinned()


class _PageLock:
    """Unregisters the pages when the last of the buffer's `users` parameters is gone
    (before their storage can be freed: the parameters hold it)."""

    def __init__(self, ptr: int, span: int, users: int):
        self.ptr, self.users, self.locked = ptr, users, True
        _registered[ptr] = ptr + span

    def drop(self) -> None:
        self.users -= 1
        if self.users == 0 and self.locked:
            _registered.pop(self.ptr, None)
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.locked = False
