"""A hung owner of a store the vote waits on (issue 54, H1), end to end with real supervisors.

A SIGSTOPped supervisor keeps its sockets open and never answers: its ranks' votes (node
vote: over its Unix socket) and its group's votes (it heads a group: its group store) would
wait for ever, while every rank still beats. Here the coordinator declares its node lost
(its supervisor silent for the heartbeat timeout), the waits on it end (the rank's vote wait
after the failure generation; a member's calls to the head's store by the guard shutting
their sockets), and the job regroups and trains on within the heartbeat timeout plus a few
seconds. Every test ends its processes by PID in ``finally`` (SIGCONT first).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import List

import pytest
from etcd_cluster import EtcdCluster, etcd_fixture  # noqa: F401 (a fixture)
from harness import SMALL_MODEL, TIMEOUTS, Job

HEARTBEAT_TIMEOUT_S = float(TIMEOUTS[TIMEOUTS.index("--heartbeat-timeout") + 1])
MARGIN_S = 10.0
"""Generous: the bounds must hold at a load average of 15."""


def _layout(dp: int, iters: int, gbs: int, data: str) -> List[str]:
    return SMALL_MODEL + [
        "--global-batch-size", str(gbs), "--train-iters", str(iters), "--mecefo",
        "--data-path", data,
    ]  # fmt: skip


def _last_iteration(log: str) -> int:
    found = re.findall(r"iteration\s+(\d+)/", log)
    return int(found[-1]) if found else 0


def _wait_for(job: Job, pattern: str, t0: float, bound_s: float) -> float:
    """Seconds from ``t0`` until ``pattern`` (a regex) is in the job's log; fails past the
    bound."""
    while re.search(pattern, job.log()) is None:
        elapsed = time.time() - t0
        assert elapsed < bound_s, f"no {pattern!r} {elapsed:.1f} s after the stop:\n" + (
            job.log()[-5000:]
        )
        time.sleep(0.1)
    return time.time() - t0


def _trains_on(job: Job, t0: float, bound_s: float) -> float:
    """Seconds from ``t0`` until rank 0 logs two iterations past the one it logged when the
    failure generation was published (the regroup done, the new world trains)."""
    start = _last_iteration(job.log())
    while _last_iteration(job.log()) < start + 2:
        elapsed = time.time() - t0
        assert elapsed < bound_s, f"no training {elapsed:.1f} s after the stop:\n" + (
            job.log()[-5000:]
        )
        time.sleep(0.1)
    return time.time() - t0


def _stop_and_check(job: Job, node: int, rank_of_node: List[int]) -> None:
    """SIGSTOP node ``node``'s supervisor (its ranks run on and beat) after iteration 3; the
    regroup must come within the heartbeat timeout plus the margin, and the job train on."""
    job.wait_for("iteration        3/", timeout=400)
    t_stop = time.time()
    os.kill(job.procs[node].pid, signal.SIGSTOP)
    bound = HEARTBEAT_TIMEOUT_S + MARGIN_S
    declared = _wait_for(job, r"generation \d+ \(death, now\)", t_stop, bound)
    trained = _trains_on(job, t_stop, bound + 10.0)
    print(
        f"supervisor {node} SIGSTOPped: regroup after {declared:.2f} s, trains on {trained:.2f} s"
    )
    log = job.log()
    # Declared for its supervisor's silence: "(hung)" while its ranks beat to the store
    # themselves, "(its node is lost)" where the supervisor carries their beats (the per-node
    # heartbeat key): a hung supervisor then silences its ranks too. Either way, at once.
    assert "its supervisor has not beaten" in log, log[-5000:]
    lost = re.search(r"generation \d+ \(death, now\).*lost \[([\d, ]*)\]", log)
    assert lost is not None and [int(s) for s in lost.group(1).split(",")] == rank_of_node, log


@pytest.mark.parametrize("mode", ["single", pytest.param("etcd", marks=pytest.mark.slow)])
def test_follower_supervisor_sigstopped_in_node_vote_mode(
    tmp_path: Path, text_data: str, mode: str, request: pytest.FixtureRequest
) -> None:
    """Two nodes of one rank (DP2), node vote on (``--store-mode etcd``: its default). Node
    1's supervisor SIGSTOPped: its rank's vote waits on it. Before, nothing was declared (the
    rank beats) and the job hung for good. Now node 1 is declared lost at the heartbeat
    timeout, node 0 trains on, and node 1's rank stops waiting (in doubt) and leaves the
    generation."""
    sup: List[str] = []
    if mode == "etcd":
        etcd: EtcdCluster = request.getfixturevalue("etcd")
        sup = ["--store-mode", "etcd", "--etcd", ",".join(etcd.endpoints)]
    job = Job(tmp_path, 1, _layout(2, 400, 8, text_data), nnodes=2, supervisor_args=sup,
              MECEFO_NODE_VOTE="1", MECEFO_TEST_STEP_SLEEP="0.05")  # fmt: skip
    try:
        job.start()
        _stop_and_check(job, 1, [1])
        # The stopped node's rank: its vote wait ended (no answer from its supervisor).
        _wait_for(job, r"rank 1 left generation 0: .*in doubt", time.time(), MARGIN_S)
    finally:
        for p in job.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        job.stop()


@pytest.mark.slow
def test_group_head_sigstopped(tmp_path: Path, text_data: str) -> None:
    """Four nodes of one rank (DP4) voting in groups of two: node 2 heads nodes 2 and 3. Its
    supervisor (which serves the group store) SIGSTOPped: node 3's calls to the group store
    never return. Before, the job hung for good. Now node 2 is declared lost at the heartbeat
    timeout, node 3's calls are cut (it is in doubt), and nodes 0, 1 and 3 train on."""
    job = Job(tmp_path, 1, _layout(4, 400, 16, text_data), nnodes=4,
              supervisor_args=["--vote-group-size", "2"],
              MECEFO_NODE_VOTE="1", MECEFO_TEST_STEP_SLEEP="0.05")  # fmt: skip
    try:
        job.start()
        _stop_and_check(job, 2, [2])
        log = job.log()
        assert "nodes vote in groups of 2" in log, log[-5000:]
        # Node 3's call to its hung head's store was cut by its guard.
        assert re.search(r"\[supervisor node 3\] group vote .* head 2 .*sockets shut", log), log
    finally:
        for p in job.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        job.stop()
