"""The throughput models behind benchmarks/: step costs of real plans, limits, trace walking."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from failure_trace import simulate  # noqa: E402
from step_cost_model import (  # noqa: E402
    StepCostModel,
    limit_exact,
    limit_takeover,
    spaced_failures,
)

from megatron_mecefo.failure_schedule import FailureEvent, FailureSchedule  # noqa: E402
from megatron_mecefo.takeover_policy import POLICIES  # noqa: E402

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


def test_paper_schedule_reference_replicas_scales_the_failure_interval() -> None:
    literal = FailureSchedule.paper("high", 32, 2000, 60.0, seed=3)
    scaled = FailureSchedule.paper("high", 8, 2000, 60.0, seed=3, reference_replicas=32)

    def gaps(s: FailureSchedule) -> set:
        pairs = zip(s.events, s.events[1:], strict=False)
        return {b.fail_iteration - a.fail_iteration for a, b in pairs}

    def durations(s: FailureSchedule) -> set:
        return {e.recover_iteration - e.fail_iteration for e in s.events}

    assert gaps(literal) == {30}  # 0.5 h at 60 s per iteration
    assert gaps(scaled) == {120}  # each of 8 replicas fails as often as one of 32
    assert durations(literal) == durations(scaled) == {120}  # 2 h, per replica, unchanged


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


def test_rank_cpu_time_and_grad_error_under_exact(tmp_path: Path, text_data: str) -> None:
    """Under `exact` with replica 1 down: (1) --log-rank-cpu-time gives per-rank CPU seconds
    by DP rank, the neighbour (2) doing twice the work and the failed replica almost none;
    (2) the logged gradient relative error is ~0, also when clipping scales the gradient (it
    is measured before the optimizer step)."""
    from conftest import TINY_MODEL, run_trainer, train_records

    args = TINY_MODEL + [
        "--data-path", text_data, "--train-iters", "8", "--eval-iters", "0",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--log-rank-cpu-time",
        "--mecefo", "--mecefo-policy", "exact", "--mecefo-rank", "16", "--mecefo-fail", "1:3",
        "--mecefo-grad-error-interval", "1", "--clip-grad", "1e-3",
    ]  # fmt: skip
    _, records = run_trainer(4, args, tmp_path)
    train = train_records(records)
    for r in train:
        assert r["rank_cpu_s"]["dp_rank"] == [0, 1, 2, 3]
        assert all(v > 0 for v in r["rank_cpu_s"]["optimizer"])
    errors = [r["mecefo"]["grad_rel_error"] for r in train[2:]]
    assert len(errors) == 6 and max(errors) < 1e-5, errors
    assert min(r["grad_norm"] for r in train[2:]) > 1e-2  # so clipping scaled every step
    steady = [r["rank_cpu_s"]["fwd_bwd"] for r in train[3:]]  # iterations 4..8, replica 1 down

    def median(replica: int) -> float:
        return statistics.median(s[replica] for s in steady)

    assert train[3]["mecefo"]["neighbours"] == {"1": 2}
    assert median(1) < 0.5 * min(median(0), median(3))
    assert median(2) > 1.3 * max(median(0), median(3))
