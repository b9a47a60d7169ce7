"""The takeover controller's checks, single process (issue 12's regressions): the sample-offset
check stops a loader built at the wrong offset, and the no-compute path of a failed replica
hands ``finalize`` the keywords the schedule received."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from megatron_mecefo.takeover.controller import MecefoController, SampleOffsetError
from megatron_mecefo.takeover.data_remap import GlobalBatchLayout
from megatron_mecefo.takeover.failure_schedule import FailureSchedule
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
