"""Failure schedules, single process: scripted, the paper's scenarios, Poisson and replay."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
from conftest import max_down

from megatron_mecefo.takeover.config import FaultToleranceConfig, MecefoConfigError
from megatron_mecefo.takeover.failure_schedule import (
    NEVER,
    PAPER_SCENARIOS,
    FailureEvent,
    FailureSchedule,
    ScheduleError,
)

# ----------------------------------------------------------------------------- helpers


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
    assert 1 <= max_down(s) <= math.ceil(recover_h / fail_h)


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
            assert len(s.events) == wanted and max_down(s) == concurrent
        else:  # failures that would take the last replica down are dropped
            assert len(s.events) < wanted and max_down(s) == n - 1


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
        assert max_down(s) < n
        # Every replica fails, and about equally often.
        per_replica = [sum(e.replica == r for e in s.events) for r in range(n)]
        assert min(per_replica) > 0.75 * expected / n
        assert all(1 <= e.fail_iteration <= train_iters for e in s.events)


def test_poisson_never_takes_every_replica_down_with_long_repairs() -> None:
    # MTTR = 2 x MTBF: without the rule the two replicas would often be down together.
    n, train_iters = 2, 50_000
    for seed in range(3):
        s = FailureSchedule.poisson(n, train_iters, 1.0, 0.5, 1.0, seed)
        assert max_down(s) < n
        degraded = s.degraded_iterations(train_iters)
        assert degraded > 0.3 * train_iters  # failures were frequent, yet never both at once


def test_poisson_never_takes_every_replica_down_with_repairs_shorter_than_a_step() -> None:
    for seed in range(10):
        s = FailureSchedule.poisson(2, 200, 100.0, 0.2, 0.01, seed)
        assert max_down(s) < 2, (seed, [i for i in range(1, 201) if len(s.failed_at(i)) == 2])


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
