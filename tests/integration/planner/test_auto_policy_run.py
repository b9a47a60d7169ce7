"""``--mecefo-policy auto`` in a real DP2 run of the example trainer through a scripted failure."""

from __future__ import annotations

from pathlib import Path

from conftest import REPO, run_trainer, train_records

from megatron_mecefo.planner.calibration import load_profile, prediction_report

PROFILE_FILE = REPO / "results" / "planner_profile.json"


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
         "--mecefo-fail", "1:6", "--log-interval", "5",
         # No gradient-error bound: at DP2 one replica down is half the batch in takeover mode,
         # over the default budget (0.3), and auto would pick exact; this test is the speed side.
         "--mecefo-grad-error-budget", "1"],
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
