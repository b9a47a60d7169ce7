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
        "heal_vs_gloo_same_size": None,  # no same-size reference in this run
        "heal_vs_link": None,  # no link probe in this run
        "peak_sender_joiner_bystander": True,
        "survivor_regroup_peak": True,
        "after_heal": False,
        "spurious_generations": True,
    }
    assert (
        rs.goal_checks({**run, "gloo_same_size_gbps": 1.2}, 1.0)["heal_vs_gloo_same_size"] is False
    )
    assert rs.goal_checks({**run, "heal_link_gbps": 1.1}, 1.0)["heal_vs_link"] is True
    assert rs.goal_checks({**run, "heal_link_gbps": 1.2}, 1.0)["heal_vs_link"] is False
    assert rs.goal_checks({"spurious_generations": [3]}, None) == {
        "heal_vs_gloo": None,
        "heal_vs_gloo_same_size": None,
        "heal_vs_link": None,
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


def test_the_same_size_reference_is_the_heals_bytes_before_and_after_the_run() -> None:
    assert rs.same_size_mib("example", "0.1") == round(12 * 7_376_256 / 2**20)  # 84 MiB
    assert rs.same_size_mib("example", "3.2") == rs.SAME_SIZE_CAP_MIB
    before = {"per_size": {"84": {"send_recv": {"seconds": [0.05, 0.07, 0.06]}},
                           "1024": {"send_recv": {"seconds": [0.5]}}}}  # fmt: skip
    after = {"per_size": {"84": {"send_recv": {"seconds": [0.09, 0.08, 0.04]}}}}
    ref = rs.same_size_reference(84, before, after)
    assert ref == {"mib": 84, "seconds_before": [0.05, 0.07, 0.06],
                   "seconds_after": [0.09, 0.08, 0.04],
                   "gbps": round(84 * 2**20 / 0.065 / 1e9, 3)}  # fmt: skip
    assert rs.same_size_reference(84, {}, {}) is None  # no sample: no reference
    assert rs.same_size_reference(0, before, after) is None  # skipped


def _run(rep: int, heal_gbps: float, same: float, peak: float, spurious: list) -> dict:
    run = {"trainer": "example", "dp": 2, "size_gib": "1.6", "rep": rep, "status": "measured",
           "heal_s": 1.0, "heal_gbps": heal_gbps, "gloo_same_size_gbps": same,
           "regroup_s": 0.2 + rep, "spurious_generations": spurious,
           "memory": {"sender": {"pids": [1], "peak_ratio": peak, "after_ratio": 1.0},
                      "joiner": {"pids": [2], "peak_ratio": 1.0, "after_ratio": 1.0},
                      "bystander": {"pids": []}}}  # fmt: skip
    return run


def test_a_configuration_is_judged_on_its_medians_and_on_every_repetitions_memory() -> None:
    # Same-size ratios 0.5, 0.8, 0.9: the median passes though one repetition does not.
    runs = [_run(0, 1.0, 2.0, 1.01, []), _run(1, 1.6, 2.0, 1.02, []),
            _run(2, 1.8, 2.0, 1.03, []),
            {"trainer": "example", "dp": 4, "size_gib": "3.2", "rep": 0,
             "status": "skipped: too large"}]  # fmt: skip
    rs.summarize(runs, {"reference_gbps": 3.0})
    conf, skipped = rs.per_config(runs)
    assert conf["measured"] == 3 and conf["heal_vs_gloo_same_size"] == 0.8
    assert conf["heal_vs_gloo_same_size_range"] == [0.5, 0.9]
    assert conf["heal_vs_gloo"] == round(1.6 / 3.0, 3) and conf["regroup_s"] == 1.2
    assert conf["memory"]["sender"] == {"peak_ratio": 1.03, "copy_peak_ratio": None,
                                        "after_ratio": 1.0}  # fmt: skip
    assert "bystander" not in conf["memory"]
    assert conf["goals"] == {"heal_vs_gloo_same_size": True, "heal_vs_gloo": False,
                             "heal_vs_link": None, "peak_sender_joiner_bystander": True,
                             "survivor_regroup_peak": None, "after_heal": True,
                             "spurious_generations": True}  # fmt: skip
    assert skipped == {"trainer": "example", "dp": 4, "size_gib": "3.2", "runs": 1,
                       "measured": 0, "statuses": ["skipped: too large"]}  # fmt: skip
    # One repetition over the memory bound or with a spurious generation fails the goal.
    runs[2] = _run(2, 1.8, 2.0, 1.2, [5])
    rs.summarize(runs, {"reference_gbps": 3.0})
    goals = rs.per_config(runs)[0]["goals"]
    assert goals["peak_sender_joiner_bystander"] is False
    assert goals["spurious_generations"] is False
    assert rs.per_config(runs)[0]["spurious_generations"] == 1


def test_a_configuration_with_the_link_probe_is_judged_on_the_heal_over_the_jobs_gloo() -> None:
    # Heal 1.0, 1.6, 1.8 GB/s; gloo in the job's processes 2.0, 2.0, 3.0 GB/s right before
    # each heal: ratios 0.5, 0.8, 0.6, median 0.6 (below 0.7, though one run is above).
    runs = [_run(i, heal, 2.0, 1.01, []) for i, heal in enumerate((1.0, 1.6, 1.8))]
    for run, link in zip(runs, (2.0, 2.0, 3.0), strict=True):
        run["heal_link_gbps"] = link
    rs.summarize(runs, {"reference_gbps": 3.0})
    assert [r["heal_vs_link"] for r in runs] == [0.5, 0.8, 0.6]
    assert [r["link_vs_gloo_same_size"] for r in runs] == [1.0, 1.0, 1.5]
    conf = rs.per_config(runs)[0]
    assert conf["heal_vs_link"] == 0.6 and conf["heal_link_gbps"] == 2.0
    assert conf["goals"]["heal_vs_link"] is False
    assert "x0.6 gloo in the job" in rs.summary_line([conf], {"reference_gbps": 3.0})


def test_with_the_link_probe_the_heal_spans_the_sender_and_joiners_alone() -> None:
    # The bystanders' heal began while the sender and the joiner were still probing the link.
    store = {"generations": {"2": {"times": {
        "0": {"heal_role": "sender", "constructed": 9.0, "heal_start": 11.0, "healed": 12.19},
        "1": {"heal_role": "joiner", "constructed": 9.0, "heal_start": 11.0, "healed": 12.3},
        "2": {"heal_role": "bystander", "constructed": 9.0, "heal_start": 10.0, "healed": 12.24},
        "3": {"membership": 1.0}}}}}  # fmt: skip
    assert rs.probed_heal_s(store, 2) == 1.3
    assert rs.probed_heal_s(store, 3) is None and rs.probed_heal_s({}, 2) is None
