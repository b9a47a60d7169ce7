"""Two jobs on one etcd cluster (``--store-mode etcd``): each job's keys live under its own
prefix, and a node 0 never deletes the keys of a job that still runs. Real supervisors and
ranks of the example trainer on a real 3-member etcd; every process ended by PID in
``finally`` (``Job.stop``, ``EtcdCluster.stop``)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest
from conftest import REPO, child_env
from etcd_cluster import EtcdCluster, etcd_fixture, mecefo_layout  # noqa: F401 (a fixture)
from harness import Job, check_every_sample_once, train_records

from megatron_mecefo.recovery.etcd_control import lease_ttl_s
from megatron_mecefo.recovery.store_host import LEADERLESS_GRACE_S

SUP = "megatron_mecefo.recovery.supervisor: error:"


@pytest.fixture(autouse=True)
def _no_job_id(text_data: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs below start as a user's would without Slurm: no job id in the environment."""
    monkeypatch.setenv("MECEFO_TEST_DATA", text_data)
    monkeypatch.delenv("MECEFO_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def _layout(iters: int, gbs: int) -> List[str]:
    return mecefo_layout(iters, gbs)


def _etcd_args(etcd: EtcdCluster, *extra: str) -> List[str]:
    return ["--store-mode", "etcd", "--etcd", ",".join(etcd.endpoints), *extra]


def _prefixes(job: Job) -> set:
    """The key prefixes the job's supervisors used (from their etcd:// store files)."""
    found = set()
    for node in range(job.nnodes):
        text = job.store_file(node).read_text()
        found.add(re.search(r"(/mecefo/[^?]+)", text).group(1))
    return found


def test_two_jobs_without_job_id_both_finish(tmp_path: Path, etcd: EtcdCluster) -> None:
    """Two jobs of two nodes each on one etcd, neither with MECEFO_JOB_ID or SLURM_JOB_ID,
    the second started while the first trains. Before, both used the prefix
    ``/mecefo/port0``: the second node 0 deleted it at start-up, and the first job's ranks
    printed "training finished" long before their last iteration and exited 0. Now each job
    derives its own prefix, identical on its nodes: both finish, each with every sample once,
    and neither job's supervisors take over or see the other's."""
    iters, gbs = 30, 8
    jobs = [
        Job(tmp_path / name, 1, _layout(iters, gbs), nnodes=2,
            supervisor_args=_etcd_args(etcd), MECEFO_TEST_STEP_SLEEP="0.1")
        for name in ("a", "b")
    ]  # fmt: skip
    try:
        jobs[0].start()
        jobs[0].wait_for("iteration        3/")
        jobs[1].start()
        rcs = [job.wait(timeout=400) for job in jobs]
    finally:
        for job in jobs:
            job.stop()
    logs = [job.log() for job in jobs]
    for job, rc, log in zip(jobs, rcs, logs, strict=True):
        assert rc == [0, 0], (rc, log[-5000:])
        assert "takes over" not in log and "training aborted" not in log, log[-5000:]
        its = [r["iteration"] for r in job.records_of("train")]
        assert sorted(set(its)) == list(range(1, iters + 1)), its
        check_every_sample_once(train_records(job.metrics), iters, gbs, 2)
    (first,), (second,) = (_prefixes(job) for job in jobs)
    assert first != second and first.startswith("/mecefo/cmd-"), (first, second)


def test_second_job_with_a_live_jobs_id_is_refused(tmp_path: Path, etcd: EtcdCluster) -> None:
    """A second job started with the MECEFO_JOB_ID of a job that trains: its node 0 waits for
    the prefix's leader lease (one TTL and a grace) and is then refused with one line naming
    the prefix and the fix; it deleted nothing, and the running job finishes with every
    sample once."""
    hb = 2.0
    # The live job outlasts the second node 0's wait for its lease (one TTL and a grace) by
    # about 15 s of its 0.1 s steps.
    iters, gbs = int((lease_ttl_s(hb) + LEADERLESS_GRACE_S + 15) / 0.1), 8
    timeouts = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", f"{hb:g}",
                "--collective-timeout", "25", "--init-timeout", "50"]  # fmt: skip
    job = Job(tmp_path / "live", 2, _layout(iters, gbs), nnodes=1,
              supervisor_args=_etcd_args(etcd, *timeouts), MECEFO_TEST_STEP_SLEEP="0.1",
              MECEFO_JOB_ID="shared")  # fmt: skip
    second = tmp_path / "second"
    second.mkdir()
    try:
        job.start()
        job.wait_for("iteration        3/")
        other = subprocess.run(
            [sys.executable, "-m", "megatron_mecefo.recovery.supervisor", "--nproc-per-node",
             "2", *_etcd_args(etcd, *timeouts), "--", str(REPO / "tests" /
             "workers" / "dump_trainer.py"), *_layout(iters, gbs)],
            cwd=second, env=child_env(MECEFO_JOB_ID="shared"), capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        still_training = job.procs[0].poll() is None
        rc = job.wait(timeout=400)
    finally:
        job.stop()
    out = other.stdout + other.stderr
    lines = [line for line in out.splitlines() if line.startswith(SUP)]
    assert other.returncode == 1 and len(lines) == 1, out[-4000:]
    for words in ("the etcd key prefix /mecefo/shared holds a live job",
                  "MECEFO_JOB_ID=shared", "export MECEFO_JOB_ID="):  # fmt: skip
        assert words in lines[0], lines[0]
    assert "Traceback" not in out, out[-4000:]
    assert still_training, job.log()[-4000:]
    assert rc == [0], (rc, job.log()[-5000:])
    check_every_sample_once(train_records(job.metrics), iters, gbs, 2)


def test_a_client_never_follows_another_runs_store(etcd: EtcdCluster) -> None:
    """The prefix cleared and taken by another run (its token in ``run``, its store in
    ``hot_store``, its ``done`` set): a client that knows its own run's token fails its calls
    rather than read the other run's ``done`` (a rank that read it would end "training
    finished" before its last iteration, exit 0). A client without a token (the contrast)
    follows there and reads it."""
    from torch.distributed import DistError

    from megatron_mecefo.recovery.etcd_control import EtcdControl
    from megatron_mecefo.recovery.store_etcd import (
        HOT_STORE,
        RUN_KEY,
        EtcdStore,
        etcd_address,
    )
    from megatron_mecefo.recovery.store_forwarding import serve

    prefix = "/mecefo/two-runs"
    control = EtcdControl(etcd.endpoints, prefix, 2.0)
    ours, theirs = serve("127.0.0.1", 0), serve("127.0.0.1", 0)
    try:
        # Each run's leader term first: a client follows a store only the standing term wrote.
        control.conn.put(control.leader_key, "ours")
        control.conn.put(control.key(RUN_KEY), "ours")
        control.conn.put(control.key(HOT_STORE), f"127.0.0.1:{ours.port}")
        guarded = EtcdStore(etcd_address(etcd.endpoints, prefix, 2.0, run="ours"), 5.0)
        plain = EtcdStore(etcd_address(etcd.endpoints, prefix, 2.0), 5.0)
        assert guarded.check(["done"]) is False and plain.check(["done"]) is False
        theirs.set("done", "1")
        control.conn.delete(control.leader_key)  # a new term: a new create revision
        control.conn.put(control.leader_key, "theirs")
        control.conn.put(control.key(RUN_KEY), "theirs")
        control.conn.put(control.key(HOT_STORE), f"127.0.0.1:{theirs.port}")
        # The hot_store watch shuts this process's sockets to our store: the next calls fail.
        deadline = time.monotonic() + 30
        while plain.address != f"127.0.0.1:{theirs.port}":
            assert time.monotonic() < deadline, "the plain client never followed"
            try:
                plain.check(["done"])
            except DistError:
                pass
            time.sleep(0.05)
        assert plain.check(["done"]) is True  # the contrast: another run's "done"
        refused = 0
        while refused < 3:
            assert time.monotonic() < deadline, "the guarded client's calls never failed"
            try:
                assert guarded.check(["done"]) is False, "read another run's done"
            except DistError:
                refused += 1
            time.sleep(0.05)
        assert guarded.address == f"127.0.0.1:{ours.port}"
    finally:
        control.close()
        del ours, theirs


def test_a_node_never_joins_an_ended_run(tmp_path: Path, etcd: EtcdCluster) -> None:
    """A node 1 started while the prefix still names an earlier run's store, up after that
    run ended (``done`` set): it waits for its own job's node 0 and, none coming, stops at
    --init-timeout with one line, having started no rank. Before, it joined the ended run, and
    its ranks ended "training finished" at once, exit 0."""
    from megatron_mecefo.recovery.etcd_control import EtcdControl
    from megatron_mecefo.recovery.store_etcd import HOT_STORE, RUN_KEY
    from megatron_mecefo.recovery.store_forwarding import serve

    control = EtcdControl(etcd.endpoints, "/mecefo/relaunched", 2.0)
    ended = serve("127.0.0.1", 0)
    try:
        ended.set("done", "1")
        control.conn.put(control.key(RUN_KEY), "earlier")
        control.conn.put(control.key(HOT_STORE), f"127.0.0.1:{ended.port}")
        pids = tmp_path / "pids"
        node1 = subprocess.run(
            [sys.executable, "-m", "megatron_mecefo.recovery.supervisor", "--nproc-per-node",
             "1", "--nnodes", "2", "--node-rank", "1", "--pid-file", str(pids),
             *_etcd_args(etcd), "--heartbeat-interval", "0.2", "--heartbeat-timeout", "0.5",
             "--collective-timeout", "1", "--init-timeout", "3", "--",
             str(REPO / "tests" / "workers" / "dump_trainer.py"), *_layout(3, 4)],
            cwd=tmp_path, env=child_env(MECEFO_JOB_ID="relaunched"), capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
    finally:
        control.close()
        del ended
    out = node1.stdout + node1.stderr
    lines = [line for line in out.splitlines() if line.startswith(SUP)]
    assert node1.returncode == 1 and len(lines) == 1, out[-4000:]
    assert "no leader published a membership store under /mecefo/relaunched" in lines[0]
    assert not (pids.exists() and pids.read_text().strip()), pids.read_text()
    assert "training finished" not in out and "Traceback" not in out, out[-4000:]
