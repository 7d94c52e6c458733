"""Where a child's host memory goes: RSS, anonymous and shared RSS and torch's pinned
allocator at named points of the run, the largest non-anonymous mappings, who grows and
who still holds pinned blocks, and MemAvailable. Host bytes per parameter is the claim
offloading systems are judged by (issue 6), and the peak RSS alone cannot say whether the
bytes are the model's, the compiler's, the libraries' or pinned pools'."""

from __future__ import annotations

import sys
import threading
import traceback

import child_phase


def _rss_phases(rss: dict[str, tuple[int, int, int, int, int]], base: int, anon_base: int,
                n_params: int) -> dict[str, dict[str, float]]:
    """B/param over the baseline at each marked point: the peak RSS so far, the RSS then, and
    its anonymous part (RssAnon: without the file-backed pages of the libraries and code the
    process maps, and without shared memory, which is where cudaHostAlloc's pinned pages
    count: _largest_mappings names both); then the shared part (RssShmem) and the bytes
    torch's pinned allocator holds, in GiB, to tell whose the shared pages are; at the end
    also after glibc's malloc_trim, which shows how much is freed heap the process keeps."""
    rss = dict(rss, end=_memory_now())
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        rss["end_trimmed"] = _memory_now()
    except (OSError, AttributeError):  # not glibc
        pass
    return {k: {"peak": round((hwm - base) / n_params, 3), "now": round((cur - base) / n_params, 3),
                "anon": round((anon - anon_base) / n_params, 3), "shmem_gib": round(shmem / 2**30, 3),
                "pinned_gib": round(pinned / 2**30, 3)}
            for k, (hwm, cur, anon, shmem, pinned) in rss.items()}


def _largest_mappings(n: int = 6) -> list[str]:
    """The process's `n` largest mappings by resident bytes other than plain anonymous
    memory, from /proc/self/smaps: what the RSS beyond RssAnon is (library images, pinned
    memory the CUDA driver maps, shared memory)."""
    rows, name, anonymous = [], None, False
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split()
                if head and "-" in head[0] and ":" not in head[0]:  # a mapping's header line
                    name = head[5] if len(head) > 5 else "[anon]"
                    anonymous = len(head) <= 5 or name in ("[heap]", "[stack]")
                elif head and head[0] == "Rss:" and not anonymous:
                    rows.append((int(head[1]) * 1024, name))
    except OSError:
        return []
    merged: dict[str, int] = {}
    for nbytes, nm in rows:
        merged[nm] = merged.get(nm, 0) + nbytes
    return [f"{b / 2**20:.0f} MiB {nm}" for nm, b in sorted(merged.items(), key=lambda kv: -kv[1])[:n]]


def _memory_now() -> tuple[int, int, int, int, int]:
    """This process's peak RSS so far, RSS, anonymous and shared RSS, and the bytes torch's
    pinned allocator holds (cached blocks included), in bytes."""
    return _status("VmHWM"), _status("VmRSS"), _status("RssAnon"), _status("RssShmem"), _pinned_bytes()


def _pinned_bytes() -> int:
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    stats = getattr(torch.cuda, "host_memory_stats", dict)()
    return int(stats.get("allocated_bytes.current", 0))


class _PinnedWatch:
    """Who takes blocks from torch's pinned allocator (issue 4: 1 GiB of it appears in the
    first backward, and none of megatrain's buffers come from it): a thread polls its bytes
    every millisecond and, each time they grow, keeps the Python stacks of the other threads
    then. A copy into a fresh pinned block takes ~20 ms per GB, so the allocating frame is
    still on its stack when the poll sees the bytes."""

    def __init__(self, most: int = 4):
        self.events: list[dict] = []
        self._most, self._stop = most, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        seen = _pinned_bytes()
        while not self._stop.wait(0.001) and len(self.events) < self._most:
            now = _pinned_bytes()
            if now > seen:
                frames = sys._current_frames()
                me = threading.get_ident()
                stacks = {str(t): [f"{fs.filename.rsplit('site-packages/', 1)[-1]}:{fs.lineno} {fs.name}"
                                   for fs in traceback.extract_stack(f)[-10:]]
                          for t, f in frames.items() if t != me}
                # Held past here, the frames keep their locals alive: the autotuner's pinned
                # copy among them, which is what kept a 1 GiB block in use (session 10).
                del frames
                self.events.append({"phase": child_phase.phase, "from_bytes": seen, "to_bytes": now, "stacks": stacks})
                seen = now


def _pinned_holders(least: int = 256 << 20) -> dict:
    """Who still holds torch's pinned blocks at the end (issue 4: after the first backward
    megatrain gives back what the allocator caches unused, yet one 1 GiB block of Inductor's
    autotuner stayed in use on the H200): the pinned bytes before and after a garbage
    collection and an empty-cache, and for each pinned tensor of at least `least` bytes
    still alive, the types of what refers to it."""
    import gc

    import torch

    from megatrain.memory.host_store import release_cached_pinned_blocks

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    before = _pinned_bytes()
    holders = []
    for obj in gc.get_objects():
        try:
            big = isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.is_pinned() \
                and obj.untyped_storage().nbytes() >= least
        except Exception:  # noqa: BLE001, S112 -- objects that half-exist during collection
            continue
        if big:
            holders.append({"bytes": obj.untyped_storage().nbytes(), "shape": list(obj.shape),
                            "referrers": [type(r).__qualname__ + (f" {_dict_keys(r)}" if isinstance(r, dict) else "")
                                          for r in gc.get_referrers(obj)][:8]})
    release_cached_pinned_blocks()
    return {"before": before, "after_gc_and_empty_cache": _pinned_bytes(), "tensors": holders[:6]}


def _dict_keys(d: dict) -> list[str]:
    """A referring dict's first keys, for the log: strings as they are, anything else (a
    tensor-keyed optimizer state, which cannot be sorted or printed briefly) by its type."""
    return sorted(k if isinstance(k, str) else type(k).__name__ for k in list(d)[:64])[:8]


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _smaps_rollup(key: str) -> int:
    """A field of /proc/self/smaps_rollup in bytes (0 where the kernel has none)."""
    try:
        with open("/proc/self/smaps_rollup") as fh:
            return next((int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":")), 0)
    except OSError:
        return 0


def _mem_available() -> int:
    from megatrain.memory.host_store import available_host_bytes

    return available_host_bytes() or 0
