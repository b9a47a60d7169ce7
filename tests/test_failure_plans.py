"""Failure schedules, takeover plans, replica topology and the ``--mecefo-*`` flags.

Fast and single-process: no process group is created. Every property here is one a wrong
schedule, plan or check would break (a sample processed twice, a gradient mis-weighted, a
replica out of range accepted, a bad flag reaching torch.distributed).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import random
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
from conftest import TRAINER, child_env

from megatron_mecefo.arguments import FaultToleranceConfig, MecefoConfigError
from megatron_mecefo.data_remap import GlobalBatchLayout, ReplicaMicrobatches
from megatron_mecefo.failure_schedule import (
    NEVER,
    PAPER_SCENARIOS,
    FailureEvent,
    FailureSchedule,
    ScheduleError,
)
from megatron_mecefo.state import MicrobatchMode
from megatron_mecefo.takeover_policy import (
    POLICIES,
    MicrobatchWork,
    StepPlan,
    build_policy,
    ring_neighbours,
)

EXACT, TAKEOVER = MicrobatchMode.EXACT, MicrobatchMode.TAKEOVER


# ----------------------------------------------------------------------------- helpers
def _max_down(schedule: FailureSchedule) -> int:
    """Most replicas down at once, by a sweep over the [fail, recover) intervals."""
    points = []
    for e in schedule.events:
        points += [(e.fail_iteration, 1), (e.recover_iteration, -1)]
    points.sort()  # at one iteration, recoveries (-1) before failures (+1): [fail, recover)
    down = most = 0
    for _, delta in points:
        down += delta
        most = max(most, down)
    return most


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


# ----------------------------------------------------------------------------- schedules
def test_scripted_parsing_and_boundaries() -> None:
    s = FailureSchedule.scripted(["1:5:8", "3:7", "0:1:2", "0:2:4"], num_replicas=4)
    assert s.events == (
        FailureEvent(1, 2, 0),
        FailureEvent(2, 4, 0),
        FailureEvent(5, 8, 1),
        FailureEvent(7, NEVER, 3),
    )
    expected = {
        1: {0}, 2: {0}, 3: {0}, 4: set(), 5: {1}, 6: {1},
        7: {1, 3}, 8: {3}, 9: {3}, 10**6: {3}, 10**12: {3},
    }  # fmt: skip
    for iteration, down in expected.items():
        assert s.failed_at(iteration) == frozenset(down), iteration
    assert s.degraded_iterations(10) == 9  # every iteration but 4
    assert FailureSchedule.none(4).failed_at(1) == frozenset()


@pytest.mark.parametrize(
    "specs,dp,match",
    [
        (["2:5:9"], 2, "replica 2.*only 2 data-parallel replicas"),
        (["7:1"], 4, "replica 7"),
        (["-1:3"], 4, "replica -1"),
        (["1:5:9", "1:8:12"], 2, "replica 1 fails at iteration 8 while still down"),
        (["0:5", "0:100:200"], 2, "replica 0 fails at iteration 100 while still down"),
        (["1"], 2, "expected REPLICA:FAIL_ITERATION"),
        (["1:2:3:4"], 2, "expected REPLICA:FAIL_ITERATION"),
        (["a:5"], 2, "expected REPLICA:FAIL_ITERATION"),
        (["1:5:x"], 2, "expected REPLICA:FAIL_ITERATION"),
        (["1:0:4"], 2, "1 <= fail_iteration < recover_iteration"),
        (["1:5:5"], 2, "1 <= fail_iteration < recover_iteration"),
        (["1:6:5"], 2, "1 <= fail_iteration < recover_iteration"),
    ],
)
def test_scripted_errors(specs: list[str], dp: int, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        FailureSchedule.scripted(specs, dp)


def _paper_expected(scenario: str, step_time: float, train_iters: int):
    """(fail, recover) of the k-th failure in exact arithmetic: ceil(k * hours * 3600 / s)."""
    fail_h, recover_h = (Fraction(x) for x in PAPER_SCENARIOS[scenario])
    st = Fraction(step_time)
    out, k = [], 1
    while math.ceil(k * fail_h * 3600 / st) <= train_iters:
        fail = math.ceil(k * fail_h * 3600 / st)
        out.append((fail, max(fail + 1, math.ceil((k * fail_h + recover_h) * 3600 / st))))
        k += 1
    return out


@pytest.mark.parametrize("scenario", sorted(PAPER_SCENARIOS))
@pytest.mark.parametrize("step_time", [2.5, 3.0])
def test_paper_scenarios_spacing_and_duration(scenario: str, step_time: float) -> None:
    # 8 replicas: at most 4 are down at once in any scenario, so no failure is dropped.
    train_iters = 40_000
    s = FailureSchedule.paper(scenario, 8, train_iters, step_time, seed=5)
    expected = _paper_expected(scenario, step_time, train_iters)
    assert len(expected) >= 10
    assert [(e.fail_iteration, e.recover_iteration) for e in s.events] == expected
    fail_h, recover_h = PAPER_SCENARIOS[scenario]
    every, after = fail_h * 3600 / step_time, recover_h * 3600 / step_time
    gaps = {
        b.fail_iteration - a.fail_iteration for a, b in zip(s.events, s.events[1:], strict=False)
    }
    assert gaps <= {math.floor(every), math.ceil(every)}
    assert {e.recover_iteration - e.fail_iteration for e in s.events} <= {
        math.floor(after),
        math.ceil(after),
    }
    assert s.events[0].fail_iteration == math.ceil(every)
    assert 1 <= _max_down(s) <= math.ceil(recover_h / fail_h)


def test_paper_iteration_is_exact_when_time_is_a_whole_number_of_steps() -> None:
    s = FailureSchedule.paper("low", 8, 8000, 7.0, seed=0)
    assert s.events[6].fail_iteration == 7200  # 7 failures x 2 h = 50400 s = 7200 x 7 s


@pytest.mark.parametrize("scenario", sorted(PAPER_SCENARIOS))
def test_paper_scenarios_are_deterministic_per_seed(scenario: str) -> None:
    make = lambda seed: FailureSchedule.paper(scenario, 8, 60_000, 3.0, seed)  # noqa: E731
    assert make(11).events == make(11).events
    victims = {tuple(e.replica for e in make(seed).events) for seed in range(10)}
    assert len(victims) >= 9  # dozens of victims out of 8: different seeds, different victims
    # Failure times do not depend on the seed, only the victims.
    times = {tuple((e.fail_iteration, e.recover_iteration) for e in make(s).events) for s in (1, 2)}
    assert len(times) == 1


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("scenario", sorted(PAPER_SCENARIOS))
def test_paper_never_takes_every_replica_down(n: int, scenario: str) -> None:
    # 600 s per iteration: 'low' wants 2 replicas down at once, 'mid' 3 and 'high' 4.
    train_iters = 200
    fail_h, recover_h = PAPER_SCENARIOS[scenario]
    concurrent = math.ceil(recover_h / fail_h)
    wanted = len(_paper_expected(scenario, 600.0, train_iters))
    for seed in range(3):
        s = FailureSchedule.paper(scenario, n, train_iters, 600.0, seed)
        assert all(len(s.failed_at(i)) < n for i in range(1, train_iters + 100))
        if concurrent < n:
            assert len(s.events) == wanted and _max_down(s) == concurrent
        else:  # failures that would take the last replica down are dropped
            assert len(s.events) < wanted and _max_down(s) == n - 1


def test_poisson_is_deterministic_per_seed() -> None:
    make = lambda seed: FailureSchedule.poisson(4, 20_000, 2.0, 1.0, 0.5, seed)  # noqa: E731
    assert make(3).events == make(3).events
    assert len(make(3).events) > 20
    assert len({make(seed).events for seed in range(5)}) == 5


def test_poisson_mean_failures_match_the_rate() -> None:
    # 4 replicas x 240000 s / 360 s MTBF = 2667 expected failures; repairs (3.6 s) are short,
    # so the replicas are up ~99% of the time and hardly any failure is dropped.
    n, train_iters, step_time, mtbf, mttr = 4, 240_000, 1.0, 0.1, 0.001
    expected = train_iters * step_time * n / (mtbf * 3600)
    for seed in (0, 1):
        s = FailureSchedule.poisson(n, train_iters, step_time, mtbf, mttr, seed)
        assert abs(len(s.events) - expected) <= 0.15 * expected, (len(s.events), expected)
        assert _max_down(s) < n
        # Every replica fails, and about equally often.
        per_replica = [sum(e.replica == r for e in s.events) for r in range(n)]
        assert min(per_replica) > 0.75 * expected / n
        assert all(1 <= e.fail_iteration <= train_iters for e in s.events)


def test_poisson_never_takes_every_replica_down_with_long_repairs() -> None:
    # MTTR = 2 x MTBF: without the rule the two replicas would often be down together.
    n, train_iters = 2, 50_000
    for seed in range(3):
        s = FailureSchedule.poisson(n, train_iters, 1.0, 0.5, 1.0, seed)
        assert _max_down(s) < n
        degraded = s.degraded_iterations(train_iters)
        assert degraded > 0.3 * train_iters  # failures were frequent, yet never both at once


def test_poisson_never_takes_every_replica_down_with_repairs_shorter_than_a_step() -> None:
    for seed in range(10):
        s = FailureSchedule.poisson(2, 200, 100.0, 0.2, 0.01, seed)
        assert _max_down(s) < 2, (seed, [i for i in range(1, 201) if len(s.failed_at(i)) == 2])


def test_poisson_rejects_nonpositive_rates() -> None:
    with pytest.raises(ScheduleError, match="positive"):
        FailureSchedule.poisson(2, 100, 1.0, 0.0, 1.0, 0)
    with pytest.raises(ScheduleError, match="positive"):
        FailureSchedule.poisson(2, 100, 1.0, 1.0, -1.0, 0)


def test_replay_round_trips_to_json(tmp_path: Path) -> None:
    scripted = FailureSchedule.scripted(["0:3:9", "2:5", "1:9:11"], 4)
    paper = FailureSchedule.paper("high", 4, 3_000, 30.0, seed=2)
    for original in (scripted, paper):
        trace = tmp_path / "trace.json"
        trace.write_text(json.dumps(original.to_json()))
        replayed = FailureSchedule.replay(str(trace), 4)
        assert replayed.events == original.events
        assert replayed.num_replicas == original.num_replicas
        # The bare-list form is accepted too.
        trace.write_text(json.dumps(original.to_json()["events"]))
        assert FailureSchedule.replay(str(trace), 4).events == original.events
    assert scripted.to_json()["events"][1] == {
        "replica": 2,
        "fail_iteration": 5,
        "recover_iteration": None,
    }


def test_replay_of_a_trace_in_seconds(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(
        json.dumps(
            {
                "events": [
                    {"replica": 1, "fail_time_s": 25.0, "recover_time_s": 61.0},
                    {"replica": 0, "fail_time_s": 0.0, "recover_time_s": 3.0},
                    {"replica": 2, "fail_time_s": 100.0, "recover_time_s": 101.0},
                    {"replica": 3, "fail_time_s": 140.0},
                    {"replica": 0, "fail_iteration": 20, "recover_iteration": 22},
                ]
            }
        )
    )
    s = FailureSchedule.replay(str(trace), 4, step_time_s=10.0)
    assert s.events == (
        FailureEvent(1, 2, 0),  # fail at 0 s -> iteration 1; recovery at least one later
        FailureEvent(3, 7, 1),  # 25 s -> ceil(2.5) = 3, 61 s -> ceil(6.1) = 7
        FailureEvent(10, 11, 2),  # 100 s -> 10, 101 s -> 11
        FailureEvent(14, NEVER, 3),
        FailureEvent(20, 22, 0),
    )
    assert s.failed_at(6) == {1} and s.failed_at(7) == frozenset()
    with pytest.raises(ScheduleError, match="step time"):
        FailureSchedule.replay(str(trace), 4)


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "failure trace"),
        ('{"events": 3}', "expected a list of events"),
        ('[{"fail_iteration": 3}]', "event 0"),
        ('[{"replica": 1, "fail_iteration": "x"}]', "event 0"),
        ('[{"replica": 4, "fail_iteration": 3}]', "replica 4"),
        ('[{"replica": 1, "fail_iteration": 3}, {"replica": 1, "fail_iteration": 9}]',
         "while still down"),
    ],
)  # fmt: skip
def test_replay_errors(tmp_path: Path, content: str, match: str) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(content)
    with pytest.raises(ScheduleError, match=match):
        FailureSchedule.replay(str(trace), 4)
    with pytest.raises(ScheduleError, match="failure trace"):
        FailureSchedule.replay(str(tmp_path / "missing.json"), 4)


def test_config_replay_in_seconds_needs_a_step_time(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text('[{"replica": 1, "fail_time_s": 30}]')
    ft = FaultToleranceConfig(enabled=True, failure_schedule="replay", failure_trace=str(trace))
    with pytest.raises(MecefoConfigError, match="--mecefo-failure-trace.*step time"):
        ft.build_schedule(2, 100)
    ft.nominal_step_time_s = 10.0
    assert ft.build_schedule(2, 100).failed_at(3) == {1}


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


def test_account_rejects_a_plan_that_runs_a_microbatch_twice() -> None:
    good = build_policy("exact").plan(3, frozenset({1}), 3, 2)
    work = list(good.work)
    work[0] = work[0] + (MicrobatchWork(2, 1, EXACT),)  # replica 2's second micro-batch again
    bad = StepPlan(3, "exact", 3, 2, (1,), tuple(work))
    layout = GlobalBatchLayout(12, 2, 3)
    with pytest.raises(RuntimeError, match="processed 2 time"):
        layout.account(bad, 24)
    work = list(good.work)
    work[2] = work[2][:-1]  # replica 1's last micro-batch lost
    with pytest.raises(RuntimeError, match="processed 0 time"):
        layout.account(StepPlan(3, "exact", 3, 2, (1,), tuple(work)), 24)


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


def test_replica_microbatches_hand_out_own_then_absorbed_samples() -> None:
    n, m, mbs = 4, 2, 3
    layout = GlobalBatchLayout(n * m * mbs, mbs, n)
    consumed = 7 * n * m * mbs
    plan = build_policy("neighbor").plan(8, frozenset({1}), n, m)  # replica 2 absorbs 1
    samples = lambda s, i: layout.samples(consumed, s, i)  # noqa: E731
    fetched = []

    def fetch(indices):
        fetched.append(list(indices))
        return ("fetched", tuple(indices))

    it = ReplicaMicrobatches(plan.work[2], ["own0", "own1"], fetch, samples, replica=2)
    got = list(it)
    assert len(got) == len(plan.work[2]) == 2 * m
    for mb, item in zip(plan.work[2], got, strict=True):
        if mb.source == 2:
            assert item == ["own0", "own1"][mb.index]
        else:
            assert mb.source == 1 and item == ("fetched", tuple(samples(1, mb.index)))
    assert sorted(fetched) == [samples(1, k) for k in range(m)]
    assert it.processed == [samples(mb.source, mb.index) for mb in plan.work[2]]
    # Replica 1's micro-batches are the ones Megatron's sampler gives DP rank 1.
    assert samples(1, 0) == [consumed + 3, consumed + 4, consumed + 5]
    assert samples(1, 1) == [consumed + 15, consumed + 16, consumed + 17]
    # A rank that reads no data (TP rank > 0) gets None throughout, but still the indices.
    it = ReplicaMicrobatches(plan.work[2], [None, None], None, samples, replica=2)
    assert list(it) == [None] * 4 and len(it.processed) == 4


# ----------------------------------------------------------------------------- topology
def _reference_rank(order: str, tp: int, cp: int, pp: int, dp: int, c) -> int:
    """Megatron's layout: the first axis of the order varies fastest (ep = 1)."""
    if order == "tp-cp-ep-dp-pp":
        return c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp))
    return c.tp + tp * (c.cp + cp * (c.pp + pp * c.dp))


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
@pytest.mark.parametrize(
    "tp,cp,pp,dp", [(2, 1, 2, 2), (2, 1, 2, 4), (1, 2, 1, 2), (2, 2, 2, 2), (1, 1, 1, 3)]
)
def test_topology_matches_megatron_core(order: str, tp: int, cp: int, pp: int, dp: int) -> None:
    from megatron.core.parallel_state import RankGenerator

    from megatron_mecefo.topology import ReplicaTopology

    topo = ReplicaTopology.build(tp=tp, cp=cp, pp=pp, dp=dp, order=order)
    world = tp * cp * pp * dp
    assert topo.world_size == world
    for rank, c in enumerate(topo.coordinates):
        assert _reference_rank(order, tp, cp, pp, dp, c) == rank, (rank, c)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    for axis, size in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp)):
        groups = gen.get_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(range(world))
        for group in groups:
            assert [getattr(topo.coordinates[r], axis) for r in group] == list(range(size))
            others = {
                tuple(
                    getattr(topo.coordinates[r], a) for a in ("tp", "cp", "pp", "dp") if a != axis
                )
                for r in group
            }
            assert len(others) == 1, (axis, group)
        if axis == "dp":
            for replica in range(dp):
                assert topo.ranks_of_replica(replica) == sorted(g[replica] for g in groups)
    # ranks_of_replica partitions the world; replica_of agrees.
    parts = [topo.ranks_of_replica(r) for r in range(dp)]
    assert sorted(itertools.chain(*parts)) == list(range(world))
    assert all(len(p) == tp * cp * pp for p in parts)
    assert all(topo.replica_of(rank) == r for r, p in enumerate(parts) for rank in p)
    # peer_in_replica keeps tp/cp/pp and moves to the asked replica.
    for rank in range(world):
        c = topo.coordinates[rank]
        assert topo.peer_in_replica(rank, c.dp) == rank
        for replica in range(dp):
            peer = topo.coordinates[topo.peer_in_replica(rank, replica)]
            assert (peer.tp, peer.cp, peer.pp, peer.dp) == (c.tp, c.cp, c.pp, replica)
    with pytest.raises(ValueError):
        topo.ranks_of_replica(dp)


def test_topology_known_groups() -> None:
    from megatron_mecefo.topology import ReplicaTopology

    topo = ReplicaTopology.build(tp=2, cp=1, pp=2, dp=4, order="tp-cp-ep-dp-pp")
    dp_groups = [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    for group in dp_groups:
        assert [topo.replica_of(r) for r in group] == [0, 1, 2, 3]
    assert topo.ranks_of_replica(0) == [0, 1, 8, 9]
    assert topo.ranks_of_replica(3) == [6, 7, 14, 15]
    assert topo.peer_in_replica(9, 2) == 13
    topo = ReplicaTopology.build(tp=2, cp=1, pp=2, dp=4, order="tp-cp-ep-pp-dp")
    assert topo.ranks_of_replica(1) == [4, 5, 6, 7]
    assert topo.peer_in_replica(2, 3) == 14
    topo = ReplicaTopology.build(tp=1, cp=2, pp=1, dp=2)
    assert topo.ranks_of_replica(0) == [0, 1] and topo.peer_in_replica(1, 1) == 3
    with pytest.raises(ValueError, match="rank order"):
        ReplicaTopology.build(tp=1, cp=1, pp=1, dp=2, order="dp-tp")
    with pytest.raises(ValueError, match="dp size"):
        ReplicaTopology.build(tp=1, cp=1, pp=1, dp=0)


# ----------------------------------------------------------------------------- flags
@pytest.fixture(scope="module")
def trainer_args():
    """examples/pretrain_gpt/arguments.py, loaded as the trainer loads it."""
    spec = importlib.util.spec_from_file_location(
        "pretrain_gpt_arguments_under_test", TRAINER.parent / "arguments.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _validate(trainer_args, world: int, flags: list[str]):
    args = trainer_args.build_parser().parse_args(["--mock-data", *flags])
    return trainer_args.validate_args(args, world)


BAD_FLAGS = [
    # (world size, flags, texts the one error line must contain)
    (2, ["--mecefo", "--mecefo-fail", "5:10:20"], ["--mecefo-fail", "replica 5", "only 2"]),
    (4, ["--mecefo", "--mecefo-fail", "1:10:20", "--mecefo-fail", "1:15"],
     ["--mecefo-fail", "replica 1 fails at iteration 15"]),
    (2, ["--mecefo", "--mecefo-fail", "1-10"], ["--mecefo-fail", "'1-10'"]),
    (1, ["--mecefo"], ["--mecefo-policy=neighbor", "data-parallel size is 1"]),
    (1, ["--mecefo", "--mecefo-policy", "spread"], ["--mecefo-policy=spread", "size is 1"]),
    (2, ["--mecefo", "--mecefo-rank", "4096"], ["--mecefo-rank=4096", "--hidden-size=128"]),
    (2, ["--mecefo", "--mecefo-rank", "0"], ["--mecefo-rank=0"]),
    (2, ["--mecefo-rank", "64"], ["without --mecefo"]),
    (2, ["--mecefo-fail", "1:5"], ["without --mecefo"]),
    (2, ["--mecefo", "--mecefo-fail", "1:5", "--mecefo-failure-schedule", "high",
         "--mecefo-nominal-step-time", "5"], ["--mecefo-fail", "scripted, not high"]),
    (2, ["--mecefo", "--mecefo-failure-schedule", "high"],
     ["--mecefo-failure-schedule=high", "--mecefo-nominal-step-time"]),
    (2, ["--mecefo", "--mecefo-failure-schedule", "low", "--mecefo-nominal-step-time", "-3"],
     ["--mecefo-nominal-step-time=-3"]),
    (2, ["--mecefo", "--mecefo-failure-schedule", "poisson", "--mecefo-nominal-step-time", "3"],
     ["--mecefo-failure-schedule=poisson", "--mecefo-mtbf-hours"]),
    (2, ["--mecefo", "--mecefo-failure-schedule", "replay"], ["--mecefo-failure-trace"]),
    (2, ["--mecefo", "--mecefo-failure-schedule", "scripted"], ["--mecefo-fail"]),
    (4, ["--mecefo", "--mecefo-policy", "spread", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8"],
     ["--mecefo-policy=spread", "--num-layers-per-virtual-pipeline-stage"]),
    (2, ["--mecefo", "--mecefo-grad-error-interval", "5", "--use-distributed-optimizer"],
     ["--mecefo-grad-error-interval", "--use-distributed-optimizer"]),
    (2, ["--mecefo", "--mecefo-grad-error-interval", "-1"], ["--mecefo-grad-error-interval=-1"]),
    (2, ["--mecefo", "--calculate-per-token-loss"],
     ["--mecefo-policy=neighbor", "--calculate-per-token-loss"]),
    (2, ["--mecefo", "--recompute-granularity", "full", "--recompute-method", "uniform"],
     ["--mecefo-policy=neighbor", "--recompute-granularity=full"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "world,flags,expected", BAD_FLAGS, ids=[" ".join(c[1][:4]) for c in BAD_FLAGS]
)
def test_bad_mecefo_flags_give_one_config_error(trainer_args, world, flags, expected) -> None:
    with pytest.raises(trainer_args.ConfigError) as info:
        _validate(trainer_args, world, flags)
    message = str(info.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, message


def test_mecefo_flag_without_mecefo_names_the_flag(trainer_args) -> None:
    with pytest.raises(trainer_args.ConfigError, match="--mecefo-fail"):
        _validate(trainer_args, 2, ["--mecefo-fail", "1:5"])


def test_unknown_policy_is_an_argparse_error(trainer_args, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        trainer_args.build_parser().parse_args(["--mock-data", "--mecefo-policy", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--mecefo-policy" in err and "'bogus'" in err
    for name in ("neighbor", "spread", "exact", "drop"):
        assert name in err
    # The config check, for callers that build the config without argparse.
    ft = FaultToleranceConfig(enabled=True, policy="bogus")
    with pytest.raises(MecefoConfigError, match="--mecefo-policy=bogus"):
        ft.validate(data_parallel_size=2, hidden_size=128, train_iters=10)


def test_good_mecefo_flags(trainer_args) -> None:
    args = _validate(
        trainer_args,
        4,
        ["--mecefo", "--mecefo-fail", "1:5:10", "--mecefo-fail", "3:7", "--mecefo-rank", "16",
         "--train-iters", "20"],
    )  # fmt: skip
    ft = args.mecefo_config
    assert ft.enabled and ft.policy == "neighbor" and ft.failure_schedule == "scripted"
    assert ft.techniques.rank == 16 and ft.seed == 1234
    schedule = ft.build_schedule(args.data_parallel_size, args.train_iters)
    assert [schedule.failed_at(i) for i in (4, 5, 7, 10, 20)] == [
        frozenset(),
        {1},
        {1, 3},
        {3},
        {3},
    ]

    args = _validate(
        trainer_args,
        2,
        ["--mecefo", "--mecefo-failure-schedule", "high", "--mecefo-nominal-step-time", "60",
         "--train-iters", "200", "--mecefo-seed", "7", "--mecefo-policy", "spread"],
    )  # fmt: skip
    ft = args.mecefo_config
    assert ft.failure_schedule == "high" and ft.seed == 7 and ft.techniques.seed == 7
    schedule = ft.build_schedule(2, 200)
    assert schedule.events == FailureSchedule.paper("high", 2, 200, 60.0, 7).events
    assert schedule.events and _max_down(schedule) == 1

    args = _validate(trainer_args, 1, ["--mecefo", "--mecefo-policy", "drop"])
    assert args.mecefo_config.failure_schedule == "none"
    args = _validate(trainer_args, 2, [])
    assert not args.mecefo_config.enabled and args.mecefo_config.failure_schedule == "none"


def test_bad_flag_end_to_end_without_torchrun(tmp_path: Path) -> None:
    """A new user's first try: one line naming --mecefo-rank, exit 2, before torch loads."""
    env = child_env(WORLD_SIZE="2")
    env.pop("RANK", None)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(TRAINER), "--mock-data", "--mecefo", "--mecefo-rank", "4096"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("pretrain_gpt.py: error: --mecefo-rank=4096")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert elapsed < 15, f"start-up check took {elapsed:.1f} s"
