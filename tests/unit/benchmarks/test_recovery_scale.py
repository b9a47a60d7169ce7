"""``benchmarks/recovery_scale.py``'s pure parts: roles from the recovery records, spurious
generations, the peak / after-heal RSS per role from a synthetic series, the heal's byte count,
the goals and the model sizes."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

import recovery_scale as rs  # noqa: E402

FAILURE = {
    "type": "recovery", "kind": "failure", "generation": 1, "ranks_lost": [1],
    "ranks_joined": [], "replicas": [0, 2, 3], "world_size": 3,
}  # fmt: skip
REJOIN = {
    "type": "recovery", "kind": "rejoin", "generation": 2, "ranks_lost": [],
    "ranks_joined": [1], "replicas": [0, 1, 2, 3], "world_size": 4, "heal_s": 2.0,
}  # fmt: skip


def test_roles_dp4() -> None:
    roles = rs.assign_roles([FAILURE, {"type": "armed_cost"}, REJOIN], world=4)
    assert roles == {
        "failure_generation": 1,
        "heal_generation": 2,
        "lost": [1],
        "survivor": [0, 2, 3],
        "sender": 0,
        "joiner": [1],
        "bystander": [2, 3],
    }


def test_roles_dp2_sender_is_the_survivor_and_without_a_rejoin() -> None:
    failure = dict(FAILURE, replicas=[0], world_size=1)
    rejoin = dict(REJOIN, replicas=[0, 1], world_size=2)
    roles = rs.assign_roles([failure, rejoin], world=2)
    assert (roles["survivor"], roles["sender"], roles["joiner"], roles["bystander"]) == (
        [0],
        0,
        [1],
        [],
    )
    alone = rs.assign_roles([failure], world=2)
    assert (alone["heal_generation"], alone["sender"], alone["joiner"]) == (None, None, [])


def test_roles_when_slot_0_joined() -> None:
    failure = dict(FAILURE, ranks_lost=[0], replicas=[1, 2, 3])
    rejoin = dict(REJOIN, ranks_joined=[0])
    roles = rs.assign_roles([failure, rejoin], world=4)
    assert (roles["survivor"], roles["sender"], roles["bystander"]) == ([1, 2, 3], 1, [2, 3])


def test_spurious_generations() -> None:
    spurious = dict(FAILURE, generation=3, ranks_lost=[])
    assert rs.spurious_generations([FAILURE, REJOIN, spurious, {"type": "armed_cost"}]) == [3]
    assert rs.spurious_generations([FAILURE, REJOIN]) == []


def test_window_max_and_ratio() -> None:
    series = [(0.0, 10), (1.0, 30), (2.0, 20), (3.0, 50)]
    assert rs.window_max(series, 0.5, 2.0) == 30
    assert rs.window_max(series, 3.5, 4.0) is None
    assert rs.window_max(series, None, 4.0) is None
    assert rs.ratio(3, 2) == 1.5
    assert rs.ratio(1, 3) == 0.333
    assert rs.ratio(None, 2) is None and rs.ratio(2, 0) is None


def test_role_memory_from_a_synthetic_series() -> None:
    # pid 100: slot 0 (survivor, then sender); 101: slot 1, killed at t=10; 102: its joiner;
    # 103: slot 2, a bystander. Windows: steady 2-10, regroup 10-14, heal 20-24, after 26-28.
    series = {
        100: [(1, 50), (3, 100), (8, 104), (11, 120), (13, 125), (21, 300), (23, 110),
              (27, 106), (30, 500)],
        101: [(1, 40), (4, 200), (9, 210)],
        102: [(16, 80), (21, 230), (22, 420), (27, 215)],
        103: [(5, 100), (21, 110), (27, 100)],
    }  # fmt: skip
    pids = {
        "survivor": [(100, 100), (103, 103)],
        "sender": [(100, 100)],
        "joiner": [(102, 101)],
        "bystander": [(103, 103)],
    }
    windows = {"steady": (2, 10), "regroup": (10, 14), "heal": (20, 24), "heal_copy": (21.5, 24),
               "after": (26, 28)}  # fmt: skip
    mem = rs.role_memory(series, pids, windows)
    assert mem["survivor"] == {
        "pids": [100, 103],
        "steady_bytes": 104,
        "peak_bytes": 125,
        "copy_peak_bytes": None,
        "after_bytes": None,
        "peak_ratio": 1.202,  # 125 / 104; pid 103 has no sample in the regroup window
        "copy_peak_ratio": None,
        "after_ratio": None,
    }
    assert mem["sender"] == {
        "pids": [100],
        "steady_bytes": 104,
        "peak_bytes": 300,
        "copy_peak_bytes": 110,
        "after_bytes": 106,
        "peak_ratio": 2.885,
        "copy_peak_ratio": 1.058,
        "after_ratio": 1.019,
    }
    assert mem["joiner"] == {  # against the dead incarnation's steady RSS (210)
        "pids": [102],
        "steady_bytes": 210,
        "peak_bytes": 420,
        "copy_peak_bytes": 420,
        "after_bytes": 215,
        "peak_ratio": 2.0,
        "copy_peak_ratio": 2.0,
        "after_ratio": 1.024,
    }
    assert mem["bystander"]["peak_ratio"] == 1.1
    assert mem["bystander"]["copy_peak_ratio"] is None  # no sample in 21.5-24
    assert mem["bystander"]["after_ratio"] == 1.0


def test_heal_bytes_from_the_record_or_the_parameters() -> None:
    assert rs.heal_bytes({"heal_bytes": 1234}, 10) == (1234, "record:heal_bytes")
    assert rs.heal_bytes({"state_transfer_bytes": 99}, 10) == (99, "record:state_transfer_bytes")
    assert rs.heal_bytes({"heal_s": 1.0}, 10) == (120, "computed: 12 B/parameter")
    assert rs.heal_bytes({}, None) == (None, "unknown")


def test_goal_checks() -> None:
    run = {
        "heal_gbps": 0.8,
        "spurious_generations": [],
        "memory": {
            "survivor": {"pids": [1], "peak_ratio": 1.25},
            "sender": {"pids": [1], "peak_ratio": 1.15, "after_ratio": 1.05},
            "joiner": {"pids": [2], "peak_ratio": 1.1, "after_ratio": 1.06},
            "bystander": {"pids": [], "peak_ratio": None, "after_ratio": None},
        },
    }
    assert rs.goal_checks(run, gloo_gbps=1.0) == {
        "heal_vs_gloo": True,
        "peak_sender_joiner_bystander": True,
        "survivor_regroup_peak": True,
        "after_heal": False,
        "spurious_generations": True,
    }
    assert rs.goal_checks({"spurious_generations": [3]}, None) == {
        "heal_vs_gloo": None,
        "peak_sender_joiner_bystander": None,
        "survivor_regroup_peak": None,
        "after_heal": None,
        "spurious_generations": False,
    }


def test_model_sizes_and_the_memory_estimate() -> None:
    assert rs.example_params(4, 384) == 7_376_256  # the trainer's own log line
    assert rs.mlm_params(4, 384, 32) == 7_209_216  # Megatron-LM's own log line
    assert round(rs.estimated_total_gib(2.0, 2), 9) == 7.8
    assert rs.descendants(1, {2: 1, 3: 2, 4: 1, 5: 9}) == [2, 4, 3]


def test_the_side_by_side_runs_go_in_abba_order() -> None:
    assert rs.ab_order(1) == ["warm", "cold"]
    assert rs.ab_order(2) == ["warm", "cold", "cold", "warm"]
    assert rs.ab_order(3) == ["warm", "cold", "cold", "warm", "warm", "cold"]
    assert rs.ab_order(2, "two", "one") == ["two", "one", "one", "two"]
    for modes in rs.AB_MODES.values():  # the first mode is the "with" of the A/B
        assert len(modes) == 2
    assert set(rs.AB_HELP) == set(rs.AB_MODES)  # each A/B has its flag
    assert rs._ab_key("warm-heap") == "warm_heap_ab"  # the JSON key the docs name


def test_medians_skip_runs_without_the_value() -> None:
    rows = [{"heal_s": 0.4}, {"heal_s": None}, {"heal_s": 0.5}, {"heal_s": 0.3}, {}]
    assert rs._medians(rows, ["heal_s", "x"], "two_") == {"two_heal_s_median": 0.4,
                                                          "two_x_median": None}  # fmt: skip
