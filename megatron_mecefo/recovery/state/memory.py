"""Giving memory back after a recovery (freed host memory to the OS, cached GPU blocks), and
the process counters a recovery reports (resident size, bytes written).

A heal or a regroup frees large buffers (a staging bucket, the carried weights). glibc keeps
freed chunks below its (dynamic) mmap threshold in its arenas, so the process's resident size
would stay at its peak; ``malloc_trim(0)`` returns them. PyTorch's CPU allocator does not cache,
so this is all the host side needs; on a GPU the caching allocator's free blocks are released.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Any, Optional

_LIBC: Optional[ctypes.CDLL] = None


def _libc() -> Optional[ctypes.CDLL]:
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else None
        except OSError:
            _LIBC = None
    return _LIBC


def release_unused() -> bool:
    """Return freed heap memory to the OS (glibc) and empty the CUDA cache; True when
    ``malloc_trim`` ran (False on a C library without it, e.g. musl)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True


def rss_bytes(pid: str = "self") -> int:
    """Resident set size of ``pid`` (``/proc/<pid>/status`` VmRSS), in bytes."""
    return _status_bytes("VmRSS", pid)


def written_bytes(pid: str = "self") -> int:
    """Bytes this process passed to write-family system calls, sockets included
    (``/proc/<pid>/io`` wchar): what a rank sent, read from the kernel, not from our code."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


MEM_TRACE_ENV = "MECEFO_MEM_TRACE"
"""Set to 1: each rank prints its peak memory at every iteration and recovery point."""


def mem_trace(slot: int, inc: int, point: str, iteration: int) -> None:
    """With ``MECEFO_MEM_TRACE=1``: print this rank's peak memory since the last trace and
    reset it, one line per point (``[mecefo-mem] ...``), for ``benchmarks/recovery_scale*.py``.

    On a GPU the peak is ``torch.cuda.max_memory_allocated``; on the CPU the peak resident
    size (VmHWM, reset through ``/proc/self/clear_refs``)."""
    if not os.environ.get(MEM_TRACE_ENV):
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak, now = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        kind = "cuda"
    else:
        peak, now = _status_bytes("VmHWM"), _status_bytes("VmRSS")
        try:  # "5": reset the peak resident size (Linux 4.0+)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        kind = "rss"
    print(
        f"[mecefo-mem] slot={slot} inc={inc} point={point} iteration={iteration} kind={kind} "
        f"peak={peak} now={now}",
        flush=True,
    )


def _status_bytes(field: str, pid: str = "self") -> int:
    """A ``/proc/<pid>/status`` field given in kB, in bytes (0 if absent)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """``with PeakRss() as peak:`` the largest VmRSS a thread sees while the block runs
    (``peak.peak``, bytes; polled every ``interval_s``, and read once more at the end)."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.peak = rss_bytes()
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
