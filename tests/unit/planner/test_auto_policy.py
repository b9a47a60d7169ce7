"""``--mecefo-policy auto`` in one process: decisions per failure event, and its flags. The real
multi-rank run is ``tests/integration/planner/test_auto_policy_run.py``."""

from __future__ import annotations

import pytest
from conftest import REPO

from megatron_mecefo.planner.auto_policy import AutoPolicy
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
