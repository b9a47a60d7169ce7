"""In-memory snapshots (REFT-style): frequent copies of each rank's training state in host memory.

Every ``--mecefo-snapshot-interval`` iterations, right after ``optimizer.step()``, each rank
copies its parameters, optimizer shard, RNG states, counters and MeCeFO basis into one of two
preallocated host slots (asynchronously: a thread on CPU, a side stream on GPU). A snapshot
counts once every rank has committed it (agreed through the job's TCPStore). With
``--mecefo-snapshot-dir`` the slots live in shared memory owned by a per-node holder process
(``python -m megatron_mecefo.snapshot.holder``), so they outlive a trainer that dies; a
restarted trainer then resumes from memory instead of from disk. ``erasure`` adds parity across
the data-parallel peers of a TP/PP position, ``parity`` exchanges it in the training loop and
rebuilds a dead replica's slot (the distributed-optimizer takeover under the recovery
supervisor), ``survival`` tells how likely a snapshot survives.

Used by the example trainer (``examples/pretrain_gpt``) and ``benchmarks/snapshot_overhead.py``.
"""

from typing import Any

from megatron_mecefo.snapshot.config import SnapshotConfig

__all__ = ["SnapshotConfig", "SnapshotManager"]


def __getattr__(name: str) -> Any:  # the flag checks import this package before torch
    if name == "SnapshotManager":
        from megatron_mecefo.snapshot.manager import SnapshotManager

        return SnapshotManager
    raise AttributeError(name)
