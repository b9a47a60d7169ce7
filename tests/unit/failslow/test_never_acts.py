"""Fail-slow settings that can never act are said at start-up (a warning: the run still
trains), and the summary's measured step times: the steps run slow and not rebalanced against
the steps run rebalanced, each the mean of the step times the trainer logged."""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch

from megatron_mecefo.failslow import FailSlowConfig
from megatron_mecefo.failslow.monitor import FailSlowMonitor
from megatron_mecefo.failslow.rebalance import RebalancePolicy
from megatron_mecefo.takeover.policies import build_policy


@pytest.mark.parametrize(
    "flags, dp, m, iters, says",
    [
        # A slow replica keeps one micro-batch: with one each nothing moves.
        ({"mode": "rebalance"}, 2, 1, 100, "1 micro-batch per replica"),
        # The window is longer than the run: no verdict ever.
        ({"window": 50}, 2, 4, 20, "detection can never start"),
        ({"mode": "rebalance", "window": 50}, 2, 4, 20, "detection can never start"),
        # A verdict at the last step: the plan would act after the run.
        ({"mode": "rebalance", "window": 20}, 2, 4, 20, "rebalancing can never act"),
    ],
)  # fmt: skip
def test_settings_that_can_never_act_warn(flags, dp, m, iters, says) -> None:
    warning = FailSlowConfig(**flags).validate(
        data_parallel_size=dp, mecefo=True, microbatches=m, train_iters=iters
    )
    assert warning is not None and says in warning, warning
    assert "\n" not in warning


@pytest.mark.parametrize(
    "flags, m, iters",
    [
        ({"mode": "rebalance"}, 2, 100),  # two micro-batches: one can move
        ({"mode": "rebalance", "window": 19}, 4, 20),  # verdict at 19, plan at 20
        ({"window": 20}, 4, 20),  # detection: a verdict at the last step is still a verdict
        ({}, 4, 2),  # the default detection of a short run says nothing
        ({"mode": "off", "window": 50}, 4, 20),
    ],
)  # fmt: skip
def test_settings_that_can_act_say_nothing(flags, m, iters) -> None:
    config = FailSlowConfig(**flags)
    assert config.validate(data_parallel_size=2, mecefo=True, microbatches=m,
                           train_iters=iters) is None  # fmt: skip


def test_example_trainer_warns_with_the_batch_flags(trainer_args, capsys) -> None:
    args = trainer_args.build_parser().parse_args(
        ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--mecefo",
         "--mecefo-fail-slow", "rebalance", "--train-iters", "10"]
    )  # fmt: skip
    trainer_args.validate_args(args, 2)
    out = capsys.readouterr().out
    assert "WARNING: --mecefo-fail-slow=rebalance with 1 micro-batch per replica " in out
    assert "(--global-batch-size=4 / (--micro-batch-size=2 x 2 replicas))" in out


# ---------------------------------------------------------------- measured step times
class _Controller:
    """The controller's surface the monitor reads: the takeover policy and the step's plan
    (the rebalanced plan whenever the monitor's policy holds an active assignment)."""

    def __init__(self) -> None:
        self.policy = build_policy("neighbor")
        self.plan: Optional[object] = None

    def begin(self, iteration: int) -> None:
        self.plan = self.policy.plan(iteration, frozenset(), 2, 4)


def _exchange(times: List[float]) -> torch.Tensor:
    """What the loss all-reduce reads back: the trainer's part, then each replica's time per
    micro-batch."""
    return torch.tensor([0.0, *times], dtype=torch.float64)


def test_measured_means_are_the_logged_step_times_of_each_window() -> None:
    ctrl = _Controller()
    cfg = FailSlowConfig(mode="rebalance", window=3)
    mon = FailSlowMonitor(cfg, 0, 2, 1, 4, controller=ctrl, print_line=lambda _l: None)
    assert isinstance(ctrl.policy, RebalancePolicy)
    # Steps 1-2 healthy; replica 1 at half speed from step 3; marked slow at step 5 (three
    # slow steps), rebalanced from step 6 on.
    step_s = [0.30, 0.31, 0.52, 0.55, 0.53, 0.41, 0.40, 0.42, 0.43]
    slow_from = 3
    records = []
    for i, dt in enumerate(step_s, start=1):
        ctrl.begin(i)
        t = [0.040, 0.080 if i >= slow_from else 0.040]
        mon.observe(_exchange(t), i)
        fields, _ = mon.step_fields(dt)
        records.append((i, dt, fields["fail_slow"]))
    slow_at = [i for i, _, f in records if f["slow"]]
    assert slow_at[0] == 5
    rebalanced = [i for i, _, f in records if f["rebalanced"]]
    assert rebalanced == [6, 7, 8, 9]
    m = records[-1][2]["measured"]
    # Not rebalanced: the detection window (steps 3-5) of the replica marked at step 5.
    assert m["not_rebalanced_steps"] == 3
    assert m["not_rebalanced_mean_step_s"] == pytest.approx(sum(step_s[2:5]) / 3)
    assert m["rebalanced_steps"] == 4
    assert m["rebalanced_mean_step_s"] == pytest.approx(sum(step_s[5:]) / 4)
    rows = dict(mon.summary_rows())
    assert "predicted x" in rows["fail-slow rebalanced"]
    assert rows["fail-slow measured"] == (
        "mean step 533.3 ms over 3 step(s) slow, not rebalanced; 415.0 ms over 4 step(s) "
        "rebalanced: x1.29 measured"
    )


def test_detect_only_counts_every_slow_step_and_reports_no_measured_field() -> None:
    cfg = FailSlowConfig(mode="detect", window=3)
    mon = FailSlowMonitor(cfg, 0, 2, 1, 4, controller=None, print_line=lambda _l: None)
    for i, dt in enumerate([0.3, 0.5, 0.5, 0.5, 0.6], start=1):
        mon.observe(_exchange([0.04, 0.04 if i == 1 else 0.08]), i)
        fields, _ = mon.step_fields(dt)
    assert "measured" not in fields["fail_slow"]
    # Marked at step 4 (steps 2-4 slow), still marked at 5: steps 2-5, none rebalanced.
    assert mon.unbalanced_steps == 4
    assert mon.unbalanced_time_s == pytest.approx(2.1)
    assert [key for key, _ in mon.summary_rows()] == ["fail-slow"]
