"""The --mecefo-* flags: each bad combination is one MecefoConfigError naming the flag."""

from __future__ import annotations

import pytest
from conftest import max_down

from megatron_mecefo.takeover.config import FaultToleranceConfig, MecefoConfigError
from megatron_mecefo.takeover.failure_schedule import (
    FailureSchedule,
)


# ----------------------------------------------------------------------------- flags
def _validate(trainer_args, world: int, flags: list[str]):
    args = trainer_args.build_parser().parse_args(["--mock-data", *flags])
    return trainer_args.validate_args(args, world)


BAD_FLAGS = [
    # (world size, flags, texts the one error line must contain)
    (2, ["--mecefo", "--mecefo-fail", "5:10:20"], ["--mecefo-fail", "replica 5", "only 2"]),
    (4, ["--mecefo", "--mecefo-fail", "1:10:20", "--mecefo-fail", "1:15"],
     ["--mecefo-fail", "replica 1 fails at iteration 15"]),
    (2, ["--mecefo", "--mecefo-fail", "1-10"], ["--mecefo-fail", "'1-10'"]),
    (1, ["--mecefo"], ["--mecefo-policy=neighbor", "data-parallel size is 1"]),
    (1, ["--mecefo", "--mecefo-policy", "spread"], ["--mecefo-policy=spread", "size is 1"]),
    (2, ["--mecefo", "--mecefo-rank", "4096"], ["--mecefo-rank=4096", "--hidden-size=128"]),
    (2, ["--mecefo", "--mecefo-rank", "0"], ["--mecefo-rank=0"]),
    (2, ["--mecefo-rank", "64"], ["without --mecefo"]),
    (2, ["--mecefo-fail", "1:5"], ["without --mecefo"]),
    (2, ["--mecefo", "--mecefo-fail", "1:5", "--mecefo-failure-schedule", "high",
         "--mecefo-nominal-step-time", "5"], ["--mecefo-fail", "scripted, not high"]),
    (2, ["--mecefo", "--mecefo-failure-schedule", "high"],
     ["--mecefo-failure-schedule=high", "--mecefo-nominal-step-time"]),
    (2, ["--mecefo", "--mecefo-failure-schedule", "low", "--mecefo-nominal-step-time", "-3"],
     ["--mecefo-nominal-step-time=-3"]),
    (2, ["--mecefo", "--mecefo-failure-schedule", "poisson", "--mecefo-nominal-step-time", "3"],
     ["--mecefo-failure-schedule=poisson", "--mecefo-mtbf-hours"]),
    (2, ["--mecefo", "--mecefo-failure-schedule", "replay"], ["--mecefo-failure-trace"]),
    (2, ["--mecefo", "--mecefo-failure-schedule", "scripted"], ["--mecefo-fail"]),
    (4, ["--mecefo", "--mecefo-policy", "spread", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8"],
     ["--mecefo-policy=spread", "--num-layers-per-virtual-pipeline-stage"]),
    (2, ["--mecefo", "--mecefo-grad-error-interval", "5", "--use-distributed-optimizer"],
     ["--mecefo-grad-error-interval", "--use-distributed-optimizer"]),
    (2, ["--mecefo", "--mecefo-grad-error-interval", "-1"], ["--mecefo-grad-error-interval=-1"]),
    (2, ["--mecefo", "--calculate-per-token-loss"],
     ["--mecefo-policy=neighbor", "--calculate-per-token-loss"]),
    (2, ["--mecefo", "--recompute-granularity", "full", "--recompute-method", "uniform"],
     ["--mecefo-policy=neighbor", "--recompute-granularity=full"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "world,flags,expected", BAD_FLAGS, ids=[" ".join(c[1][:4]) for c in BAD_FLAGS]
)
def test_bad_mecefo_flags_give_one_config_error(trainer_args, world, flags, expected) -> None:
    with pytest.raises(trainer_args.ConfigError) as info:
        _validate(trainer_args, world, flags)
    message = str(info.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, message


def test_mecefo_flag_without_mecefo_names_the_flag(trainer_args) -> None:
    with pytest.raises(trainer_args.ConfigError, match="--mecefo-fail"):
        _validate(trainer_args, 2, ["--mecefo-fail", "1:5"])


def test_unknown_policy_is_an_argparse_error(trainer_args, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        trainer_args.build_parser().parse_args(["--mock-data", "--mecefo-policy", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--mecefo-policy" in err and "'bogus'" in err
    for name in ("neighbor", "spread", "exact", "drop"):
        assert name in err
    # The config check, for callers that build the config without argparse.
    ft = FaultToleranceConfig(enabled=True, policy="bogus")
    with pytest.raises(MecefoConfigError, match="--mecefo-policy=bogus"):
        ft.validate(data_parallel_size=2, hidden_size=128, train_iters=10)


def test_good_mecefo_flags(trainer_args) -> None:
    args = _validate(
        trainer_args,
        4,
        ["--mecefo", "--mecefo-fail", "1:5:10", "--mecefo-fail", "3:7", "--mecefo-rank", "16",
         "--train-iters", "20"],
    )  # fmt: skip
    ft = args.mecefo_config
    assert ft.enabled and ft.policy == "neighbor" and ft.failure_schedule == "scripted"
    assert ft.techniques.rank == 16 and ft.seed == 1234
    schedule = ft.build_schedule(args.data_parallel_size, args.train_iters)
    assert [schedule.failed_at(i) for i in (4, 5, 7, 10, 20)] == [
        frozenset(),
        {1},
        {1, 3},
        {3},
        {3},
    ]

    args = _validate(
        trainer_args,
        2,
        ["--mecefo", "--mecefo-failure-schedule", "high", "--mecefo-nominal-step-time", "60",
         "--train-iters", "200", "--mecefo-seed", "7", "--mecefo-policy", "spread"],
    )  # fmt: skip
    ft = args.mecefo_config
    assert ft.failure_schedule == "high" and ft.seed == 7 and ft.techniques.seed == 7
    schedule = ft.build_schedule(2, 200)
    assert schedule.events == FailureSchedule.paper("high", 2, 200, 60.0, 7).events
    assert schedule.events and max_down(schedule) == 1

    args = _validate(trainer_args, 1, ["--mecefo", "--mecefo-policy", "drop"])
    assert args.mecefo_config.failure_schedule == "none"
    args = _validate(trainer_args, 2, [])
    assert not args.mecefo_config.enabled and args.mecefo_config.failure_schedule == "none"
