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

    slots: Optional[int] = None
    """Host slots per rank (each the size of the rank's snapshot). A snapshot never overwrites
    the newest one every rank has committed, so with 2 slots each snapshot waits until every
    rank has committed the previous one: a world-wide barrier at every snapshot, which at
    K = 1 absorbs the ranks' skew (and the parity exchange) at every step. A third slot moves
    that wait one snapshot back, where it is normally already done. None: 3 when
    ``interval`` is 1, else 2 (at K >= 2 the previous snapshot has K - 1 steps to commit)."""

    commit_timeout_s: float = 300.0
    """How long a rank waits for its peers to commit the previous snapshot before failing."""

    @property
    def n_slots(self) -> int:
        if self.slots is not None:
            return self.slots
        return 3 if self.interval == 1 else 2

    @property
    def enabled(self) -> bool:
        return self.interval > 0
