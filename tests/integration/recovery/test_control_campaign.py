"""The randomized campaign on real processes (tests/helpers/control_campaign.py).

``make test`` runs the short campaign (two runs of the seeded plan: a group head frozen, the
leader SIGKILLed); ``make
test-control-campaign`` the whole one (``MECEFO_CAMPAIGN_RUNS``, default 24), which writes
``results/control_campaign.json`` and prints the table that ``docs/real-failures.md`` shows.
Needs root, ``ip netns`` and an ``etcd`` binary; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List

import pytest
from conftest import REPO
from control_campaign import KINDS, Fault, plan, run_one
from etcd_cluster import etcd_missing_reason
from netns import netns_missing_reason

SEED = 54
SHORT = (10, 15)
"""The runs of the plan in ``make test``: a SIGSTOP of node 2 (group 1's head) for good, and a
SIGKILL of node 0 (the etcd leader, group 0's head)."""


@pytest.fixture(autouse=True)
def _needs() -> None:
    why = netns_missing_reason() or etcd_missing_reason()
    if why:
        pytest.skip(why)


def _campaign(tmp_path: Path, text_data: str, runs: List[int]) -> List[Dict[str, Any]]:
    faults = plan(SEED, max(runs) + 1)
    results = []
    for i in runs:
        fault = faults[i]
        t0 = time.monotonic()
        record = run_one(tmp_path / f"run{i}", fault, text_data, tag=f"{os.getpid() % 10000}c{i}")
        record["run"], record["wall_s"] = i, round(time.monotonic() - t0, 1)
        print(json.dumps(record, sort_keys=True))
        results.append(record)
    return results


def _table(results: List[Dict[str, Any]]) -> str:
    rows = ["| fault | runs | violations | fault → end of the run, s (median) |", "|" + "---|" * 4]
    for kind in KINDS:
        of = [r for r in results if r["fault"]["kind"] == kind]
        ends = sorted(r["end_s"] for r in of if "end_s" in r)
        median = f"{ends[len(ends) // 2]:.1f}" if ends else "–"
        bad = sum(bool(r["violations"]) for r in of)
        rows.append(f"| {kind} | {len(of)} | {bad} | {median} |")
    return "\n".join(rows)


def test_short_campaign(tmp_path: Path, text_data: str) -> None:
    """The first runs of the seeded plan: every invariant holds in each."""
    results = _campaign(tmp_path, text_data, list(SHORT))
    bad = [(r["fault"], r["violations"]) for r in results if r["violations"]]
    assert not bad, bad


@pytest.mark.slow
def test_campaign(tmp_path: Path, text_data: str) -> None:
    """The whole campaign: ``MECEFO_CAMPAIGN_RUNS`` runs; the table to results/."""
    runs = int(os.environ.get("MECEFO_CAMPAIGN_RUNS", "24"))
    t0 = time.monotonic()
    results = _campaign(tmp_path, text_data, list(range(runs)))
    kinds = Counter(r["fault"]["kind"] for r in results)
    nodes = Counter(r["fault"]["node"] for r in results)
    violations = [{"run": r["run"], "fault": r["fault"], "violations": r["violations"]}
                  for r in results if r["violations"]]  # fmt: skip
    report = {
        "config": {
            "seed": SEED, "runs": runs, "nodes": 4, "ranks_per_node": 1, "layout": "PP2 x DP2",
            "vote_group_size": 2, "etcd_members": 3, "heartbeat_timeout_s": 4.0,
            "machine": f"{os.cpu_count()} cores, {platform.python_version()}",
        },
        "faults_by_kind": dict(sorted(kinds.items())),
        "faults_by_node": {str(k): v for k, v in sorted(nodes.items())},
        "violations": violations,
        "wall_s": round(time.monotonic() - t0, 1),
        "runs": results,
    }  # fmt: skip
    out = REPO / "results" / "control_campaign.json"
    out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(_table(results))
    print(
        f"control campaign: {runs} runs (faults {dict(sorted(kinds.items()))}), "
        f"{len(violations)} with violations, {report['wall_s']:.0f} s -> {out}"
    )
    assert not violations, violations


def test_leader_cut_off_inside_its_lease_declares_nobody_dead(
    tmp_path: Path, text_data: str
) -> None:
    """The leader's (node 0's) link cut for 6 s, under its lease's 10 s TTL, with a 4 s
    heartbeat timeout: it hears no node for longer than the timeout, but it is the one cut off
    (its lease renewals fail too), so it declares nobody dead; the job goes on with all four
    nodes once the link is back. (The campaign's run 17 found the leader declaring the three
    others dead: every node exited 1.)"""
    fault = Fault(kind="cut-restore", node=0, iteration=6, delay_s=0.27, hold_s=6.0)
    record = run_one(tmp_path / "run", fault, text_data, tag=f"{os.getpid() % 10000}lc")
    print(json.dumps(record, sort_keys=True))
    assert not record["violations"], record
    assert record["ranks_lost"] == [] and record["exit_codes"] == [0, 0, 0, 0], record


@pytest.mark.parametrize(
    "point, node",
    [pytest.param("after-hot-vote", 2, marks=pytest.mark.slow), ("after-claim", 0)],
    ids=["head-dies-after-its-group-was-counted", "leader-dies-after-its-claim"],
)
def test_a_node_dead_at_a_point_of_the_vote_leaves_its_peers_prepared(
    tmp_path: Path, text_data: str, point: str, node: int
) -> None:
    """Members in doubt keep their step prepared, and the next world applies it, in real
    processes (``fault_injection.die_at``: the node's supervisor SIGKILLs itself, its rank
    dies with it, at iteration 6 or the first later one where it reaches the point):

    * ``after-hot-vote``, node 2 (group 1's head, stage 1): its group's vote is counted on the
      hot store, the count commits, nodes 0 and 1 apply, and node 3 (the rest of stage 1) is
      cut off from its head: in doubt. C1: before prepared steps, stage 1 had no member at the
      committed iteration and the job ended with ``ShardLost``.
    * ``after-claim``, node 0 (the leader, group 0's head): its vote completes the count and
      its commit is claimed on etcd, but it dies before the commit key: nobody applied the
      step, every survivor is in doubt, the hot store is lost, and node 1 takes over. The
      claim stands, so the next world commits the step (before the claims it aborted it and
      redid the iteration).

    Either way the survivors apply their kept step (``apply_prepared_step``), and every
    campaign invariant holds: every sample once, the replicas equal, the survivors equal to the
    simulated twin that drops the lost replica after the committed iteration."""
    fault = Fault(kind=point, node=node, iteration=6, delay_s=0.0, hold_s=0.0)
    record = run_one(tmp_path / "run", fault, text_data, tag=f"{os.getpid() % 10000}p{node}")
    print(json.dumps(record, sort_keys=True))
    assert not record["violations"], record
    assert record["ranks_lost"] == [node], record
    assert record["in_doubt"] and set(record["in_doubt"]) == {"committed"}, record
