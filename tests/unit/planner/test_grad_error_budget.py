"""The planner's gradient-quality budget: the error model, the choice within the budget (a
brute force over a grid), the fallback to the least error, and the flag."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
from conftest import REPO

from megatron_mecefo.planner.config import DEFAULT_GRAD_ERROR_BUDGET
from megatron_mecefo.planner.gradient_error_model import (
    DEFAULT_MODEL,
    GradErrorModel,
    Observation,
    PolicyFit,
    fit,
)
from megatron_mecefo.planner.recovery_planner import (
    CostProfile,
    FailureState,
    PlannerConfig,
    build_choice,
    candidates,
    evaluate,
    plan_recovery,
    violations,
)

PROFILE = CostProfile(
    exact_ms=20.0, takeover_ms=13.0, takeover_recompute_ms=17.0, optimizer_ms=5.0,
    sync_ms=6.0, sync_replicas=4, takeover_ms_per_rank=0.05, basis_refresh_ms=11.0,
    regroup_ms=670.0, rejoin_ms=940.0, activation_exact_bytes=8e6,
    activation_takeover_bytes=3.4e6, activation_takeover_recompute_bytes=0.4e6,
    activation_bytes_per_rank=4096.0,
)  # fmt: skip
MODEL = GradErrorModel(
    {"neighbor": PolicyFit(0.6, 0.5, 0.2), "spread": PolicyFit(0.5, 0.6, 0.1),
     "drop": PolicyFit(0.8, 0.5)},
    reference_rank=32,
)  # fmt: skip


def independent_error(policy: str, state: FailureState, rank, model: GradErrorModel) -> float:
    """The power law on the real policy's plan counts, written apart from the planner."""
    if policy in ("exact", "shrink"):
        return 0.0
    n, m = state.num_replicas, state.microbatches
    plan = build_choice(policy).plan(1, state.failed, n, m)
    f = model.fits[policy]
    share = 1 - plan.processed / (n * m) if policy == "drop" else plan.num_takeover / (n * m)
    if share == 0:
        return 0.0
    return f.c * share**f.gamma * ((rank or 32) / 32) ** (-f.delta)


def grid():
    rng = random.Random(11)
    budgets = [0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, math.inf]
    bases = [
        PlannerConfig(grad_error_model=MODEL),
        PlannerConfig(grad_error_model=MODEL, sample_loss_budget=0.3, rank_min=8, rank_max=128),
        PlannerConfig(grad_error_model=MODEL, policies=("neighbor", "spread", "drop"),
                      sample_loss_budget=1.0),
        PlannerConfig(grad_error_model=MODEL, policies=("neighbor", "spread"),
                      rank_min=4, rank_max=64),
    ]  # fmt: skip
    for n, m in ((4, 1), (8, 2), (32, 1), (16, 4)):
        for k in (1, 2, n // 4, n // 2):
            failed = frozenset(rng.sample(range(n), k))
            for base, budget in itertools.product(bases, budgets):
                cfg = PlannerConfig(**{**base.__dict__, "grad_error_budget": budget})
                yield FailureState(n, failed, m), cfg


def test_never_over_budget_when_a_candidate_is_within_it() -> None:
    """Brute force: every allowed candidate, its error from the real plan; the decision is
    within the budget whenever one is, and then the fastest of those; else the least error."""
    checked = fallbacks = 0
    for state, cfg in grid():
        allowed = []
        for policy, recompute, rank in candidates(state, cfg):
            ev = evaluate(policy, recompute, rank, state, PROFILE, cfg)
            if violations(ev, state, PROFILE, cfg):
                continue
            err = independent_error(policy, state, ev.rank, MODEL)
            assert ev.grad_error == pytest.approx(err, rel=1e-12, abs=1e-15)
            allowed.append((ev.objective, err))
        if not allowed:
            continue
        d = plan_recovery(state, PROFILE, cfg)
        within = [a for a in allowed if a[1] <= cfg.grad_error_budget]
        if within:
            assert d.grad_error <= cfg.grad_error_budget, (state, cfg)
            assert d.objective == pytest.approx(min(o for o, _ in within))
        else:
            fallbacks += 1
            assert d.grad_error == pytest.approx(min(e for _, e in allowed))
            assert any("gradient-error budget" in note for note in d.notes)
        checked += 1
    assert checked > 300 and fallbacks > 10  # both branches are exercised


def test_budget_zero_takes_an_exact_choice_and_inf_the_fastest() -> None:
    state = FailureState(32, frozenset({1, 5, 9, 13}), 1)
    zero = plan_recovery(
        state, PROFILE, PlannerConfig(grad_error_budget=0.0, grad_error_model=MODEL)
    )
    assert zero.policy == "exact" and zero.grad_error == 0.0
    free = plan_recovery(state, PROFILE, PlannerConfig(grad_error_model=MODEL))
    speed_only = plan_recovery(state, PROFILE, PlannerConfig(grad_error_budget=math.inf))
    assert free.policy == speed_only.policy == "neighbor"  # one micro-batch each: fastest
    # A budget between spread's and neighbor's predicted error moves the choice to spread.
    e_spread = independent_error("spread", state, 32, MODEL)
    e_neighbor = independent_error("neighbor", state, 32, MODEL)
    assert e_spread < e_neighbor
    mid = PlannerConfig(grad_error_budget=(e_spread + e_neighbor) / 2, grad_error_model=MODEL)
    assert plan_recovery(state, PROFILE, mid).policy == "spread"


def test_fit_recovers_a_power_law_and_predicts_zero_for_exact_choices() -> None:
    rng = random.Random(3)
    obs = []
    for policy, share, rank in itertools.product(
        ("neighbor", "spread", "drop"), (1 / 32, 1 / 16, 1 / 8, 1 / 4), (8, 32, 128)
    ):
        truth = MODEL.predict(policy, share, share, rank)
        obs.append(Observation(policy, share, share, rank, truth * math.exp(rng.gauss(0, 1e-9))))
    got = fit(obs, reference_rank=32)
    for policy, f in MODEL.fits.items():
        g = got.fits[policy]
        assert (g.c, g.gamma, g.delta) == pytest.approx((f.c, f.gamma, f.delta), abs=1e-6)
    for policy in ("exact", "shrink", "none"):
        assert got.predict(policy, 0.5, 0.5, 8) == 0.0
    assert GradErrorModel.from_json(json.loads(json.dumps(got.to_json()))) == got


def test_default_model_is_the_committed_calibration() -> None:
    calib = json.loads(
        (REPO / "results" / "convergence_n32" / "grad_error_calibration.json").read_text()
    )
    fits = calib["model"]["fits"]
    assert set(DEFAULT_MODEL.fits) == set(fits)
    for policy, f in DEFAULT_MODEL.fits.items():
        assert (f.c, f.gamma, f.delta) == pytest.approx(
            (fits[policy]["c"], fits[policy]["gamma"], fits[policy]["delta"]), rel=1e-5
        )
    assert DEFAULT_MODEL.reference_rank == calib["model"]["reference_rank"]
    # The takeover policies were probed at several ranks, so their rank exponent is fitted.
    for policy in ("neighbor", "spread"):
        ranks = {o["rank"] for o in calib["observations"] if o["policy"] == policy}
        assert len(ranks) >= 2 and DEFAULT_MODEL.fits[policy].delta != 0.0


@pytest.mark.parametrize(
    "flags, texts",
    [
        (["--mecefo-policy", "auto", "--mecefo-grad-error-budget", "-0.1"],
         ["--mecefo-grad-error-budget=-0.1", ">= 0", "inf for no bound"]),
        (["--mecefo-policy", "auto", "--mecefo-grad-error-budget", "nan"],
         ["--mecefo-grad-error-budget=nan", ">= 0"]),
        (["--mecefo-policy", "spread", "--mecefo-grad-error-budget", "0.1"],
         ["--mecefo-grad-error-budget=0.1", "--mecefo-policy auto"]),
    ],
)  # fmt: skip
def test_bad_budget_stops_at_start_up(trainer_args, flags, texts) -> None:
    profile = REPO / "results" / "planner_profile.json"
    args = trainer_args.build_parser().parse_args(
        ["--mock-data", "--mecefo", "--mecefo-planner-profile", str(profile), *flags]
    )
    with pytest.raises(trainer_args.ConfigError) as err:
        trainer_args.validate_args(args, 2)
    for text in texts:
        assert text in str(err.value), err.value


def test_the_flag_reaches_the_planner(trainer_args) -> None:
    from megatron_mecefo.planner.config import AutoPolicyConfig

    profile = str(REPO / "results" / "planner_profile.json")
    base = ["--mock-data", "--mecefo", "--mecefo-policy", "auto",
            "--mecefo-planner-profile", profile]  # fmt: skip
    args = trainer_args.build_parser().parse_args(base)
    assert AutoPolicyConfig.from_args(args).grad_error_budget == DEFAULT_GRAD_ERROR_BUDGET
    args = trainer_args.build_parser().parse_args(base + ["--mecefo-grad-error-budget", "0.07"])
    cfg = AutoPolicyConfig.from_args(args)
    assert cfg.planner_config(_Techniques()).grad_error_budget == 0.07


class _Techniques:
    """The fields of ``MecefoConfig`` that ``planner_config`` reads."""

    any_technique = True
    rank = 32
    recompute_ffn = True
    basis_interval = 200
    skip_attention = True


def test_default_budget_at_n32_moves_auto_from_neighbor_to_spread() -> None:
    """With the calibrated model and the flag's default budget, at 32 replicas of one
    micro-batch: neighbor (fastest) while at most 2 are down, spread from 3 (neighbor's
    predicted error 0.25 -> 0.33), exact once spread's error is over the budget too."""
    from megatron_mecefo.planner.calibration import load_profile

    profile = load_profile(str(REPO / "results" / "planner_profile.json"))
    cfg = PlannerConfig(grad_error_budget=DEFAULT_GRAD_ERROR_BUDGET)
    speed_only = PlannerConfig()
    choices = []
    for k in range(1, 9):
        state = FailureState(32, frozenset(1 + 4 * i for i in range(k)), 1)
        d = plan_recovery(state, profile, cfg)
        assert d.grad_error <= DEFAULT_GRAD_ERROR_BUDGET
        assert plan_recovery(state, profile, speed_only).policy == "neighbor"
        choices.append(d.policy)
    assert choices == ["neighbor"] * 2 + ["spread"] * 3 + ["exact"] * 3


@pytest.mark.parametrize("microbatches", [2, 4])
def test_with_several_microbatches_auto_is_the_fastest_lossless_policy(microbatches) -> None:
    """At 32 replicas of 2 or 4 micro-batches (the n = 32 study's second configuration), with
    the committed profile and the default budget: spread's busiest replica runs its own
    micro-batches plus at most one absorbed one, so spread is both within the budget and at
    least as fast as neighbor (and exact) at the default r: auto takes it for 1 to 4 down."""
    from megatron_mecefo.planner.calibration import load_profile
    from megatron_mecefo.planner.recovery_planner import fixed_decision

    profile = load_profile(str(REPO / "results" / "planner_profile.json"))
    cfg = PlannerConfig(grad_error_budget=DEFAULT_GRAD_ERROR_BUDGET)
    for k in range(1, 5):
        state = FailureState(32, frozenset(1 + 8 * i for i in range(k)), microbatches)
        d = plan_recovery(state, profile, cfg)
        fixed = {
            p: fixed_decision(p, state, profile, PlannerConfig()).throughput_rel
            for p in ("neighbor", "spread", "exact")
        }
        assert d.policy == "spread" and d.grad_error <= DEFAULT_GRAD_ERROR_BUDGET
        assert d.throughput_rel == pytest.approx(max(fixed.values()), rel=1e-9)
        assert fixed["spread"] >= fixed["neighbor"] > fixed["exact"]
