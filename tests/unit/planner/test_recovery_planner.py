"""The recovery planner: equal to brute force, within budgets, recompute at the right headroom.

The brute force here is written independently of the planner: it builds each policy's real
plan, walks every replica's micro-batches, and tries every integer r within the bounds.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Optional, Tuple

import pytest

from megatron_mecefo.planner.recovery_planner import (
    CHOICES,
    CostProfile,
    FailureState,
    PlannerConfig,
    build_choice,
    expected_duration_s,
    plan_recovery,
)
from megatron_mecefo.takeover.plan import TAKEOVER

# A profile with the shape of the measured one (results/planner_profile.json) in round numbers.
PROFILE = CostProfile(
    exact_ms=20.0,
    takeover_ms=13.0,
    takeover_recompute_ms=17.0,
    optimizer_ms=5.0,
    sync_ms=6.0,
    sync_replicas=4,
    profile_rank=32,
    takeover_ms_per_rank=0.05,
    basis_refresh_ms=11.0,
    regroup_ms=670.0,
    rejoin_ms=940.0,
    activation_exact_bytes=8e6,
    activation_takeover_bytes=3.4e6,
    activation_takeover_recompute_bytes=0.4e6,
    activation_bytes_per_rank=4096.0,
    in_flight=1,
)


def _peak(plan, profile: CostProfile, rank: int, recompute: bool) -> float:
    """Largest saved activations of any replica: biggest micro-batch x micro-batches in flight."""
    if recompute:
        base = profile.activation_takeover_recompute_bytes
    else:
        base = profile.activation_takeover_bytes
    act_t = base + profile.activation_bytes_per_rank * (rank - profile.profile_rank)
    worst = 0.0
    for w in plan.work:
        if w:
            acts = [act_t if mb.mode is TAKEOVER else profile.activation_exact_bytes for mb in w]
            worst = max(worst, max(acts) * min(profile.in_flight, len(w)))
    return worst


def brute_force(
    state: FailureState, profile: CostProfile, cfg: PlannerConfig
) -> Tuple[float, float, str]:
    """(objective, step time, policy) of the best allowed (policy, recompute, r)."""
    n, m, k = state.num_replicas, state.microbatches, len(state.failed)
    horizon_ms = 1e3 / ((n - k) / (cfg.mtbf_hours * 3600) + k / (cfg.mttr_hours * 3600))
    ff_peak = profile.activation_exact_bytes * min(profile.in_flight, m)
    limit = ff_peak + cfg.memory_headroom_bytes
    best = (math.inf, math.inf, "")
    for policy in cfg.policies:
        plan = build_choice(policy).plan(1, state.failed, n, m)
        takeover_share = plan.num_takeover / (n * m)
        lost = 1 - plan.processed / (n * m)
        if lost > cfg.sample_loss_budget or takeover_share > cfg.approx_budget:
            continue
        if policy == "shrink" and not cfg.allow_shrink:
            continue
        ranks = range(cfg.rank_min, cfg.rank_max + 1) if plan.num_takeover else [None]
        for r, recompute in itertools.product(ranks, (False, True)):
            if r is None and recompute:
                continue
            rr = r or profile.profile_rank
            base = profile.takeover_recompute_ms if recompute else profile.takeover_ms
            t_mb = base + profile.takeover_ms_per_rank * (rr - profile.profile_rank)
            refresh = profile.basis_refresh_ms * rr / profile.profile_rank if r else 0.0

            if _peak(plan, profile, rr, recompute) > limit or (
                recompute and _peak(plan, profile, rr, False) <= limit
            ):
                continue
            work = 0.0
            for w in plan.work:
                t = sum(mb.mode is TAKEOVER for mb in w)
                extra = refresh / cfg.basis_interval if t else 0.0
                work = max(work, (len(w) - t) * profile.exact_ms + t * t_mb + extra)
            replicas = n - k if policy == "shrink" else n
            step = work + profile.optimizer_ms + profile.sync_time(replicas)
            transition = refresh + (
                profile.regroup_ms + profile.rejoin_ms if policy == "shrink" else 0.0
            )
            objective = step * (1 + transition / horizon_ms) / (plan.processed / (n * m))
            if objective < best[0] - 1e-9:
                best = (objective, step, policy)
    return best


def grid():
    configs = [
        PlannerConfig(),
        PlannerConfig(sample_loss_budget=0.25, rank_min=8, rank_max=64),
        PlannerConfig(approx_budget=0.0, allow_shrink=True),
        PlannerConfig(approx_budget=0.1, allow_shrink=True, mttr_hours=0.01),
        PlannerConfig(memory_headroom_bytes=2e6, policies=("neighbor", "exact", "drop")),
    ]
    profiles = [PROFILE, PROFILE.__class__(**{**PROFILE.to_json(), "in_flight": 4,
                                               "activation_takeover_bytes": 7.5e6})]  # fmt: skip
    rng = random.Random(7)
    for n in (2, 4, 8, 32):
        for k in sorted({1, 2, n // 2, n - 1} - {0, n}):
            failed = frozenset(rng.sample(range(n), k))
            for m, cfg, prof in itertools.product((1, 2, 4), configs, profiles):
                yield FailureState(n, failed, m), cfg, prof


def test_auto_equals_brute_force_on_a_grid() -> None:
    checked, winners = 0, set()
    for state, cfg, prof in grid():
        best = brute_force(state, prof, cfg)
        d = plan_recovery(state, prof, cfg)
        if best[2] == "":  # nothing fits: exact, above the headroom, with a note
            assert d.policy == "exact" and "exact taken above it" in d.notes[-1]
            continue
        assert d.objective == pytest.approx(best[0], rel=1e-9), (state, cfg, d, best)
        assert d.step_time_ms == pytest.approx(best[1], rel=1e-9), (state, cfg, d, best)
        checked += 1
        winners.add((d.policy, d.recompute_ffn))
    assert checked > 250
    # The grid is not one-sided: every choice wins somewhere, recompute too.
    assert {p for p, _ in winners} == set(CHOICES) and ("neighbor", True) in winners


def test_never_breaks_a_budget() -> None:
    rng = random.Random(3)
    policies_seen = set()
    for _ in range(300):
        n = rng.choice([2, 3, 4, 8, 16, 64])
        k = rng.randint(1, n - 1)
        state = FailureState(n, frozenset(rng.sample(range(n), k)), rng.choice([1, 2, 4, 8]))
        lo = rng.choice([4, 16, 32])
        cfg = PlannerConfig(
            sample_loss_budget=rng.choice([0.0, 0.05, 0.3]),
            approx_budget=rng.choice([0.0, 0.02, 0.2, 1.0]),
            rank_min=lo,
            rank_max=lo * rng.choice([1, 2, 4]),
            memory_headroom_bytes=rng.choice([0.0, 1e6]),
            allow_shrink=rng.random() < 0.5,
        )
        d = plan_recovery(state, PROFILE, cfg)
        policies_seen.add(d.policy)
        assert d.samples_lost_share <= cfg.sample_loss_budget + 1e-12
        assert d.takeover_share <= cfg.approx_budget + 1e-12
        assert d.rank is None or cfg.rank_min <= d.rank <= cfg.rank_max
        assert d.peak_memory_bytes <= d.failure_free_peak_bytes + cfg.memory_headroom_bytes
        assert cfg.allow_shrink or d.policy != "shrink"
    assert policies_seen == set(CHOICES)  # the sweep reaches every choice


def test_recompute_flips_at_the_memory_headroom() -> None:
    # PP-like: 4 micro-batches in flight, 2 per replica; a neighbour's 4 takeover micro-batches
    # (act 6e6 each) then hold 24e6 against the failure-free 2 x 8e6 = 16e6.
    prof = CostProfile(**{**PROFILE.to_json(), "in_flight": 4, "activation_takeover_bytes": 6e6,
                          "activation_bytes_per_rank": 0.0})  # fmt: skip
    state = FailureState(4, frozenset({1}), 2)
    cfg = PlannerConfig(policies=("neighbor", "exact"))
    need = 4 * 6e6 - 2 * 8e6
    below = plan_recovery(
        state, prof, PlannerConfig(**{**cfg.__dict__, "memory_headroom_bytes": need - 1})
    )
    at = plan_recovery(
        state, prof, PlannerConfig(**{**cfg.__dict__, "memory_headroom_bytes": need})
    )
    assert (below.policy, below.recompute_ffn) == ("neighbor", True)
    assert (at.policy, at.recompute_ffn) == ("neighbor", False)
    assert at.peak_memory_bytes == need + 2 * 8e6 and below.peak_memory_bytes == 2 * 8e6
    # Recompute switched off: the neighbour does not fit below the threshold, exact is left.
    off = PlannerConfig(
        **{**cfg.__dict__, "memory_headroom_bytes": need - 1, "recompute_ffn": False}
    )
    assert plan_recovery(state, prof, off).policy == "exact"


def test_shrink_pays_back_over_a_long_failure_only() -> None:
    # No approximation allowed: exact (a neighbour doing double work) or shrink (regroup once).
    state = FailureState(32, frozenset({5}), 4)
    n, k = 32, 1
    exact_step = 8 * PROFILE.exact_ms + PROFILE.optimizer_ms + PROFILE.sync_time(32)
    shrink_step = 5 * PROFILE.exact_ms + PROFILE.optimizer_ms + PROFILE.sync_time(31)
    cost = PROFILE.regroup_ms + PROFILE.rejoin_ms
    # Break-even horizon H: shrink (1 + C/H) = exact.
    h_even = cost / (exact_step / shrink_step - 1) / 1e3  # s

    def mttr_for(h_s: float) -> float:  # MTTR (h) whose horizon is h_s, failures negligible
        return k * h_s / 3600.0

    results = {}
    for factor in (0.9, 1.1):
        mttr = mttr_for(h_even * factor)
        cfg = PlannerConfig(approx_budget=0.0, allow_shrink=True, mttr_hours=mttr, mtbf_hours=1e9)
        assert expected_duration_s(n, k, 1e9, mttr) == pytest.approx(h_even * factor, rel=1e-6)
        results[factor] = plan_recovery(state, PROFILE, cfg).policy
    assert results == {0.9: "exact", 1.1: "shrink"}


def test_every_rank_gets_the_same_decision_and_bad_budgets_are_refused() -> None:
    state = FailureState(8, frozenset({2, 5}), 4)
    cfg = PlannerConfig(sample_loss_budget=0.3)
    assert plan_recovery(state, PROFILE, cfg) == plan_recovery(state, PROFILE, cfg)
    with pytest.raises(ValueError, match="approx_budget"):
        PlannerConfig(approx_budget=1.5).validate()
    with pytest.raises(ValueError, match="rank bounds"):
        PlannerConfig(rank_min=64, rank_max=32).validate()
    with pytest.raises(ValueError, match="no recovery choice fits"):
        plan_recovery(state, PROFILE, PlannerConfig(policies=("drop",)))
    # Two micro-batches in flight, one per replica: exact's neighbour holds two, over the
    # headroom; nothing else fits either, so exact is taken with a note.
    tight = CostProfile(**{**PROFILE.to_json(), "in_flight": 2})
    d = plan_recovery(FailureState(4, frozenset({0}), 1), tight, PlannerConfig(approx_budget=0))
    assert d.policy == "exact" and d.peak_memory_bytes == 2 * d.failure_free_peak_bytes
    none: Optional[str] = plan_recovery(FailureState(8, frozenset(), 4), PROFILE, cfg).policy
    assert none == "none"


def test_the_analytic_plan_counts_equal_the_real_policies() -> None:
    from megatron_mecefo.planner.recovery_planner import _plan_shape, analytic_shape

    rng = random.Random(11)
    checked = 0
    for _ in range(200):
        n = rng.choice([2, 3, 5, 8, 13, 32, 64])
        k = rng.randint(1, n - 1)
        m = rng.choice([1, 2, 3, 4])
        failed = frozenset(rng.sample(range(n), k))
        for policy in CHOICES:
            fast = analytic_shape(policy, n, k, m)
            if fast is None:
                assert policy in ("neighbor", "exact") and k > n - k
                continue
            real = _plan_shape.__wrapped__(policy, failed, n, m, True)
            assert (fast.pairs, fast.processed, fast.takeover, fast.replicas_after) == (
                real.pairs,
                real.processed,
                real.takeover,
                real.replicas_after,
            ), (policy, n, sorted(failed), m)
            checked += 1
    assert checked > 800
