"""The heal's prefaulting thread (``recovery/state/memory.py``): it makes a fresh tensor's pages
resident ahead of the bytes, leaves resident ones (and the data) alone, and stops when told.
The allocations a survivor's rebuild maps on their own (``mapped_allocations``). glibc's own
figures in the memory trace (``heap_stats``)."""

from __future__ import annotations

import pytest
import torch

from megatron_mecefo.recovery.state.memory import (
    PAGE_BYTES,
    Prefaulter,
    heap_stats,
    libc,
    mem_trace,
    rss_bytes,
)

MiB = 1 << 20


def _populate_supported() -> bool:
    probe = torch.empty(64 * MiB, dtype=torch.uint8)  # above any mmap threshold: fresh
    with Prefaulter([(probe.data_ptr(), probe.numel())]) as p:
        p._thread.join()
    return p.populated > 0


def test_a_fresh_tensor_becomes_resident_without_its_bytes_changing() -> None:
    if not _populate_supported():  # a kernel before 5.14: the thread does nothing, by design
        with Prefaulter([(torch.empty(MiB).data_ptr(), MiB)]) as p:
            p._thread.join()
        assert p.populated == 0
        return
    n = 256 * MiB
    fresh = torch.empty(n, dtype=torch.uint8)  # untouched: not resident yet
    before = rss_bytes()
    with Prefaulter([(fresh.data_ptr(), n)]) as p:
        p._thread.join()  # let it finish before __exit__ stops it
    grown = rss_bytes() - before
    whole_pages = (fresh.data_ptr() + n) // PAGE_BYTES - -(-fresh.data_ptr() // PAGE_BYTES)
    assert p.populated == whole_pages * PAGE_BYTES
    assert grown >= 0.9 * n, (grown, n)  # resident now, with no write of ours
    assert int(fresh[:: 64 * 1024].sum()) == 0  # anonymous pages read as zeros: untouched


def test_resident_pages_are_skipped_and_a_stopped_thread_populates_nothing() -> None:
    data = torch.arange(8 * MiB, dtype=torch.int64)  # 64 MiB, written: resident
    expect = data.clone()
    with Prefaulter([(data.data_ptr(), data.numel() * 8)], chunk_bytes=MiB) as p:
        p._thread.join()
    assert torch.equal(data, expect)
    whole = (data.data_ptr() + 64 * MiB) // PAGE_BYTES - -(-data.data_ptr() // PAGE_BYTES)
    if _populate_supported():  # found resident (mincore): no populate call walked them
        assert p.resident == whole * PAGE_BYTES and p.populated == 0, (p.resident, p.populated)
    stopped = Prefaulter([(torch.empty(64 * MiB, dtype=torch.uint8).data_ptr(), 64 * MiB)])
    stopped._stop.set()  # told to stop before its first call
    with stopped:
        pass
    assert stopped.populated == 0 and not stopped._thread.is_alive()


MAPPED_CHILD = """
import ctypes, json, torch
from megatron_mecefo.recovery.state.memory import libc, mapped_allocations
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
c = libc()
c.mallinfo2.restype = Info
mapped = lambda: c.mallinfo2().hblkhd
mib = 1 << 20
first = torch.empty(16 * mib, dtype=torch.uint8)
del first  # a freed mapped chunk raises the threshold
base = mapped()
before = torch.empty(4 * mib, dtype=torch.uint8)
out = {"before": mapped() - base}
with mapped_allocations() as ok:
    parts = [torch.empty(4 * mib, dtype=torch.uint8) for _ in range(8)]
    out["inside"] = mapped() - base
    heap = c.mallinfo2().arena
    del parts
out.update(ok=ok, freed=mapped() - base, heap_grew=c.mallinfo2().arena - heap)
small = torch.empty(4 * mib, dtype=torch.uint8)
out["small_after"] = mapped() - base
big = torch.empty(40 * mib, dtype=torch.uint8)
out["big_after"] = mapped() - base
print("RESULT " + json.dumps(out))
"""


def test_inside_mapped_allocations_large_tensors_are_mapped_and_freed_to_the_os() -> None:
    """A survivor's new model is built in :func:`mapped_allocations`: its parameters, replaced
    by the carried storage at once, must not stay behind as holes in the heap. In a child (the
    allocator's settings are per process), with glibc's dynamic threshold raised first as a
    training process has it: outside the block a 4 MiB tensor comes from the heap; inside it
    is mapped, and freed it is unmapped; after the block the thresholds are a training
    process's (4 MiB from the heap, 40 MiB mapped)."""
    import json
    import subprocess
    import sys

    c = libc()
    if c is None or not hasattr(c, "mallinfo2") or not hasattr(c, "mallopt"):
        pytest.skip("needs glibc 2.33+ (mallopt, mallinfo2)")
    out = subprocess.run(
        [sys.executable, "-c", MAPPED_CHILD], capture_output=True, text=True, timeout=120
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, out.stdout[-2000:] + out.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["ok"] and r["before"] == 0, r  # the heap's, as in a training process
    assert r["inside"] >= 8 * 4 * MiB, r  # each mapped on its own
    assert r["freed"] == 0 and r["heap_grew"] <= MiB, r  # back to the OS, no hole left
    assert r["small_after"] == 0 and r["big_after"] >= 40 * MiB, r


def _live() -> int:
    stats = heap_stats()
    assert stats is not None
    return stats["heap_in_use"] + stats["mmapped"]


def test_heap_stats_count_a_tensor_wherever_glibc_puts_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``heap_in_use + mmapped`` rises by a tensor's bytes when it is made, in the heap (1 MiB)
    or mapped on its own (64 MiB), and falls by them when it is freed; the trace line carries
    the three figures."""
    if heap_stats() is None:
        pytest.skip("no mallinfo2 (glibc before 2.33, or not glibc)")
    for n in (MiB, 64 * MiB):
        before = _live()
        t = torch.ones(n, dtype=torch.uint8)
        grown = _live() - before
        del t
        shrunk = before + grown - _live()
        # The allocator's own bookkeeping adds a few hundred bytes around the block.
        assert n <= grown <= n + 64 * 1024, (n, grown)
        assert n <= shrunk <= n + 64 * 1024, (n, shrunk)
    monkeypatch.setenv("MECEFO_MEM_TRACE", "1")
    mem_trace(3, 1, "iteration", 7)
    line = capsys.readouterr().out.strip()
    assert line.startswith("[mecefo-mem] slot=3 inc=1 point=iteration iteration=7 kind=rss ")
    fields = dict(kv.split("=") for kv in line.split()[1:])
    assert {"heap_in_use", "heap_free", "mmapped"} <= set(fields)
    assert int(fields["heap_in_use"]) > 0
