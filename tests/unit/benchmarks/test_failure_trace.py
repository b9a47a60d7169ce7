"""benchmarks/failure_trace.py's trace walk: transitions, basis refreshes and lost samples."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from failure_trace import simulate  # noqa: E402

from megatron_mecefo.planner.step_cost_model import StepCostModel  # noqa: E402
from megatron_mecefo.takeover.failure_schedule import FailureEvent, FailureSchedule  # noqa: E402
from megatron_mecefo.takeover.policies import POLICIES  # noqa: E402

C, OPT, SYNC = 0.7, 0.3, 0.4


MODEL = StepCostModel(exact=1.0, takeover=C, optimizer=OPT, sync=SYNC, sync_replicas=4)


def test_trace_without_failures_loses_nothing() -> None:
    sets = FailureSchedule.none(8).failed_by_iteration(500)
    for policy in POLICIES:
        res = simulate(MODEL, sets, policy, 8, 4, refresh=0.5, remap=0.01, basis_interval=200)
        assert res["drop_pct"] == pytest.approx(0.0, abs=1e-12)
        assert res["transitions"] == res["basis_computations"] == 0


def test_trace_counts_basis_refreshes_and_transitions() -> None:
    """Replica 2 down for iterations 101..550: its neighbour computes V at 101, 301 and 501."""
    n, m, iters, refresh, remap = 8, 4, 600, 0.5, 0.01
    schedule = FailureSchedule([FailureEvent(101, 551, 2)], n)
    sets = schedule.failed_by_iteration(iters)
    assert sets[1:] == [schedule.failed_at(i) for i in range(1, iters + 1)]
    res = simulate(MODEL, sets, "neighbor", n, m, refresh, remap, basis_interval=200)
    assert res["transitions"] == 2 and res["basis_computations"] == 3
    healthy = m + OPT + MODEL.sync_time(n)
    degraded = 2 * m * C + OPT + MODEL.sync_time(n)
    total = 150 * healthy + 450 * degraded + 3 * refresh + 2 * remap
    assert res["throughput_rel"] == pytest.approx(iters * healthy / total)
    drop = simulate(MODEL, sets, "drop", n, m, refresh, remap, basis_interval=200)
    assert drop["basis_computations"] == 0
    assert drop["samples_skipped_pct"] == pytest.approx(100 * 450 / (8 * iters))
