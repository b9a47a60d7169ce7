"""The critical-path step model: step costs of real plans, the limits, the ring-sync scaling."""

from __future__ import annotations

import pytest

from megatron_mecefo.planner.step_cost_model import (
    StepCostModel,
    limit_exact,
    limit_takeover,
    spaced_failures,
)
from megatron_mecefo.takeover.policies import POLICIES

C, OPT, SYNC = 0.7, 0.3, 0.4
MODEL = StepCostModel(exact=1.0, takeover=C, optimizer=OPT, sync=SYNC, sync_replicas=4)


def test_neighbor_beats_the_bare_takeover_limit_when_many_are_down() -> None:
    row = MODEL.evaluate("neighbor", 8, 3, 4)
    assert not row["fallback"] and row["ratio_to_limit"] > 1.0
    assert row["step_time_rel"] == pytest.approx(
        (8 * C + OPT + MODEL.sync_time(8)) / (4 + OPT + MODEL.sync_time(8))
    )


def test_limits_are_the_issue_formulas() -> None:
    assert limit_exact(8, 1) == pytest.approx(7 / 8)
    assert limit_takeover(8, 1, C) == pytest.approx(1 / (1 + C / 7))
    assert limit_takeover(4, 4, C) == 0.0
    assert spaced_failures(8, 2) == frozenset({0, 4})
    assert spaced_failures(128, 4) == frozenset({0, 32, 64, 96})


def test_sync_scales_as_a_ring_allreduce() -> None:
    assert MODEL.sync_time(4) == pytest.approx(SYNC)
    assert MODEL.sync_time(128) == pytest.approx(SYNC * (127 / 128) / (3 / 4))


def test_step_times_of_each_policy_at_n8_k1() -> None:
    """Replica 0 down, M = 4: the critical path of every policy, by hand."""
    m, fixed = 4, OPT + MODEL.sync_time(8)
    healthy = m + fixed
    rows = {p: MODEL.evaluate(p, 8, 1, m) for p in POLICIES}
    # neighbor: replica 1 runs its own 4 and the failed 4, all in takeover mode.
    assert rows["neighbor"]["step_time_rel"] == pytest.approx((2 * m * C + fixed) / healthy)
    # spread: the 4 absorbed micro-batches go one each to 4 survivors, in takeover mode.
    assert rows["spread"]["step_time_rel"] == pytest.approx((m + C + fixed) / healthy)
    # exact: replica 1 runs 8 exact micro-batches.
    assert rows["exact"]["step_time_rel"] == pytest.approx((2 * m + fixed) / healthy)
    # drop: nobody does more; 1/8 of the samples are lost.
    assert rows["drop"]["step_time_rel"] == pytest.approx(1.0)
    assert rows["drop"]["samples_skipped_frac"] == pytest.approx(1 / 8)
    assert rows["drop"]["samples_per_s_rel"] == pytest.approx(7 / 8)
    for p in ("neighbor", "spread", "exact"):
        assert rows[p]["samples_skipped_frac"] == 0.0
        assert rows[p]["samples_per_s_rel"] == pytest.approx(1 / rows[p]["step_time_rel"])


@pytest.mark.parametrize("n,k", [(n, k) for n in (4, 8, 32, 128) for k in (1, 2, 3, 4) if k < n])
def test_no_policy_beats_its_limit(n: int, k: int) -> None:
    """With the same fixed costs, perfect balancing bounds the samples/s of the policies that
    run their own micro-batches exactly. (``neighbor`` also runs its own in takeover mode, so
    once k/(n-k) > (2c-1)/c it can beat the bare takeover limit: n = 8, k = 3 does.)"""
    for policy in ("spread", "exact", "drop"):
        row = MODEL.evaluate(policy, n, k, 4)
        assert row["ratio_to_limit"] <= 1.0 + 1e-9, row
        assert row["limit_with_fixed_costs"] >= row[f"limit_{row['limit']}"] - 1e-9
