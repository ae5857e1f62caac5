"""What a process holds, sampled by the soak and chaos runs: open fds,
threads, resident memory (peak, now, and its trend over a run) and the
``/dev/shm`` segments pycomm left behind."""

from __future__ import annotations

import ctypes
import os
import resource
import statistics
import threading
from typing import Sequence

__all__ = ["fds", "threads", "max_rss_mb", "rss_mb", "heap_mb", "rss_trend_mb", "shm_segments"]


def fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    """Threads of this process (the kernel's count: C++ threads included)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return threading.active_count()


def max_rss_mb() -> float:
    """The peak resident set so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# glibc's malloc_trim and mallinfo2, where there are (the process's own libc: no lookup)
_LIBC = ctypes.CDLL(None)
_MALLOC_TRIM = getattr(_LIBC, "malloc_trim", None)
_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


if _MALLINFO2 is not None:
    _MALLINFO2.restype = _Mallinfo2


def rss_mb(trim: bool = False) -> float:
    """The resident set now (the peak hides a slow leak under a large step).
    With ``trim``, after ``malloc_trim(0)``: what the allocator keeps free but
    mapped then no longer counts, so a trend that remains is memory in use."""
    if trim and _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)  # hands the heap's free pages back to the kernel
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def heap_mb() -> float | None:
    """What malloc has handed out and not got back, in MB (glibc's mallinfo2:
    every arena's allocated chunks plus the mmapped ones): C++, gloo and
    torch's tensors, not Python's small objects (pymalloc maps its own
    arenas). Beside the RSS it tells memory in use from memory the heap
    cannot give back. None without glibc 2.33's mallinfo2."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return (info.uordblks + info.hblkhd) / 2**20


def rss_trend_mb(samples: Sequence[tuple[float, float]], elapsed: float) -> float:
    """How much the resident set grew over the run once warm: the median of
    the samples (seconds, MB) in its last quarter minus the median of those
    in its second quarter (the first fills caches and pools). Medians, since
    one sample may catch a large step's tensors alive. 0 with too few."""
    def median_in(lo: float, hi: float) -> float | None:
        xs = [mb for t, mb in samples if lo * elapsed <= t < hi * elapsed]
        return statistics.median(xs) if xs else None

    early, late = median_in(0.25, 0.5), median_in(0.75, 1.01)
    return 0.0 if early is None or late is None else late - early


def shm_segments(pids: Sequence[int]) -> list[str]:
    """The shared-memory segments in /dev/shm that processes ``pids`` created
    (pycomm names them ``pycomm-<creator's pid>-...``): other jobs' are not
    this run's leaks."""
    prefixes = tuple(f"pycomm-{pid}-" for pid in pids)
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefixes))
    except FileNotFoundError:
        return []
