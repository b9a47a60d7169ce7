"""Issue 12 regressions in the takeover subsystem, single process: the sample-offset check,
the keywords the no-compute path hands to ``finalize``, and O(events) schedule generation."""

from __future__ import annotations

import time
from typing import Any, Dict, List

import pytest
import torch

from megatron_mecefo.takeover.config import FaultToleranceConfig, MecefoConfigError
from megatron_mecefo.takeover.controller import MecefoController, SampleOffsetError
from megatron_mecefo.takeover.data_remap import GlobalBatchLayout
from megatron_mecefo.takeover.failure_schedule import FailureSchedule, ScheduleError
from megatron_mecefo.takeover.policies import build_policy
from megatron_mecefo.techniques.config import MecefoConfig
from megatron_mecefo.techniques.state import MecefoState

GBS, MBS, DP = 16, 2, 4
DATASET = [{"tokens": torch.arange(i * 8, i * 8 + 8)} for i in range(400)]


def _fetch(indices: List[int]) -> Dict[str, torch.Tensor]:
    return torch.utils.data.default_collate([DATASET[i] for i in indices])


def _loader(replica: int, consumed: int) -> Any:
    """Megatron's sampler order for one DP rank, as the real data loader yields it."""
    from megatron_mecefo.data.sampler import samples_of_global_batch

    while True:
        for mb in samples_of_global_batch(consumed, GBS, MBS, DP, replica):
            yield _fetch(mb)
        consumed += GBS


def _controller(replica: int, policy: str = "exact") -> MecefoController:
    return MecefoController(
        schedule=FailureSchedule.scripted(["1:12:15"], DP),
        policy=build_policy(policy),
        state=MecefoState(MecefoConfig()),
        replica=replica,
        layout=GlobalBatchLayout(GBS, MBS, DP),
        mha_parameters=[],
    )


@pytest.mark.parametrize("replica", [1, 2])  # the failed replica and its absorber
def test_wrong_sample_offset_stops_the_run(replica: int) -> None:
    """Item 1: a loader built at the phase-local offset (0 after a phase transition at
    iteration 11) while the plan is given the run's consumed samples (176)."""
    ctrl = _controller(replica)
    loader = _loader(replica, consumed=0)
    ctrl.begin_iteration(12, consumed_samples=11 * GBS)
    with pytest.raises(SampleOffsetError, match="consumed samples 176"):
        ctrl.microbatches(loader, _fetch)


@pytest.mark.parametrize("replica", [0, 1, 2, 3])
def test_right_sample_offset_passes_and_checks_once_per_plan(replica: int) -> None:
    ctrl = _controller(replica)
    loader = _loader(replica, consumed=0)
    calls: List[List[int]] = []

    def fetch(indices: List[int]) -> Any:
        calls.append(indices)
        return _fetch(indices)

    for iteration in (12, 13):  # the same failed set: one check
        ctrl.begin_iteration(iteration, consumed_samples=(iteration - 12) * GBS)
        batches = list(ctrl.microbatches(loader, fetch))
        assert len(batches) == (len(ctrl.plan.work[replica]) or 1)  # failed: one at weight 0
    own = GlobalBatchLayout(GBS, MBS, DP).samples(0, replica, 0)
    assert calls[0] == own  # the check read this replica's own first micro-batch by index
    checks = [c for c in calls if c == own]
    assert len(checks) == 1


def test_failed_replica_passes_the_schedule_keywords_to_finalize() -> None:
    """Item 2 (core_v0.19): the no-compute path calls finalize with the pg_collection and
    force_all_reduce that the schedule received, so a failed replica runs the same reduction
    as the healthy ones (all-reduce vs the distributed optimizer's reduce-scatter)."""
    ctrl = _controller(1, policy="neighbor")
    ctrl.begin_iteration(12, consumed_samples=0)
    seen: List[tuple] = []

    def finalize(*args: Any, **kwargs: Any) -> None:
        seen.append((args, kwargs))

    run = ctrl.wrap_forward_backward(
        lambda **kw: pytest.fail("a failed replica without overlap computes nothing"),
        fetch=_fetch,
        finalize=finalize,
        zero_report=lambda: {"lm loss": torch.zeros(2)},
        is_last_stage=lambda: True,
    )
    group = object()
    model = torch.nn.Linear(2, 2)
    report = run(
        forward_step_func=None,
        data_iterator=_loader(1, 0),
        model=model,
        num_microbatches=2,
        seq_length=8,
        micro_batch_size=MBS,
        pg_collection=group,
        force_all_reduce=True,
    )
    assert len(report) == 1 and torch.equal(report[0]["lm loss"], torch.zeros(2))
    ((args, kwargs),) = seen
    assert args == ([model], None)
    assert kwargs == {"pg_collection": group, "force_all_reduce": True}


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
