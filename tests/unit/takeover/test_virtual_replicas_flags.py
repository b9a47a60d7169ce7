"""``--mecefo-virtual-replicas`` start-up checks: bad flag combinations stop at start-up, and the
flag sets the simulated data-parallel size. The simulation against real DP is
``tests/integration/takeover/test_virtual_replicas.py``."""

from __future__ import annotations

import pytest


# ----------------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    "world, flags, texts",
    [
        (4, ["--mecefo"], ["--mecefo-virtual-replicas=4", "4 processes were launched"]),
        (1, [], ["--mecefo-virtual-replicas=4", "without --mecefo"]),
        (1, ["--mecefo", "--overlap-grad-reduce"], ["does not simulate --overlap-grad-reduce"]),
        (1, ["--mecefo", "--hidden-dropout", "0.1"], ["does not simulate --hidden-dropout=0.1"]),
        (1, ["--mecefo", "--use-distributed-optimizer"], ["--use-distributed-optimizer"]),
    ],
)
def test_bad_flags_stop_at_start_up(trainer_args, world, flags, texts) -> None:
    args = trainer_args.build_parser().parse_args(
        ["--mock-data", "--mecefo-virtual-replicas", "4", *flags]
    )
    with pytest.raises(trainer_args.ConfigError) as err:
        trainer_args.validate_args(args, world)
    for text in texts:
        assert text in str(err.value), err.value


def test_flag_sets_the_simulated_data_parallel_size(trainer_args) -> None:
    args = trainer_args.build_parser().parse_args(
        ["--mock-data", "--mecefo", "--mecefo-virtual-replicas", "32", "--micro-batch-size", "1",
         "--global-batch-size", "64", "--mecefo-fail", "31:2:5"]
    )  # fmt: skip
    args = trainer_args.validate_args(args, 1)
    assert (args.data_parallel_size, args.num_microbatches, args.world_size) == (32, 2, 1)
    bad = trainer_args.build_parser().parse_args(
        ["--mock-data", "--mecefo", "--mecefo-virtual-replicas", "1"]
    )
    with pytest.raises(trainer_args.ConfigError, match="use at least 2"):
        trainer_args.validate_args(bad, 1)
