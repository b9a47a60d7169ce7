"""``--mecefo-policy auto``: decisions per failure event, its flags, and a real multi-rank run."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, run_trainer, train_records

from megatron_mecefo.planner.auto_policy import AutoPolicy
from megatron_mecefo.planner.calibration import load_profile, prediction_report
from megatron_mecefo.planner.recovery_planner import (
    CostProfile,
    FailureState,
    PlannerConfig,
    plan_recovery,
)

PROFILE_FILE = REPO / "results" / "planner_profile.json"
PROFILE = CostProfile(
    exact_ms=20.0, takeover_ms=13.0, takeover_recompute_ms=17.0, optimizer_ms=5.0,
    sync_ms=6.0, sync_replicas=4, basis_refresh_ms=11.0, regroup_ms=670.0, rejoin_ms=940.0,
    activation_exact_bytes=8e6, activation_takeover_bytes=3.4e6,
    activation_takeover_recompute_bytes=0.4e6,
)  # fmt: skip


def test_decides_once_per_failure_event_with_observed_rates() -> None:
    seen = []
    auto = AutoPolicy(PROFILE, PlannerConfig(sample_loss_budget=0.2), on_decision=seen.append)
    sets = [(), (), (1,), (1,), (1,), (1, 3), (3,), (), ()]
    plans = [auto.plan(i + 1, frozenset(f), 8, 4) for i, f in enumerate(sets)]
    # Every change of the failed set is one decision, the first iteration too; no others.
    assert [d["iteration"] for d in auto.decisions] == [1, 3, 6, 7, 8]
    assert len(seen) == 5 and seen[1].policy == plans[2].policy != "none"
    # Each decision is the planner's on the state it saw, with the rates observed so far.
    # At iteration 6: iterations 1-5 committed, 2 x 8 + 3 x 7 = 37 replica-iterations up and
    # one failure; no repair yet (the prior, 2 h, stands).
    step_h = PROFILE.failure_free_step(8, 4) / 3.6e6
    cfg = PlannerConfig(sample_loss_budget=0.2)
    state = FailureState(8, frozenset({1, 3}), 4, (16.0 + 37 * step_h) / 2, 2.0)
    assert plan_recovery(state, PROFILE, cfg).summary() == {
        k: v for k, v in auto.decisions[2].items() if k not in ("iteration", "failed")
    }
    # By iteration 9: replica 1 was repaired after 4 iterations (3..6), replica 3 after 2.
    assert auto.observed_rates(8, 4)[1] == pytest.approx((2.0 + 6 * step_h) / 3)
    assert auto.decisions[-1]["policy"] == "none" and not plans[-1].failed
    again = AutoPolicy(PROFILE, cfg)
    for i, f in enumerate(sets):
        again.plan(i + 1, frozenset(f), 8, 4)
    assert again.decisions == auto.decisions  # every rank: same inputs, same decisions


# ----------------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    "world, flags, texts",
    [
        (2, ["--mecefo-approx-budget", "0.5"],
         ["--mecefo-approx-budget=0.5", "--mecefo-policy auto"]),
        (2, ["--mecefo-sample-loss-budget", "0.1", "--mecefo-policy", "spread"],
         ["--mecefo-sample-loss-budget=0.1", "not spread"]),
        (2, ["--mecefo-policy", "auto", "--mecefo-approx-budget", "1.5"],
         ["--mecefo-approx-budget=1.5", "between 0 and 1"]),
        (2, ["--mecefo-policy", "auto", "--mecefo-rank-min", "64", "--mecefo-rank-max", "16"],
         ["--mecefo-rank-min=64", "min <= max"]),
        (2, ["--mecefo-policy", "auto", "--mecefo-planner-profile", "/nonexistent.json"],
         ["--mecefo-planner-profile", "megatron_mecefo.planner.calibration"]),
        (1, ["--mecefo-policy", "auto"], ["--mecefo-policy=auto", "data-parallel size is 1"]),
    ],
)  # fmt: skip
def test_bad_planner_flags_stop_at_start_up(trainer_args, world, flags, texts) -> None:
    args = trainer_args.build_parser().parse_args(
        ["--mock-data", "--mecefo", "--mecefo-planner-profile", str(PROFILE_FILE), *flags]
    )
    with pytest.raises(trainer_args.ConfigError) as err:
        trainer_args.validate_args(args, world)
    for text in texts:
        assert text in str(err.value), err.value


# ----------------------------------------------------------------------------- real run
def test_auto_through_a_scripted_failure_in_a_real_dp2_run(tmp_path: Path, text_data: str) -> None:
    """DP 2, 4 micro-batches each; replica 1 down from iteration 6. The profile is rescaled by
    the failure-free steps 2-4, and every step records its prediction beside its measurement.
    How close they are is a timing, measured by ``benchmarks/planner_accuracy.py``."""
    assert load_profile(str(PROFILE_FILE)).exact_ms > 0
    proc, records = run_trainer(
        2,
        ["--data-path", text_data, "--train-iters", "10", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--eval-iters", "0", "--mecefo", "--mecefo-rank", "32",
         "--mecefo-policy", "auto", "--mecefo-planner-profile", str(PROFILE_FILE),
         "--mecefo-fail", "1:6", "--log-interval", "5"],
        tmp_path,
    )  # fmt: skip
    train = train_records(records)
    plans = [r["mecefo"]["planner"] for r in train]
    assert "> MeCeFO planner: iteration 6, replicas down [1]: spread" in proc.stdout
    assert "calibrated on 3 failure-free steps" in proc.stdout
    assert [p["policy"] for p in plans] == ["none"] * 5 + ["spread"] * 5
    assert plans[5]["calibration_factor"] and plans[5]["takeover_share"] == 0.5
    for p in plans:  # predictions and measurements side by side
        assert p["measured_step_ms"] > 0 and p["measured_peak_activation_bytes"] > 0
        # Takeover micro-batches save fewer activations: the peak stays the exact one.
        assert p["measured_peak_activation_bytes"] == plans[0]["measured_peak_activation_bytes"]
    # One factor rescales every prediction: the survivor's doubled share costs more than the
    # calibrated failure-free step, by the profile's takeover cost.
    factor = plans[4]["calibration_factor"]
    assert all(p["calibration_factor"] == factor for p in plans[4:])
    assert min(p["predicted_step_ms"] for p in plans[6:]) > plans[4]["predicted_step_ms"]
    report = prediction_report(records)  # calibrated steps 5-10 less the transition step
    assert report["steps"] == 4 and report["predicted_ms_median"] == plans[7]["predicted_step_ms"]
