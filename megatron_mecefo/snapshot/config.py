"""The snapshot settings (``--mecefo-snapshot-*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SnapshotConfig:
    """How often to snapshot, where the slots live and how much parity to keep."""

    interval: int = 0
    """Snapshot after every ``interval``-th optimizer step; 0 turns snapshots off."""

    directory: Optional[str] = None
    """A holder's shared-memory directory (``/dev/shm/...``): slots outlive the trainer. None
    keeps the slots in the trainer's own memory (they die with it)."""

    redundancy: int = 0
    """m: parity shards per group of data-parallel peers (erasure coding); 0 = none."""

    commit_timeout_s: float = 300.0
    """How long a rank waits for its peers to commit the previous snapshot before failing."""

    @property
    def enabled(self) -> bool:
        return self.interval > 0
