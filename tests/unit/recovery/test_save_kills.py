"""A kill inside a checkpoint save (``--mecefo-kill R:I:save-write`` ...) needs a save at its
iteration; without one it would never fire, and it is refused at start-up in both trainers."""

from __future__ import annotations

import pytest

from megatron_mecefo.recovery.fault_injection import (
    parse_kills,
    save_iterations,
    unreachable_save_kill,
)


def test_save_iterations_follow_both_trainers_rules() -> None:
    assert save_iterations(20, 10) == [10, 20]
    assert save_iterations(25, 10) == [10, 20, 25]  # and at the end
    assert save_iterations(20, None) == [20]  # --save alone: at the end
    assert save_iterations(20, 10, exit_interval=7) == [7]  # stops (and saves) at 7
    assert save_iterations(20, 10, more_intervals=(4,)) == [4, 8, 10, 12, 16, 20]


@pytest.mark.parametrize(
    "spec, saves, says",
    [
        ("1:5:save-write", None, "no --save is given"),
        ("1:5:save", [10, 20], "no checkpoint is saved at iteration 5"),
        ("0:7:saved", [10, 20], "e.g. 0:10:saved"),
        ("1:16:save-finalize", [10, 20], "e.g. 1:20:save-finalize"),
    ],
)  # fmt: skip
def test_a_save_kill_without_its_save_is_refused(spec, saves, says) -> None:
    kills = parse_kills([spec], 2, 20, seed=1)
    message = unreachable_save_kill(kills, saves, "--save-interval=10 with --train-iters=20")
    assert message is not None and message.startswith(f"--mecefo-kill={spec}:"), message
    assert says in message and "never fires" in message


def test_kills_that_fire_pass() -> None:
    kills = parse_kills(["1:10:save-write", "0:5:backward", "1:20:saved"], 2, 20, seed=1)
    assert unreachable_save_kill(kills, [10, 20], "") is None
    assert unreachable_save_kill(parse_kills(["1:5:forward"], 2, 20, seed=1), None, "") is None


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--save", "{tmp}", "--save-interval", "10"], True),
        ([], True),
        (["--save", "{tmp}", "--save-interval", "5"], False),
        (["--save", "{tmp}"], False),  # saved once, at the end: kill at 20
        (["--save", "{tmp}", "--save-interval", "10", "--exit-signal-handler"], False),
    ],
)  # fmt: skip
def test_example_trainer_checks_at_start_up(trainer_args, tmp_path, monkeypatch, flags, refused):
    monkeypatch.setenv("MECEFO_RECOVERY", "{}")  # under the supervisor
    iteration = 20 if flags == ["--save", "{tmp}"] else 5
    argv = [
        "--mock-data",
        "--train-iters",
        "20",
        "--mecefo",
        "--mecefo-kill",
        f"1:{iteration}:save-write",
        *[f.replace("{tmp}", str(tmp_path)) for f in flags],
    ]
    args = trainer_args.build_parser().parse_args(argv)  # fmt: skip
    if not refused:
        trainer_args.validate_args(args, 2)
        return
    with pytest.raises(trainer_args.ConfigError, match="never fires"):
        trainer_args.validate_args(args, 2)
