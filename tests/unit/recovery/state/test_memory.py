"""The heal's prefaulting thread (``recovery/state/memory.py``): it makes a fresh tensor's pages
resident ahead of the bytes, leaves resident ones (and the data) alone, and stops when told."""

from __future__ import annotations

import torch

from megatron_mecefo.recovery.state.memory import PAGE_BYTES, Prefaulter, rss_bytes

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
