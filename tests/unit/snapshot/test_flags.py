"""``--mecefo-snapshot-*`` start-up checks: each bad value names the flag and the fix."""

from __future__ import annotations

import argparse

import pytest

from megatron_mecefo.snapshot.arguments import SnapshotFlagError, add_arguments, validate


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--mecefo-snapshot-interval", "-1"], r"--mecefo-snapshot-interval=-1: must be >= 0"),
        (["--mecefo-snapshot-dir", "/dev/shm/x"], r"needs --mecefo-snapshot-interval K > 0"),
        (["--mecefo-snapshot-interval", "1", "--mecefo-snapshot-redundancy", "4"],
         r"--mecefo-snapshot-redundancy=4: needs fewer parity shards .* at most 3"),
        (["--mecefo-snapshot-interval", "1", "--mecefo-snapshot-redundancy", "1"],
         r"--mecefo-snapshot-redundancy=1: parity protects the distributed optimizer.*add "
         r"--use-distributed-optimizer"),
        (["--mecefo-snapshot-interval", "1", "--mecefo-snapshot-slots", "1"],
         r"--mecefo-snapshot-slots=1: needs at least 2 .* use 3 for one snapshot per iteration"),
        (["--mecefo-snapshot-slots", "3"], r"--mecefo-snapshot-slots=3 needs --mecefo-snapshot-i"),
        (["--mecefo-snapshot-interval", "1", "--mecefo-snapshot-dir", "/nonexistent/mecefo"],
         r"no live snapshot holder there; start one with `python -m "),
    ],
)  # fmt: skip
def test_bad_snapshot_flags(argv: list[str], match: str) -> None:
    with pytest.raises(SnapshotFlagError, match=match):
        validate(_args(*argv), dp_size=4)


def test_redundancy_with_distributed_optimizer() -> None:
    args = _args("--mecefo-snapshot-interval", "1", "--mecefo-snapshot-redundancy", "1")
    args.use_distributed_optimizer = True
    config = validate(args, dp_size=4)
    assert config.redundancy == 1 and config.interval == 1


def test_good_snapshot_flags() -> None:
    assert validate(_args(), dp_size=4) is None
    config = validate(_args("--mecefo-snapshot-interval", "10"), dp_size=4)
    assert config.interval == 10 and config.directory is None and config.enabled
    # Slots: 3 at one snapshot per iteration (no per-snapshot barrier), else 2; or as given.
    assert config.n_slots == 2
    assert validate(_args("--mecefo-snapshot-interval", "1"), dp_size=4).n_slots == 3
    given = validate(_args("--mecefo-snapshot-interval", "1", "--mecefo-snapshot-slots", "4"), 4)
    assert given.n_slots == 4
