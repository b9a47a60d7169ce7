"""``--mecefo-fail-slow*`` in the example trainer: bad values stop at start-up with one line
that names the flag; the defaults (detect, 1.3, 5) need no ``--mecefo``."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "world, flags, starts",
    [
        (2, ["--mecefo-fail-slow-threshold", "0.9"], "--mecefo-fail-slow-threshold=0.9:"),
        (2, ["--mecefo-fail-slow-threshold", "inf"], "--mecefo-fail-slow-threshold=inf:"),
        (2, ["--mecefo-fail-slow-window", "0"], "--mecefo-fail-slow-window=0:"),
        (2, ["--mecefo-fail-slow", "rebalance"], "--mecefo-fail-slow=rebalance moves"),
        (1, ["--mecefo", "--mecefo-fail-slow", "rebalance", "--mecefo-virtual-replicas", "2"],
         "--mecefo-fail-slow=rebalance with --mecefo-virtual-replicas"),
    ],
)  # fmt: skip
def test_bad_values_stop_at_start_up(trainer_args, world, flags, starts) -> None:
    args = trainer_args.build_parser().parse_args(["--mock-data", *flags])
    with pytest.raises(trainer_args.ConfigError) as err:
        trainer_args.validate_args(args, world)
    assert str(err.value).startswith(starts), err.value
    assert "\n" not in str(err.value)


def test_unknown_mode_is_refused_by_the_parser(trainer_args, capsys) -> None:
    with pytest.raises(SystemExit):
        trainer_args.build_parser().parse_args(["--mecefo-fail-slow", "evict"])
    assert "--mecefo-fail-slow" in capsys.readouterr().err


def test_defaults_detect_without_mecefo(trainer_args) -> None:
    args = trainer_args.build_parser().parse_args(
        ["--mock-data", "--mecefo-fail-slow-threshold", "1.5"]
    )
    args = trainer_args.validate_args(args, 2)
    cfg = args.fail_slow_config
    assert (cfg.mode, cfg.threshold, cfg.window) == ("detect", 1.5, 5)
    assert cfg.recover_threshold == pytest.approx(1.25)
