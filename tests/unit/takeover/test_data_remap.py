"""Data re-mapping, single process: the exactly-once check; own and absorbed samples."""

from __future__ import annotations

import pytest

from megatron_mecefo.takeover.data_remap import GlobalBatchLayout, ReplicaMicrobatches
from megatron_mecefo.takeover.plan import MicrobatchWork, StepPlan
from megatron_mecefo.takeover.policies import build_policy
from megatron_mecefo.techniques.state import MicrobatchMode

EXACT, TAKEOVER = MicrobatchMode.EXACT, MicrobatchMode.TAKEOVER


def test_account_rejects_a_plan_that_runs_a_microbatch_twice() -> None:
    good = build_policy("exact").plan(3, frozenset({1}), 3, 2)
    work = list(good.work)
    work[0] = work[0] + (MicrobatchWork(2, 1, EXACT),)  # replica 2's second micro-batch again
    bad = StepPlan(3, "exact", 3, 2, (1,), tuple(work))
    layout = GlobalBatchLayout(12, 2, 3)
    with pytest.raises(RuntimeError, match="processed 2 time"):
        layout.account(bad, 24)
    work = list(good.work)
    work[2] = work[2][:-1]  # replica 1's last micro-batch lost
    with pytest.raises(RuntimeError, match="processed 0 time"):
        layout.account(StepPlan(3, "exact", 3, 2, (1,), tuple(work)), 24)


def test_replica_microbatches_hand_out_own_then_absorbed_samples() -> None:
    n, m, mbs = 4, 2, 3
    layout = GlobalBatchLayout(n * m * mbs, mbs, n)
    consumed = 7 * n * m * mbs
    plan = build_policy("neighbor").plan(8, frozenset({1}), n, m)  # replica 2 absorbs 1
    samples = lambda s, i: layout.samples(consumed, s, i)  # noqa: E731
    fetched = []

    def fetch(indices):
        fetched.append(list(indices))
        return ("fetched", tuple(indices))

    it = ReplicaMicrobatches(plan.work[2], ["own0", "own1"], fetch, samples, replica=2)
    got = list(it)
    assert len(got) == len(plan.work[2]) == 2 * m
    for mb, item in zip(plan.work[2], got, strict=True):
        if mb.source == 2:
            assert item == ["own0", "own1"][mb.index]
        else:
            assert mb.source == 1 and item == ("fetched", tuple(samples(1, mb.index)))
    assert sorted(fetched) == [samples(1, k) for k in range(m)]
    assert it.processed == [samples(mb.source, mb.index) for mb in plan.work[2]]
    # Replica 1's micro-batches are the ones Megatron's sampler gives DP rank 1.
    assert samples(1, 0) == [consumed + 3, consumed + 4, consumed + 5]
    assert samples(1, 1) == [consumed + 15, consumed + 16, consumed + 17]
    # A rank that reads no data (TP rank > 0) gets None throughout, but still the indices.
    it = ReplicaMicrobatches(plan.work[2], [None, None], None, samples, replica=2)
    assert list(it) == [None] * 4 and len(it.processed) == 4
