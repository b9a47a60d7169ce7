"""``benchmarks/cluster_sim.py``: segments of a trace, and a hand-computed walk."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

import cluster_sim  # noqa: E402

from megatron_mecefo.planner.recovery_planner import CostProfile, PlannerConfig  # noqa: E402
from megatron_mecefo.takeover.failure_schedule import FailureEvent, FailureSchedule  # noqa: E402

PROFILE = CostProfile(
    exact_ms=10.0, takeover_ms=6.0, takeover_recompute_ms=8.0, optimizer_ms=0.0, sync_ms=0.0,
    sync_replicas=8, basis_refresh_ms=100.0, regroup_ms=1000.0, rejoin_ms=0.0,
    activation_exact_bytes=8.0, activation_takeover_bytes=4.0,
    activation_takeover_recompute_bytes=1.0,
)  # fmt: skip


def test_segments_cut_the_trace_where_the_failed_set_changes() -> None:
    sched = FailureSchedule([FailureEvent(10, 30, 1), FailureEvent(20, 40, 3)], 8)
    assert cluster_sim.segments(sched, 50) == [
        (0, 10, frozenset()),
        (10, 20, frozenset({1})),
        (20, 30, frozenset({1, 3})),
        (30, 40, frozenset({3})),
        (40, 50, frozenset()),
    ]


def test_a_walk_by_hand() -> None:
    # n = 8, M = 4, replica 2 down for 1000 of 2000 s.
    segs = [(0, 1000, frozenset()), (1000, 2000, frozenset({2}))]
    cfg = PlannerConfig(allow_shrink=True, rank_min=32, rank_max=32)
    rows = {r["policy"]: r for r in cluster_sim.simulate(segs, 1.0, 8, 4, PROFILE, cfg)}
    # drop: 7/8 of the samples at the failure-free step during the failure.
    assert rows["drop"]["throughput_rel"] == pytest.approx((1000 + 1000 * 7 / 8) / 2000)
    assert rows["drop"]["samples_lost_pct"] == pytest.approx(100 * (1000 / 8) / (1000 + 1000))
    # spread: 4 absorbed micro-batches over 7 replicas, one each: 4 x 10 + 6 (+ refresh / 200);
    # entering takeover costs one basis computation (0.1 s).
    step = 40 + 6 + 100 / 200
    want = (1000 + (1000 - 0.1) * 40 / step) / 2000
    assert rows["spread"]["throughput_rel"] == pytest.approx(want)
    assert rows["spread"]["transition_time_pct"] == pytest.approx(100 * 0.1 / 2000)
    assert rows["spread"]["takeover_share_pct"] == pytest.approx(
        100 * (1000 - 0.1) * 40 / step * (4 / 32) / ((1000 + (1000 - 0.1) * 40 / step))
    )
    # The lossless auto is at least every lossless fixed policy here (one event).
    lossless = max(rows[p]["throughput_rel"] for p in ("spread", "neighbor", "exact", "shrink"))
    assert rows["auto"]["throughput_rel"] == pytest.approx(lossless)
    assert rows["auto"]["samples_lost_pct"] == 0.0
    assert rows["spread"]["limit_takeover_drop_pct"] == pytest.approx(
        100 * (1 - (1000 + 1000 / (1 + 0.6 / 7)) / 2000)
    )
