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
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional, Tuple

_LIBC: Optional[ctypes.CDLL] = None


def libc() -> Optional[ctypes.CDLL]:
    """The C library (loaded once), or None where it cannot be loaded."""
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
    c = libc()
    trim = getattr(c, "malloc_trim", None) if c is not None else None
    if trim is None:
        return False
    trim(0)
    return True


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
"""glibc's ``mallopt`` parameters."""
DYNAMIC_MMAP_THRESHOLD = 32 << 20
"""Where glibc's dynamic mmap threshold ends in a training process (its maximum on 64-bit:
any freed mapped chunk of up to 32 MiB raises it to that size); a ``mallopt`` turns the
dynamic rule off for good, so :func:`training_thresholds` sets it where the rule would be."""
DEFAULT_MMAP_MAX = 65536


def training_thresholds(c: Any) -> None:
    """glibc's thresholds as its dynamic rule leaves them in a training process: chunks above
    :data:`DYNAMIC_MMAP_THRESHOLD` mapped on their own, the heap trimmed above twice that."""
    c.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
    c.mallopt(M_MMAP_THRESHOLD, DYNAMIC_MMAP_THRESHOLD)
    c.mallopt(M_TRIM_THRESHOLD, 2 * DYNAMIC_MMAP_THRESHOLD)


@contextmanager
def mapped_allocations(min_bytes: int = 1 << 20) -> Iterator[bool]:
    """In the block, glibc maps every allocation of ``min_bytes`` or more on its own (yields
    whether it could; then :func:`training_thresholds`).

    A survivor builds its new model around the carried state: each new parameter is replaced
    by the carried tensor's storage at once (:mod:`.carry`), untouched. Carved from the heap,
    the discarded parameters left holes of up to the model's size among the live tensors, and
    the steps that followed spread their temporaries over those holes and the heap's old free
    space alike. Measured at 1.1 GiB of state (``test_heal_at_scale.py``, ``mallinfo2``): the
    same bytes in use before and after, the heap's free space 97 -> 317 MiB at the rebuild,
    and resident memory two iterations after the heal 0.98-1.07 of steady over 20 runs (3 over
    the 1.05 bound); mapped on their own, the discarded parameters go back to the OS when
    freed, and the same test gave 0.99-1.052 over 25 (one over): the heap's layout still moves
    the figure by a few percent from run to run, as it moves the steady state itself."""
    c = libc()
    if c is None or not hasattr(c, "mallopt"):
        yield False
        return
    c.mallopt(M_MMAP_THRESHOLD, min_bytes)
    try:
        yield True
    finally:
        training_thresholds(c)


_MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault a range in, writable, in one call (no trap per page)."""

PAGE_BYTES = 4096


class Background:
    """``with`` a subclass: its :meth:`_run` runs on a daemon thread for the block; on exit
    ``_stop`` is set and the thread joined (``_run`` checks ``_stop`` between its steps)."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class Prefaulter(Background):
    """A thread that faults in the pages of a receiver's destinations ahead of the bytes.

    A heal writes every byte of its destinations once, mostly into pages the process never
    touched (a joiner's weights built without initialisation, its optimizer moments): inline,
    the receiving thread takes a page fault per 4 KiB and the kernel zeroes each page before
    the bytes land. Measured here, one 1 GiB gloo receive went at 2.0 GB/s into fresh pages
    against 5.0 into touched ones. This thread asks the kernel to populate the ranges in
    order (``madvise(MADV_POPULATE_WRITE)``, a few MiB a call; it runs without the GIL), so
    the faults overlap the transfer: a 1.3 GB stream into fresh tensors went from 0.71 to
    0.37-0.42 s, as fast as into touched ones. It populates only memory the transfer is about
    to write whole, so the resident size at the end is the same. Without the call (a kernel
    before 5.14, not Linux, a GPU tensor) it does nothing.

    Args:
        ranges: ``(address, bytes)`` in the order the transfer writes them.
        chunk_bytes: Bytes per call: how soon it sees :meth:`stop`.
    """

    def __init__(self, ranges: Any, chunk_bytes: int = 8 << 20) -> None:
        super().__init__("mecefo-prefault")
        self.ranges = list(ranges)
        self.chunk_bytes = chunk_bytes
        self.populated = 0
        self.resident = 0
        """Bytes found resident already (a warm heap's), left alone."""

    def _run(self) -> None:
        for n, faulted in populate(self.ranges, self.chunk_bytes, self._stop):
            if faulted:
                self.populated += n
            else:
                self.resident += n


def populate(ranges: Any, chunk_bytes: int, stop: threading.Event) -> Iterator[Tuple[int, bool]]:
    """Fault in the whole pages of ``ranges`` (``(address, bytes)``, in order), writable,
    ``chunk_bytes`` per ``madvise(MADV_POPULATE_WRITE)`` call; yields ``(bytes, faulted)``
    per chunk: a chunk already resident (``mincore``) is skipped, since the populate call
    walks every page even then (measured: 42 ms per resident GiB, against 0.6 for
    ``mincore``; a heal into a warm heap, :mod:`.warm_heap`, spent that on two cores). Ends
    early once ``stop`` is set, or at once without the call (a kernel before 5.14)."""
    c = libc()
    madvise = getattr(c, "madvise", None) if c is not None else None
    mincore = getattr(c, "mincore", None) if c is not None else None
    if madvise is None:
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    vec = ctypes.create_string_buffer(chunk_bytes // PAGE_BYTES + 1)
    if mincore is not None:
        mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    for address, nbytes in ranges:
        start = -(-address // PAGE_BYTES) * PAGE_BYTES
        end = (address + nbytes) // PAGE_BYTES * PAGE_BYTES
        for at in range(start, end, chunk_bytes):
            if stop.is_set():
                return
            n = min(chunk_bytes, end - at)
            pages = n // PAGE_BYTES
            if mincore is not None and mincore(at, n, vec) == 0:
                if b"\x00" not in vec.raw[:pages]:  # every page resident (low bit set)
                    yield n, False
                    continue
            if madvise(at, n, _MADV_POPULATE_WRITE) != 0:
                return  # EINVAL: the kernel lacks it; the pages fault in on first write
            yield n, True


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
    heap = heap_stats() if kind == "rss" else None
    extra = "" if heap is None else "".join(f" {k}={v}" for k, v in heap.items())
    print(
        f"[mecefo-mem] slot={slot} inc={inc} point={point} iteration={iteration} kind={kind} "
        f"peak={peak} now={now}{extra}",
        flush=True,
    )


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33+): every field a ``size_t``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")  # fmt: skip
    ]


def heap_stats() -> Optional[Dict[str, int]]:
    """What glibc's allocator holds, over all its arenas (``mallinfo2``), in bytes:
    ``heap_in_use`` (allocated chunks in the arenas), ``heap_free`` (free chunks in them, which
    stay resident once touched until ``malloc_trim``) and ``mmapped`` (chunks mapped on their
    own). ``heap_in_use + mmapped`` is the memory the process's C/C++ code holds, whatever
    the heap's layout; None without glibc 2.33+."""
    c = libc()
    fn = getattr(c, "mallinfo2", None) if c is not None else None
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return {"heap_in_use": info.uordblks, "heap_free": info.fordblks, "mmapped": info.hblkhd}


def _status_bytes(field: str, pid: str = "self") -> int:
    """A ``/proc/<pid>/status`` field given in kB, in bytes (0 if absent)."""
    return _kb_field(f"/proc/{pid}/status", field)


def mem_available() -> int:
    """The machine's ``MemAvailable`` in bytes (``/proc/meminfo``; 0 if absent)."""
    return _kb_field("/proc/meminfo", "MemAvailable")


def _kb_field(path: str, field: str) -> int:
    """A ``FIELD: N kB`` line of a ``/proc`` file, in bytes (0 if absent)."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss(Background):
    """``with PeakRss() as peak:`` the largest VmRSS a thread sees while the block runs
    (``peak.peak``, bytes; polled every ``interval_s``, and read once more at the end)."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        super().__init__("mecefo-peak-rss")
        self.peak = rss_bytes()
        self.interval_s = interval_s

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.peak = max(self.peak, rss_bytes())
