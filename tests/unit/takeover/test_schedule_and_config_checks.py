"""Failure-schedule generation and ``FaultToleranceConfig`` validation, single process (issue
12's regressions): extreme step times are refused at once, schedule generation is O(events),
flags the schedule does not read are errors, events past the last iteration and a low-rank
``r`` at full width warn by name."""

from __future__ import annotations

import time
from typing import Any

import pytest

from megatron_mecefo.takeover.config import FaultToleranceConfig, MecefoConfigError
from megatron_mecefo.takeover.failure_schedule import FailureSchedule, ScheduleError
from megatron_mecefo.techniques.config import MecefoConfig


def _config(**kw: Any) -> FaultToleranceConfig:
    return FaultToleranceConfig(enabled=True, **kw)


def test_extreme_step_time_is_rejected_at_once() -> None:
    """Item 7: 1e9 s per iteration used to loop for minutes before training started."""
    t0 = time.perf_counter()
    with pytest.raises(MecefoConfigError, match="--mecefo-nominal-step-time=1000000000.0"):
        _config(failure_schedule="high", nominal_step_time_s=1e9).validate(
            data_parallel_size=4, hidden_size=256, train_iters=150
        )
    with pytest.raises(ScheduleError, match="shorter than one iteration"):
        FailureSchedule.poisson(4, 150, 3600.0, 1e-9, 1.0, seed=1)
    assert time.perf_counter() - t0 < 5  # generous: the check is arithmetic


def test_many_failures_per_iteration_cost_one_pass_per_failure() -> None:
    """Item 7: the periodic schedule at the largest allowed step time (2 failures per
    iteration, each down for 2 iterations) over 20,000 iterations on 4 replicas: the last
    replica is never taken down, and every failure that fits is drawn."""
    s = FailureSchedule.paper("high", 4, 20_000, 3600.0, seed=3)
    down = s.failed_by_iteration(20_000)
    assert max(len(d) for d in down) == 3  # every replica but one
    assert 10_000 < len(s.events) < 40_000


@pytest.mark.parametrize(
    "fields,flag",
    [
        ({"failure_schedule": "scripted", "fail": ["1:2:3"], "failure_trace": "t.json"},
         "--mecefo-failure-trace=t.json is only read by --mecefo-failure-schedule=replay"),
        ({"failure_schedule": "high", "nominal_step_time_s": 1.0, "mtbf_hours": 2.0},
         "--mecefo-mtbf-hours=2.0 is only read by --mecefo-failure-schedule=poisson"),
        ({"failure_schedule": "none", "mttr_hours": 1.0},
         "--mecefo-mttr-hours=1.0 is only read by --mecefo-failure-schedule=poisson"),
    ],
)  # fmt: skip
def test_flags_the_schedule_does_not_read_are_errors(fields: dict, flag: str) -> None:
    """Item 4: these were accepted and then ignored."""
    with pytest.raises(MecefoConfigError) as err:
        _config(**fields).validate(data_parallel_size=4, hidden_size=256, train_iters=10)
    assert flag in str(err.value)


def test_events_after_the_last_iteration_warn_by_name() -> None:
    """Item 4: failure events beyond --train-iters never happen; say which."""
    warnings = _config(failure_schedule="scripted", fail=["1:5:8", "2:11", "3:40:50"]).validate(
        data_parallel_size=4, hidden_size=256, train_iters=10
    )
    (line,) = warnings
    assert "2 failure event(s)" in line and "--train-iters=10" in line
    assert "replica 2 at iteration 11" in line and "replica 3 at iteration 40" in line


@pytest.mark.parametrize(
    "rank,hidden,ffn,gated,warns",
    [(128, 128, 320, True, True), (32, 128, 320, True, False), (64, 64, 64, False, True),
     (63, 64, 64, False, False), (16, 64, 16, False, True)],
)  # fmt: skip
def test_rank_at_full_width_warns(rank: int, hidden: int, ffn: int, gated: bool, warns: bool):
    """Item 5: r >= min(in, out) of every FFN weight means no rank-limited gradient."""
    ft = _config(techniques=MecefoConfig(rank=rank))
    warnings = ft.validate(
        data_parallel_size=4,
        hidden_size=hidden,
        train_iters=10,
        ffn_hidden_size=ffn,
        gated_linear_unit=gated,
    )
    assert bool(warnings) == warns, warnings
    if warns:
        assert f"--mecefo-rank={rank}" in warnings[0]
