"""Snapshot slots in one process: a sealed slot with a flipped byte fails its CRC."""

from __future__ import annotations

from pathlib import Path

import torch


def test_corrupt_slot_is_not_used(tmp_path: Path) -> None:
    """A flipped byte in a sealed slot fails its CRC: the slot counts as empty."""
    from megatron_mecefo.snapshot.checksum import crc32
    from megatron_mecefo.snapshot.slots import Slot, copy_into, plan_layout

    tensors = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)}
    entries, nbytes = plan_layout(tensors)
    slot = Slot(0, str(tmp_path))
    buffer = slot.ensure(nbytes)
    copy_into(buffer, tensors, entries, non_blocking=False)
    layout = [[e.name, list(e.shape), e.dtype, e.offset, e.nbytes] for e in entries]
    header = {"iteration": 7, "nbytes": nbytes, "crc32": crc32(buffer[:nbytes]), "entries": layout}
    slot.seal(header)
    fresh = Slot(0, str(tmp_path))
    assert fresh.verify()["iteration"] == 7
    back = fresh.read(fresh.verify())
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    fresh.buffer[5] ^= 1
    assert Slot(0, str(tmp_path)).verify() is None
