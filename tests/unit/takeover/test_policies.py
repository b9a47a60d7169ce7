"""Takeover policies, single process: coverage, modes, the ring rule and the re-weighting
identities, for every failed set at n <= 4 and random ones at n = 8."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron_mecefo.takeover.data_remap import GlobalBatchLayout
from megatron_mecefo.takeover.plan import StepPlan
from megatron_mecefo.takeover.policies import POLICIES, build_policy, ring_neighbours
from megatron_mecefo.techniques.state import MicrobatchMode

EXACT, TAKEOVER = MicrobatchMode.EXACT, MicrobatchMode.TAKEOVER


def _failed_sets(n: int) -> list[frozenset[int]]:
    """Every subset for n <= 4; for larger n the edge cases plus 60 seeded random subsets."""
    if n <= 4:
        return [frozenset(c) for k in range(n + 1) for c in itertools.combinations(range(n), k)]
    rng = random.Random(n)
    sets = {frozenset(), frozenset(range(n)), frozenset(range(n - 1))}
    sets |= {frozenset([r]) for r in range(n)}
    sets |= {frozenset([r, (r + 1) % n]) for r in range(n)}  # adjacent pairs
    while len(sets) < 2 * n + 3 + 60:
        sets.add(frozenset(r for r in range(n) if rng.random() < rng.random()))
    return sorted(sets, key=sorted)


def _all_plans(policy_name: str, skip_attention: bool = True):
    policy = build_policy(policy_name, skip_attention=skip_attention)
    for n in (2, 3, 4, 8):
        for m in (1, 2, 3):
            for failed in _failed_sets(n):
                yield n, m, failed, policy.plan(17, failed, n, m)


# ----------------------------------------------------------------------------- policies
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_plans_cover_the_global_batch_exactly_once(policy: str) -> None:
    count = 0
    for n, m, failed, plan in _all_plans(policy):
        everything = [(r, k) for r in range(n) for k in range(m)]
        covered = [(mb.source, mb.index) for w in plan.work for mb in w] + list(plan.skipped)
        assert sorted(covered) == everything, (n, m, failed)
        assert all(not plan.work[f] for f in failed), (n, m, failed)
        assert plan.failed == tuple(sorted(failed))
        assert plan.processed + len(plan.skipped) == n * m
        # The same, on concrete sample indices (2 samples per micro-batch, 5 batches in).
        layout = GlobalBatchLayout(2 * m * n, 2, n)
        counts = layout.account(plan, consumed_samples=5 * 2 * m * n)
        assert counts == {
            "samples_processed": 2 * plan.processed,
            "samples_skipped": 2 * len(plan.skipped),
        }
        count += 1
    assert count > 200


def _next_alive(f: int, alive: list[int], n: int) -> int:
    return next((f + d) % n for d in range(1, n) if (f + d) % n in alive)


def _own_and_absorbed(plan: StepPlan, r: int):
    own = [mb for mb in plan.work[r] if mb.source == r]
    absorbed = [mb for mb in plan.work[r] if mb.source != r]
    return own, absorbed


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_plan_modes(policy: str) -> None:
    for n, m, failed, plan in _all_plans(policy):
        alive = [r for r in range(n) if r not in failed]
        ctx = (n, m, sorted(failed))
        if not alive or not failed:
            continue
        for r in alive:  # every alive replica runs all its own micro-batches, in order
            own, _ = _own_and_absorbed(plan, r)
            assert [mb.index for mb in own] == list(range(m)), ctx
        if policy in ("neighbor", "exact"):
            assert sorted(plan.neighbours) == sorted(failed), ctx
            for r in alive:
                _, absorbed = _own_and_absorbed(plan, r)
                sources = sorted({mb.source for mb in absorbed})
                assert sources == sorted(f for f, nb in plan.neighbours.items() if nb == r), ctx
        if policy == "neighbor":
            absorbers = set(plan.neighbours.values())
            normal = [r for r in alive if r not in absorbers]
            for r in alive:
                own, absorbed = _own_and_absorbed(plan, r)
                assert all(mb.mode is TAKEOVER for mb in absorbed), ctx
                if r not in absorbers:
                    assert not absorbed and all(mb.mode is EXACT for mb in own), ctx
                elif normal:
                    assert all(mb.mode is TAKEOVER for mb in own), ctx
                else:  # fallback: no normal replica left
                    assert all(mb.mode is EXACT for mb in own), ctx
            if not normal:
                assert any("no normal replica" in note for note in plan.notes), ctx
            plain = all(nb == _next_alive(f, alive, n) for f, nb in plan.neighbours.items())
            if normal and plain and len(absorbers) == len(failed):
                assert plan.notes == (), ctx
        elif policy == "spread":
            assert plan.neighbours == {}
            takeovers = []
            for r in alive:
                own, absorbed = _own_and_absorbed(plan, r)
                assert all(mb.mode is EXACT for mb in own), ctx
                assert all(mb.mode is TAKEOVER for mb in absorbed), ctx
                takeovers.append(len(absorbed))
            assert max(takeovers) - min(takeovers) <= 1, ctx
            assert sum(takeovers) == len(failed) * m
        elif policy == "exact":
            assert all(mb.mode is EXACT for w in plan.work for mb in w), ctx
        else:  # drop
            assert plan.skipped == tuple((f, k) for f in sorted(failed) for k in range(m)), ctx
            assert all(
                [(mb.source, mb.index, mb.mode) for mb in plan.work[r]]
                == [(r, k, EXACT) for k in range(m)]
                for r in alive
            ), ctx
        if policy != "drop":
            assert plan.skipped == (), ctx


@pytest.mark.parametrize("policy", ["neighbor", "exact"])
def test_ring_rule(policy: str) -> None:
    for n, _m, failed, plan in _all_plans(policy):
        alive = [r for r in range(n) if r not in failed]
        if not alive or not failed:
            continue
        nbs = plan.neighbours
        absorbed_by: dict[int, list[int]] = {}
        for f in sorted(failed):
            nb = nbs[f]
            assert nb in alive
            earlier = {nbs[g] for g in failed if g < f}
            ring = [(f + d) % n for d in range(1, n) if (f + d) % n in alive]
            free = [r for r in ring if r not in earlier]
            # The next alive replica on the ring that no lower failed replica took, else the
            # plain ring neighbour.
            assert nb == (free[0] if free else ring[0]), (n, sorted(failed), f, nbs)
            absorbed_by.setdefault(nb, []).append(f)
        counts = [len(absorbed_by.get(r, [])) for r in alive]
        if len(failed) <= len(alive):
            assert max(counts) == 1, (n, sorted(failed), nbs)  # at most one each while possible
        else:
            assert min(counts) >= 1, (n, sorted(failed), nbs)  # load spread over every survivor
    # One failure: the next alive replica on the ring, wrapping around.
    plan = build_policy(policy).plan(1, frozenset({3}), 4, 2)
    assert plan.neighbours == {3: 0}
    plan = build_policy(policy).plan(1, frozenset({1, 2}), 4, 2)
    assert plan.neighbours == {1: 3, 2: 0}
    # The fallbacks are noted for the run log.
    nbs, notes = ring_neighbours([1, 2], [0, 3], 4)
    assert nbs == {1: 3, 2: 0} and len(notes) == 1 and "replica 0 absorbs 2" in notes[0]
    nbs, notes = ring_neighbours([0, 1, 2], [3], 4)
    assert nbs == {0: 3, 1: 3, 2: 3} and len(notes) == 2
    assert all("more replicas down than up" in note for note in notes)


@pytest.mark.parametrize("skip_attention", [True, False])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_reweighting_identities(policy: str, skip_attention: bool) -> None:
    for n, m, failed, plan in _all_plans(policy, skip_attention):
        ctx = (n, m, sorted(failed))
        if plan.no_update:
            continue
        p = plan.processed
        # DDP averages over n, the schedule divides by L_r: each processed micro-batch must end
        # up with weight 1/P, so the non-MHA gradient is the mean over the processed ones.
        weights = [
            (mb, plan.loss_weight(r) / (len(w) * n)) for r, w in enumerate(plan.work) for mb in w
        ]
        assert all(wt == pytest.approx(1 / p, rel=1e-12) for _, wt in weights), ctx
        assert math.fsum(wt for _, wt in weights) == pytest.approx(1.0, rel=1e-12), ctx
        # MHA group: only exact micro-batches contribute; after mha_scale it is their mean.
        mha = [wt for mb, wt in weights if mb.mode is EXACT or not skip_attention]
        assert len(mha) == plan.mha_exact > 0, ctx
        assert math.fsum(mha) * plan.mha_scale == pytest.approx(1.0, rel=1e-12), ctx
        assert plan.mha_exact_fraction == pytest.approx(len(mha) / (n * m), rel=1e-12), ctx
        if not skip_attention:
            assert plan.mha_scale == 1.0, ctx
        assert all(plan.loss_weight(f) == 0.0 for f in failed)
        assert plan.loss_weight_per_token == 1.0


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_neighbor_single_failure_matches_the_paper(n: int) -> None:
    for m in (1, 2, 3):
        for f in range(n):
            plan = build_policy("neighbor").plan(4, frozenset({f}), n, m)
            assert plan.neighbours == {f: (f + 1) % n}
            assert plan.mha_scale == pytest.approx(n / (n - 2), rel=1e-12)  # n / |N|
            assert plan.mha_exact_fraction == pytest.approx((n - 2) / n, rel=1e-12)
            assert plan.num_takeover == 2 * m
            assert plan.loss_weight((f + 1) % n) == pytest.approx(2.0)
            assert plan.notes == ()
    # DP = 2: no normal replica; the neighbour runs its own work exactly (MHA mean over it).
    plan = build_policy("neighbor").plan(4, frozenset({0}), 2, 3)
    assert plan.modes(1) == [EXACT] * 3 + [TAKEOVER] * 3
    assert plan.mha_scale == pytest.approx(2.0) and plan.notes


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_failure_free_and_all_down_plans(policy: str) -> None:
    for n in (1, 2, 3, 4, 8):
        for m in (1, 2, 3):
            plan = build_policy(policy).plan(9, frozenset(), n, m)
            assert not plan.degraded and not plan.no_update
            assert all(plan.loss_weight(r) == 1.0 for r in range(n))  # exactly, not approx
            assert plan.mha_scale == 1.0 and plan.mha_exact_fraction == 1.0
            assert plan.skipped == () and plan.notes == () and plan.num_takeover == 0
            assert all(plan.modes(r) == [EXACT] * m for r in range(n))

            down = build_policy(policy).plan(9, frozenset(range(n)), n, m)
            assert down.no_update and down.degraded and down.processed == 0
            assert sorted(down.skipped) == [(r, k) for r in range(n) for k in range(m)]
            assert all(down.loss_weight(r) == 0.0 for r in range(n))
            assert down.mha_scale == 1.0 and down.notes
            summary = down.summary()
            assert summary["microbatches_skipped"] == n * m
            assert summary["failed_replicas"] == list(range(n))


def test_summary_fields() -> None:
    plan = build_policy("neighbor").plan(5, frozenset({1}), 4, 2)
    assert plan.summary() == {
        "failed_replicas": [1],
        "policy": "neighbor",
        "neighbours": {"1": 2},
        "microbatches_per_replica": [2, 0, 4, 2],
        "takeover_microbatches": 4,
        "mha_exact_fraction": 0.5,
        "mha_scale": 2.0,
        "microbatches_skipped": 0,
        "fallback": [],
    }
    with pytest.raises(ValueError, match="unknown takeover policy 'bogus'"):
        build_policy("bogus")
