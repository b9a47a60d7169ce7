"""Losing node 0 (its supervisor, its membership store, its coordinator and its ranks) under
``--store-mode replicated``: node 1's standby store takes over and training goes on in-process.

Each supervisor stands in for a node; node 0 is killed with SIGKILL (its ranks die with it,
as on a lost machine). Every test ends its processes by PID in ``finally`` (``Job.stop``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from harness import (
    SMALL_MODEL,
    Job,
    check_every_sample_once,
    max_param_diff,
    run_torchrun,
    train_records,
)

REPLICATED = ["--store-mode", "replicated"]
PARAM_ATOL = 2e-5  # as test_real_failures: fp32 reassociation over the survivors' all-reduce


def _layout(dp: int, iters: int, gbs: int) -> list[str]:
    return SMALL_MODEL + [
        "--global-batch-size", str(gbs), "--train-iters", str(iters), "--mecefo",
        "--data-path", os.environ["MECEFO_TEST_DATA"],
        "--check-weight-hash-across-dp-replicas-interval", "1",
    ]  # fmt: skip


@pytest.fixture(autouse=True)
def _data(text_data: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MECEFO_TEST_DATA", text_data)


def _kill_node(job: Job, node: int) -> None:
    """SIGKILL node ``node``'s supervisor (node 0's: its store and coordinator too) and its
    ranks (those up before the kill: a hot spare's replacement may take a slot a moment
    later, and a standby process is listed with a negative slot)."""
    slots = range(node * job.nproc, (node + 1) * job.nproc)
    ranks = [pid for (slot, _), pid in job.rank_pids().items() if slot in slots]
    os.killpg(job.procs[node].pid, signal.SIGKILL)
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_losing(job: Job, node: int, after: str, timeout: float = 300, before=None) -> list:
    """Start ``job``, (``before(job)``,) kill node ``node`` once its log shows ``after``, and
    return every supervisor's exit status; every process is ended by PID at the end."""
    try:
        job.start()
        if before is not None:
            before(job)
        job.wait_for(after)
        _kill_node(job, node)
        return job.wait(timeout=timeout)
    finally:
        job.stop()


def test_two_nodes_node0_lost_matches_simulated(tmp_path: Path) -> None:
    """DP4 on two nodes (2 ranks each). Node 0 dies mid-run: node 1's standby takes over,
    replicas 2 and 3 take over replicas 0 and 1's share, every sample is processed once, and
    the final parameters equal the simulated run that drops replicas 0 and 1 there."""
    iters, gbs = 40, 16
    args = _layout(4, iters, gbs) + ["--optimizer", "sgd", "--lr", "0.05"]
    job = Job(tmp_path / "real", 2, args, nnodes=2, supervisor_args=REPLICATED,
              MECEFO_TEST_STEP_SLEEP="0.1")  # fmt: skip
    rc = _run_losing(job, 0, "iteration        6/")
    log = job.log()
    assert rc == [-9, 0], (rc, log[-5000:])
    assert "the standby store at" in log and "takes over" in log
    check_every_sample_once(train_records(job.metrics), iters, gbs, 4)
    assert all(c["identical"] for c in job.records_of("dp_weight_check"))
    (failure,) = [r for r in job.records_of("recovery") if r["ranks_lost"]]
    assert sorted(failure["ranks_lost"]) == [0, 1] and sorted(failure["replicas"]) == [2, 3]
    first = failure["iteration"]
    sim = run_torchrun(
        tmp_path / "sim", 4, args + ["--mecefo-fail", f"0:{first}", "--mecefo-fail", f"1:{first}"]
    )
    real = job.params()
    assert sorted(real) == [2, 3]
    diff = max_param_diff(real, sim)
    print(f"node 0 lost at iteration {first}: max |param diff| vs simulated = {diff:.2e}")
    assert diff <= PARAM_ATOL


def test_two_nodes_node1_lost_node0_trains_on_without_a_standby(tmp_path: Path) -> None:
    """Node 1, the standby's host, dies: node 0 trains on with its store alone (the durable
    writes and the commit no longer reach a standby), every sample processed once."""
    iters, gbs = 30, 16
    job = Job(tmp_path, 2, _layout(4, iters, gbs), nnodes=2, supervisor_args=REPLICATED,
              MECEFO_TEST_STEP_SLEEP="0.1")  # fmt: skip
    rc = _run_losing(job, 1, "iteration        5/")
    assert rc == [0, -9], (rc, job.log()[-5000:])
    check_every_sample_once(train_records(job.metrics), iters, gbs, 4)
    (failure,) = [r for r in job.records_of("recovery") if r["ranks_lost"]]
    assert sorted(failure["ranks_lost"]) == [2, 3] and sorted(failure["replicas"]) == [0, 1]


def test_three_nodes_node0_lost_then_a_new_node0_rejoins(tmp_path: Path) -> None:
    """DP3 on three nodes (1 rank each). Node 0 dies; nodes 1 and 2 train on from node 1's
    standby store; a new node 0, started before the loss as a hot spare (a warm standby
    process, waiting on the primary until rank 0 is known dead), fails over with the others,
    rejoins, is healed, and every replica ends identical."""
    iters, gbs = 150, 12
    args = _layout(3, iters, gbs)
    job = Job(tmp_path, 1, args, nnodes=3, supervisor_args=REPLICATED,
              MECEFO_TEST_STEP_SLEEP="0.1")  # fmt: skip

    def hot_spare(job: Job) -> None:
        job.wait_for("standby membership store at")
        job.start_node(0, rejoin=True, extra=["--standby", "1"])

    rc = _run_losing(job, 0, "iteration        5/", timeout=400, before=hot_spare)
    log = job.log()
    assert rc == [-9, 0, 0, 0], (rc, log[-5000:])
    assert "takes over" in log
    check_every_sample_once(train_records(job.metrics), iters, gbs, 3)
    kinds = [(r["kind"], r["ranks_lost"], r["ranks_joined"]) for r in job.records_of("recovery")]
    assert kinds[0][:2] == ("failure", [0]), kinds
    # The hot spare's process joins in a rejoin generation, or in the failure's own when it is
    # up before the new coordinator has published it (a race, as in make test-slurm).
    assert any(joined == [0] for _, _, joined in kinds), kinds
    assert "healed; parameters and optimizer state identical" in log
    checks = job.records_of("dp_weight_check")
    assert checks and all(c["identical"] for c in checks)
    params = job.params()
    assert sorted(params) == [0, 1, 2]
    assert max_param_diff({0: params[0]}, {0: params[1]}) == 0.0
