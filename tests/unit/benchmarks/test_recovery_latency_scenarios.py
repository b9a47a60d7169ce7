"""``benchmarks/recovery_latency.py --scenarios``: the seeded plan of kills, the ``--mecefo-kill``
values it passes, an event's timing and the per-scenario summary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

import recovery_latency as rl  # noqa: E402

from megatron_mecefo.recovery.fault_injection import parse_kills  # noqa: E402


@pytest.mark.parametrize("scenario", ["regroup-kill", "save", "rejoin-kill", "chaos"])
@pytest.mark.parametrize("trainer", ["example", "megatron-lm"])
def test_schedule_is_seeded_and_its_kills_parse(scenario: str, trainer: str) -> None:
    plan = rl.tail_schedule(scenario, trainer, 10, seed=44, spacing=100)
    assert plan == rl.tail_schedule(scenario, trainer, 10, seed=44, spacing=100)
    assert plan != rl.tail_schedule(scenario, trainer, 10, seed=45, spacing=100)
    assert len(plan) == 10
    # Windows do not overlap: event k opens in its own stretch of spacing iterations.
    assert all(k * 100 + 8 <= ev["window"] < (k + 1) * 100 + 8 for k, ev in enumerate(plan))
    specs = rl.tail_specs(plan)
    iters = 8 + 11 * 100
    kills = parse_kills(specs[1::2], world_size=4, train_iters=iters, seed=0)
    assert len(kills) == len(specs) // 2
    assert len({k.key for k in kills}) == len(kills)  # each fires once per job: no duplicates


def test_regroup_kill_kills_a_survivor_while_the_next_world_is_built() -> None:
    plan = rl.tail_schedule("regroup-kill", "example", 6, seed=1, spacing=50)
    assert [ev.get("phase") or ev["target"] for ev in plan] == ["world", "groups", "pair"] * 2
    for ev in plan:
        a, b = ev["victims"]
        assert a != b
        if ev["action"] == "internal":
            assert ev["specs"] == [
                f"{a}:{ev['window']}:forward",
                f"{b}:{ev['window']}:{ev['phase']}",
            ]


def test_save_kills_hit_a_save_iteration_and_rejoin_kill_the_rejoin_after_the_failure() -> None:
    for ev in rl.tail_schedule("save", "megatron-lm", 6, seed=3, spacing=33):
        it = ev.get("save_iteration") or int(ev["specs"][0].split(":")[1])
        assert it % rl.TAIL_SAVE_INTERVAL == 0 and ev["window"] <= it
    for ev in rl.tail_schedule("rejoin-kill", "example", 4, seed=3, spacing=40):
        (a, w, first), (b, w2, second) = (s.split(":") for s in ev["specs"])
        # The world phase fires in a rank that left a world at w2 or later: the failure's
        # world is left at w, so only the rejoin's switch (later) can fire it.
        assert (first, second, int(w2)) == ("forward", "world", int(w) + 1) and a != b


def test_loader_worker_is_megatron_lm_only_and_chaos_kills_workers_there_only() -> None:
    with pytest.raises(ValueError, match="Megatron-LM"):
        rl.tail_schedule("loader-worker", "example", 3, seed=1, spacing=10)
    assert {ev["target"] for ev in rl.tail_schedule("loader-worker", "megatron-lm", 5, 1, 10)} == {
        "worker"
    }
    mlm = {ev["target"] for ev in rl.tail_schedule("chaos", "megatron-lm", 20, 1, 30)}
    ex = {ev["target"] for ev in rl.tail_schedule("chaos", "example", 20, 1, 30)}
    assert mlm == {"rank", "worker"} and ex == {"rank"}
    with pytest.raises(ValueError, match="unknown scenario"):
        rl.tail_schedule("meteor", "example", 3, seed=1, spacing=10)


def test_event_timing_sums_to_total_across_a_superseded_generation() -> None:
    # Generation 1 was superseded while built (no timestamps); generation 2 redid.
    g1: dict = {"1": {}, "2": {}}
    g2 = {"1": {"detect": 100.4, "built": 101.0, "done": 101.5},
          "2": {"detect": 100.3, "built": 101.2, "done": 101.4}}  # fmt: skip
    t = rl.event_timing(100.0, [g1, g2])
    assert t == {"detect_s": 0.4, "regroup_s": 0.8, "redo_s": 0.3, "total_s": 1.5}
    assert t["detect_s"] + t["regroup_s"] + t["redo_s"] == pytest.approx(t["total_s"])
    # A survivor that noticed before the clock started (kill time from a later report)
    # gives detect 0, never a negative one.
    early = rl.event_timing(100.5, [g2])
    assert early["detect_s"] == 0.0 and early["total_s"] == 1.0


def test_summary_gives_p50_and_max_spurious_generations_timeouts_and_load() -> None:
    events = [{"total_s": x, "detect_s": 0.1, "regroup_s": x - 0.2, "redo_s": 0.1,
               "kills": [{"source": "benchmark"}]} for x in (1.0, 3.0, 2.0)]  # fmt: skip
    events.append({"error": "no complete failure generation", "kills": [{"source": "injected"}]})
    run = {"trainer": "megatron-lm", "scenario": "chaos", "plan": [{}] * 4, "events": events,
           "spurious_generations": [{"generation": 5}], "timeouts": [],
           "loadavg_samples": [(0.0, 9.0), (5.0, 11.0)], "error": None}  # fmt: skip
    row = rl.summarize_tails([run])["megatron-lm/chaos"]
    assert row["total_s"] == {"n": 3, "p50": 2.0, "max": 3.0}
    assert (row["events_planned"], row["events_measured"], row["kills"]) == (4, 3, 4)
    assert row["kill_time_sources"] == ["benchmark", "injected"]
    assert (row["spurious_generations"], row["timeouts"]) == (1, 0)
    assert row["loadavg_1m"] == {"mean": 10.0, "max": 11.0}
