"""``--mecefo-snapshot-*`` flags and their start-up checks (torch-free)."""

from __future__ import annotations

import argparse
import os
from typing import Optional

from megatron_mecefo.snapshot.config import SnapshotConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("in-memory snapshots")
    g.add_argument(
        "--mecefo-snapshot-interval",
        dest="snapshot_interval",  # not mecefo_*: snapshots do not need --mecefo
        type=int,
        default=0,
        help="K: snapshot each rank's state to host memory after every K-th optimizer step "
        "(0: off).",
    )
    g.add_argument(
        "--mecefo-snapshot-dir",
        dest="snapshot_dir",
        default=None,
        help="Shared-memory directory of this node's snapshot holder (python -m "
        "megatron_mecefo.snapshot.holder --dir DIR): snapshots outlive a dead trainer, and a "
        "restarted trainer resumes from them before trying --load.",
    )
    g.add_argument(
        "--mecefo-snapshot-redundancy",
        dest="snapshot_redundancy",
        type=int,
        default=0,
        help="m: parity shards per group of data-parallel peers, with "
        "--use-distributed-optimizer: a replica that dies for real has its optimizer shard "
        "rebuilt from its peers' snapshots and parity (XOR for m = 1, zfec for m >= 2; see "
        "python -m megatron_mecefo.snapshot.survival).",
    )
    g.add_argument(
        "--mecefo-snapshot-slots",
        dest="snapshot_slots",
        type=int,
        default=None,
        help="Host slots per rank, each the size of the rank's snapshot (default: 3 with "
        "--mecefo-snapshot-interval 1, else 2). The newest snapshot every rank committed is "
        "never overwritten: with 2 slots each snapshot waits for every rank's commit of the "
        "previous one; a third slot removes that per-snapshot barrier.",
    )


class SnapshotFlagError(ValueError):
    """A bad ``--mecefo-snapshot-*`` value; the message names the flag and the fix."""


def validate(args: argparse.Namespace, dp_size: int) -> Optional[SnapshotConfig]:
    """The snapshot config, or None when snapshots are off.

    Raises:
        SnapshotFlagError: On a negative interval or redundancy, fewer than 2 slots, a
            directory, redundancy or slots flag without an interval, a redundancy of at least
            the DP size, or a directory with no live holder.
    """
    k, d, m = (
        args.snapshot_interval,
        args.snapshot_dir,
        args.snapshot_redundancy,
    )
    n = getattr(args, "snapshot_slots", None)
    if k < 0:
        raise SnapshotFlagError(
            f"--mecefo-snapshot-interval={k}: must be >= 0 (0 turns snapshots off)"
        )
    if m < 0:
        raise SnapshotFlagError(f"--mecefo-snapshot-redundancy={m}: must be >= 0")
    if n is not None and n < 2:
        raise SnapshotFlagError(
            f"--mecefo-snapshot-slots={n}: needs at least 2 (a crash during a copy must leave "
            "the previous snapshot intact); use 3 for one snapshot per iteration"
        )
    if k == 0:
        for flag, value in (
            ("--mecefo-snapshot-dir", d),
            ("--mecefo-snapshot-redundancy", m),
            ("--mecefo-snapshot-slots", n),
        ):
            if value:
                raise SnapshotFlagError(
                    f"{flag}={value} needs --mecefo-snapshot-interval K > 0 (snapshots are off)"
                )
        return None
    if m and m >= dp_size:
        raise SnapshotFlagError(
            f"--mecefo-snapshot-redundancy={m}: needs fewer parity shards than data-parallel "
            f"replicas ({dp_size}); use at most {dp_size - 1}"
        )
    if m and not getattr(args, "use_distributed_optimizer", False):
        raise SnapshotFlagError(
            f"--mecefo-snapshot-redundancy={m}: parity protects the distributed optimizer's "
            "shards (a lost replica's shard is rebuilt from its peers); without "
            "--use-distributed-optimizer every replica holds the whole state and a real death "
            "is survived without it: add --use-distributed-optimizer or drop the flag"
        )
    if m >= 2:
        try:
            import zfec  # noqa: F401
        except ImportError:
            raise SnapshotFlagError(
                f"--mecefo-snapshot-redundancy={m}: m >= 2 uses zfec's Reed-Solomon code, which "
                "is not installed: pip install -e '.[snapshot]' (or use m = 1: XOR parity)"
            ) from None
    if d is not None:
        from megatron_mecefo.snapshot.holder import holder_pid

        if holder_pid(d) is None:
            raise SnapshotFlagError(
                f"--mecefo-snapshot-dir={d}: no live snapshot holder there; start one with "
                f"`python -m megatron_mecefo.snapshot.holder --dir {d}` (one per node) first"
            )
        d = os.path.abspath(d)
    return SnapshotConfig(interval=k, directory=d, redundancy=m, slots=n)
