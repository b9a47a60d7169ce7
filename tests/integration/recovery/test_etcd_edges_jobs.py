"""``--store-mode etcd`` end to end at the control plane's edges: real supervisors, ranks and a
real 3-member etcd; every process ended by PID in ``finally``.

* a leader's keepalive starved at start-up (its supervisor SIGSTOPped for longer than the
  heartbeat timeout, less than the lease's floor) keeps the lease;
* a node cut off from the leader but not from etcd (packets between the two nodes dropped,
  in network namespaces) learns from etcd that it was declared dead, and stops with one line
  and exit 1 (needs root and ``ip netns``; skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator, List

import pytest
from etcd_cluster import EtcdCluster, etcd_fixture, mecefo_layout, running_cluster  # noqa: F401
from harness import Job, check_every_sample_once, train_records
from netns import Netns, network


@pytest.fixture(autouse=True)
def _data(text_data: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MECEFO_TEST_DATA", text_data)


def _layout(iters: int, gbs: int) -> List[str]:
    return mecefo_layout(iters, gbs)


def _supervisor_lines(job: Job, node: int) -> List[str]:
    text = job.logs[node].read_text(errors="replace")
    return [x for x in text.splitlines() if f"[supervisor node {node}]" in x]


def test_a_starved_keepalive_keeps_the_lease_at_start_up(tmp_path: Path, etcd: EtcdCluster) -> None:
    """The leader's supervisor is SIGSTOPped for 6 s just after its election: longer than
    the heartbeat timeout (3 s), which was the lease's TTL, shorter than the TTL's floor
    (10 s). Its keepalive cannot run meanwhile, as under a load that starves it. Before, its
    lease expired, node 1 took over and node 0 exited 1 ("lease expired") before training
    started. Now the lease outlives the stop, and nobody declares a rank dead for the time
    the leader's own coordinator could not look: the job finishes on both nodes, no
    takeover."""
    iters, gbs = 12, 8
    job = Job(tmp_path / "job", 1, _layout(iters, gbs), nnodes=2,
              supervisor_args=["--store-mode", "etcd", "--etcd", ",".join(etcd.endpoints),
                               "--heartbeat-timeout", "3"],
              MECEFO_TEST_STEP_SLEEP="0.1")  # fmt: skip
    try:
        job.start()
        job.wait_for("elected leader on etcd")
        os.kill(job.procs[0].pid, signal.SIGSTOP)
        time.sleep(6.0)
        os.kill(job.procs[0].pid, signal.SIGCONT)
        rc = job.wait(timeout=300)
    finally:
        job.stop()
    log = job.log()
    assert rc == [0, 0], (rc, log[-5000:])
    assert "lost" not in " ".join(_supervisor_lines(job, 0)), log[-5000:]
    assert "takes over" not in log and "(death" not in log, log[-5000:]
    check_every_sample_once(train_records(job.metrics), iters, gbs, 2)


# ---------------------------------------------------------------------- cut between nodes


@pytest.fixture()
def net() -> Iterator[Netns]:
    yield from network(2)


@pytest.fixture()
def bridged_etcd(tmp_path: Path, net: Netns) -> Iterator[EtcdCluster]:
    yield from running_cluster(tmp_path / "etcd", net.host_address)


def _cut_between(net: Netns, a: int, b: int) -> None:
    """Discard every packet between nodes ``a`` and ``b`` (a blackhole route to the other in
    each namespace: sends vanish, connects fail without a refusal); both keep reaching etcd
    on the bridge. (No tc actions on this kernel; routes need none.)"""
    for node, other in ((a, b), (b, a)):
        subprocess.run(["ip", "-n", net.namespaces[node], "route", "add", "blackhole",
                        f"{net.address(other)}/32"], check=True, capture_output=True,
                       timeout=30)  # fmt: skip


def test_a_node_cut_off_from_the_leader_learns_it_was_declared_dead(
    tmp_path: Path, net: Netns, bridged_etcd: EtcdCluster
) -> None:
    """DP4 on two nodes in network namespaces; etcd on the bridge. The packets between node 0
    (the leader) and node 1 are discarded; both still reach etcd. Node 0 declares node 1's
    ranks dead (silent, their supervisor too) and trains on. Node 1 learns it from etcd and
    stops with one line and exit 1, while node 0 still trains. Before, node 1 stayed up
    without a word, then won an election for the finished job and exited 0 ("elected
    leader after the job ended"), or died of a traceback."""
    iters, gbs, hb = 60, 16, 4.0
    job_id = f"edgescut{os.getpid()}"

    def launch(node: int, argv: List[str]) -> List[str]:
        cut = argv.index("--")
        own = ["--store-host", net.address(node)]
        prefix = net.exec_prefix(node, GLOO_SOCKET_IFNAME=net.inner[node])
        return prefix + argv[:cut] + own + argv[cut:]

    endpoints = ",".join(bridged_etcd.endpoints)
    job = Job(tmp_path / "job", 2, _layout(iters, gbs), nnodes=2,
              supervisor_args=["--store-mode", "etcd", "--etcd", endpoints,
                               "--heartbeat-timeout", str(hb)],
              launch=launch, MECEFO_TEST_STEP_SLEEP="0.1", MECEFO_JOB_ID=job_id)  # fmt: skip
    try:
        job.start()
        job.wait_for("iteration        6/")
        _cut_between(net, 0, 1)
        t_cut = time.monotonic()
        rc1 = job.procs[1].wait(timeout=120)
        node1_s = time.monotonic() - t_cut
        node0_running = job.procs[0].poll() is None
        rc0 = job.procs[0].wait(timeout=300)
    finally:
        job.stop()
    log = job.log()
    print(f"node 1 cut off from the leader: it stopped {node1_s:.1f} s after the cut")
    assert (rc0, rc1) == (0, 1), ((rc0, rc1), log[-5000:])
    said = _supervisor_lines(job, 1)
    assert "this node was declared dead" in said[-1] and "exiting" in said[-1], said[-3:]
    assert not any("elected leader" in x for x in said), said
    assert node0_running, "node 0 had finished: node 1 learned nothing while the job ran"
    check_every_sample_once(train_records(job.metrics), iters, gbs, 4)
