"""``--store-mode etcd``: the supervisors elect a leader on a real 3-member etcd; the leader
serves the hot store and coordinates. Its node SIGKILLed, SIGSTOPped, lost twice; a follower's
node SIGKILLed; etcd members killed. Real processes and real signals; each test starts its own
etcd cluster and ends every process by PID in ``finally`` (``Job.stop``, ``EtcdCluster.stop``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import List

import pytest
from etcd_cluster import EtcdCluster, etcd_fixture, mecefo_layout  # noqa: F401 (a fixture)
from harness import (
    Job,
    check_every_sample_once,
    max_param_diff,
    run_torchrun,
    train_records,
)

from megatron_mecefo.recovery.etcd_control import lease_ttl_s

PARAM_ATOL = 2e-5  # as test_real_failures: fp32 reassociation over the survivors' all-reduce


@pytest.fixture(autouse=True)
def _data(text_data: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MECEFO_TEST_DATA", text_data)


def _layout(iters: int, gbs: int) -> List[str]:
    return mecefo_layout(iters, gbs, "--check-weight-hash-across-dp-replicas-interval", "1")


def _etcd_args(etcd: EtcdCluster, *extra: str) -> List[str]:
    return ["--store-mode", "etcd", "--etcd", ",".join(etcd.endpoints), *extra]


def _node_pids(job: Job, node: int) -> List[int]:
    """The live ranks of node ``node`` (standbys have negative slots)."""
    slots = range(node * job.nproc, (node + 1) * job.nproc)
    return [pid for (slot, _), pid in job.rank_pids().items() if slot in slots]


def _signal_node(job: Job, node: int, sig: int, proc_index: int | None = None) -> None:
    """``sig`` to node ``node``'s supervisor (its process group) and to its ranks."""
    index = node if proc_index is None else proc_index
    os.killpg(job.procs[index].pid, sig)
    for pid in _node_pids(job, node):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _simulated(tmp_path: Path, args: List[str], lost: List[int], at: int) -> dict:
    fails = [x for s in lost for x in ("--mecefo-fail", f"{s}:{at}")]
    return run_torchrun(tmp_path / "sim", 4, args + fails)


def test_leader_node_sigkilled_matches_simulated(tmp_path: Path, etcd: EtcdCluster) -> None:
    """DP4 on two nodes (2 ranks each). The leader's node (node 0: its supervisor, hot store,
    coordinator and ranks) is SIGKILLed mid-run: node 1 wins the next term, serves a store
    restored from etcd, and training goes on; every sample once, and the final parameters
    equal the simulated run that drops replicas 0 and 1 there.

    The death is certain (the killed store's port refuses connections), so node 1 revokes the
    leader's lease and the takeover does not wait for it to expire. The lease TTL (the
    heartbeat timeout) is 20 s here: the lease was last renewed at most TTL/3 (about 6.7 s)
    before the kill, so an expiry comes no sooner than about 13 s after it; the bound of
    TTL/2 = 10 s sits between that and the revocation's few tenths of a second, with room
    for a loaded machine's slower takeover (restoring the state from etcd, a new store)."""
    iters, gbs = 40, 16
    ttl = 20.0
    args = _layout(iters, gbs) + ["--optimizer", "sgd", "--lr", "0.05"]
    job = Job(tmp_path / "real", 2, args, nnodes=2,
              supervisor_args=_etcd_args(etcd, "--heartbeat-timeout", f"{ttl:g}"),
              MECEFO_TEST_STEP_SLEEP="0.1")  # fmt: skip
    try:
        job.start()
        job.wait_for("iteration        6/")
        t_kill = time.monotonic()
        _signal_node(job, 0, signal.SIGKILL)
        job.wait_for("this node takes over with a membership store")
        took_over_s = time.monotonic() - t_kill  # an upper bound: the log is polled
        rc = job.wait(timeout=300)
    finally:
        job.stop()
    log = job.log()
    print(f"leader SIGKILLed: takeover seen {took_over_s:.2f} s after the kill (TTL {ttl:g} s)")
    assert rc == [-9, 0], (rc, log[-5000:])
    assert "its store refused connections: node 1 revoked its etcd lease" in log, log[-5000:]
    assert took_over_s < ttl / 2, f"takeover {took_over_s:.2f} s after the kill (TTL {ttl:g})"
    check_every_sample_once(train_records(job.metrics), iters, gbs, 4)
    assert all(c["identical"] for c in job.records_of("dp_weight_check"))
    (failure,) = [r for r in job.records_of("recovery") if r["ranks_lost"]]
    assert sorted(failure["ranks_lost"]) == [0, 1] and sorted(failure["replicas"]) == [2, 3]
    real = job.params()
    assert sorted(real) == [2, 3]
    diff = max_param_diff(real, _simulated(tmp_path, args, [0, 1], failure["iteration"]))
    print(f"leader lost at iteration {failure['iteration']}: max |param diff| = {diff:.2e}")
    assert diff <= PARAM_ATOL


@pytest.mark.slow  # 24 s each here (64 s when the leader waited 30 s for the lost node)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_follower_node_lost_leader_trains_on(
    tmp_path: Path, etcd: EtcdCluster, sig: signal.Signals
) -> None:
    """DP4 on two nodes. Node 1 (a follower: it campaigns in the background) is SIGKILLed or
    SIGSTOPped (hung: its sockets stay open), its supervisor and ranks: the leader keeps its
    term and its store (no takeover), declares ranks 2 and 3 dead, and trains on with
    replicas 0 and 1; every sample once.

    One heartbeat timeout, not two: the node's supervisor falls silent with its ranks, so
    nobody will answer the kill request, and the ranks are declared dead when their silence
    reaches the timeout. Before, the coordinator waited a second timeout for that answer
    (13 s under Slurm at a 6 s timeout). With a timeout T of 8 s here, the old way declares
    the death no sooner than 2T minus a check (15.5 s) after the signal; the bounds (the
    death's generation within 1.5 T, the redone iteration within T + 6 s, both upper bounds
    as the log is polled) leave 4-6 s of room for a loaded machine."""
    iters, gbs = 30, 16
    timeout = 8.0
    job = Job(tmp_path, 2, _layout(iters, gbs), nnodes=2,
              supervisor_args=_etcd_args(etcd, "--heartbeat-timeout", f"{timeout:g}"),
              MECEFO_TEST_STEP_SLEEP="0.1")  # fmt: skip
    try:
        job.start()
        job.wait_for("iteration        5/")
        t_signal = time.monotonic()
        _signal_node(job, 1, sig)
        job.wait_for("(death, now)")
        declared_s = time.monotonic() - t_signal
        job.wait_for("kill -> redone")
        redone_s = time.monotonic() - t_signal
        if sig == signal.SIGSTOP:  # the hung node never wakes: ended as a lost machine is
            _signal_node(job, 1, signal.SIGKILL)
        rc = job.wait(timeout=300)
    finally:
        job.stop()
    log = job.log()
    print(f"follower node {sig.name}: death declared {declared_s:.2f} s, redone {redone_s:.2f} s")
    assert rc == [0, -9], (rc, log[-5000:])
    assert "takes over" not in log, log[-5000:]
    assert declared_s < 1.5 * timeout, f"death declared {declared_s:.2f} s after {sig.name}"
    assert redone_s < timeout + 6.0, f"iteration redone {redone_s:.2f} s after {sig.name}"
    # A killed node's supervisor closes its connection to the leader's liveness listener: its
    # ranks are declared dead at once; a hung one keeps it open: the heartbeat timeout.
    found_by = "its supervisor's connection" if sig == signal.SIGKILL else "has not beaten"
    assert found_by in log, log[-5000:]
    check_every_sample_once(train_records(job.metrics), iters, gbs, 4)
    (failure,) = [r for r in job.records_of("recovery") if r["ranks_lost"]]
    assert sorted(failure["ranks_lost"]) == [2, 3] and sorted(failure["replicas"]) == [0, 1]
    assert sorted(job.params()) == [0, 1]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _train_iterations(job: Job) -> List[int]:
    return [r["iteration"] for r in job.records_of("train")]


def test_leader_node_sigstopped_is_fenced_and_exits(tmp_path: Path, etcd: EtcdCluster) -> None:
    """The leader's node (supervisor and ranks) SIGSTOPped, as a hung machine: its sockets
    stay open. Node 1 goes on within the lease TTL (the heartbeat timeout, at least 10 s) + 3 s.
    After SIGCONT, node 0's
    supervisor finds its lease gone (or its ranks declared dead by the new leader, if it reads
    that first), kills its ranks and exits with one line, having written nothing: no train
    record of an iteration twice, no checkpoint (dump) of its slots."""
    hb = 4.0
    iters, gbs = 80, 16
    args = _layout(iters, gbs) + ["--optimizer", "sgd", "--lr", "0.05"]
    job = Job(tmp_path, 2, args, nnodes=2,
              supervisor_args=_etcd_args(etcd, "--heartbeat-timeout", str(hb)),
              MECEFO_TEST_STEP_SLEEP="0.1")  # fmt: skip
    try:
        job.start()
        job.wait_for("iteration        6/")
        stopped = _node_pids(job, 0)
        _signal_node(job, 0, signal.SIGSTOP)
        t_stop = time.monotonic()
        at_stop = max(_train_iterations(job), default=0)
        while max(_train_iterations(job), default=0) < at_stop + 2:
            assert time.monotonic() - t_stop < 120, job.log()[-4000:]
            assert job.procs[1].poll() is None, job.log()[-4000:]
            time.sleep(0.05)
        went_on_s = time.monotonic() - t_stop
        print(f"SIGSTOP of the leader's node: training went on after {went_on_s:.2f} s")
        time.sleep(2.0)  # a few more iterations on node 1 before node 0 wakes up
        _signal_node(job, 0, signal.SIGCONT)
        job.procs[0].wait(timeout=60)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in stopped) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in stopped if _alive(p)]
        rc = job.wait(timeout=300)
    finally:
        job.stop()
    log = job.log()
    node0 = [line for line in job.logs[0].read_text().splitlines() if "[supervisor node 0]" in line]
    assert rc[0] == 1 and rc[1] == 0, (rc, log[-5000:])
    # Fenced either way: it finds its lease gone, or (whichever it reads first after SIGCONT)
    # that the leader elected meanwhile declared its ranks dead.
    fenced = "lease" in node0[-1] or "this node was declared dead" in node0[-1]
    assert fenced and "exiting" in node0[-1], node0
    assert not left, f"ranks of the stopped node still alive after SIGCONT: {left}"
    ttl = lease_ttl_s(hb)
    assert went_on_s <= ttl + 3.0, f"went on after {went_on_s:.2f} s (lease TTL {ttl:g})"
    its = _train_iterations(job)
    assert len(its) == len(set(its)) == iters, its
    check_every_sample_once(train_records(job.metrics), iters, gbs, 4)
    assert sorted(int(p.stem[4:]) for p in job.dump.glob("slot*.pt")) == [2, 3]


def test_etcd_members_killed(tmp_path: Path, etcd: EtcdCluster) -> None:
    """One etcd member (etcd's raft leader) SIGKILLed mid-run: no effect, the job ends
    normally. A second one killed (no quorum): every supervisor ends with one line naming
    etcd within a bound of the TTL, no hang."""
    hb = 4.0
    iters, gbs = 200, 16
    job = Job(tmp_path, 2, _layout(iters, gbs), nnodes=2,
              supervisor_args=_etcd_args(etcd, "--heartbeat-timeout", str(hb)),
              MECEFO_TEST_STEP_SLEEP="0.1")  # fmt: skip
    try:
        job.start()
        job.wait_for("iteration        4/")
        first = etcd.leader()
        etcd.signal(first, signal.SIGKILL)
        job.wait_for("iteration       30/")
        assert all(p.poll() is None for p in job.procs), job.log()[-4000:]
        second = next(i for i in range(3) if i != first)
        etcd.signal(second, signal.SIGKILL)
        t_kill = time.monotonic()
        rc = job.wait(timeout=3 * lease_ttl_s(hb) + 30)
        ended_s = time.monotonic() - t_kill
    finally:
        job.stop()
    log = job.log()
    print(f"etcd quorum lost: every supervisor ended after {ended_s:.1f} s")
    assert rc == [1, 1], (rc, log[-5000:])
    assert max(_train_iterations(job)) < iters
    for node in (0, 1):
        lines = [x for x in job.logs[node].read_text().splitlines() if "[supervisor node" in x]
        assert "etcd" in lines[-1] and "exiting" in lines[-1], lines[-3:]
    assert ended_s <= 3 * lease_ttl_s(hb) + 20, ended_s


def _wait_past(job: Job, iterations: int) -> None:
    """Until ``iterations`` more iterations are logged (a rejoin's record comes with them)."""
    start = max(_train_iterations(job), default=0)
    deadline = time.monotonic() + 120
    while max(_train_iterations(job), default=0) < start + iterations:
        assert time.monotonic() < deadline, job.log()[-4000:]
        time.sleep(0.1)


def test_leader_lost_twice_with_a_rejoin(tmp_path: Path, etcd: EtcdCluster) -> None:
    """DP3 on three nodes (1 rank each). The leader (node 0) is SIGKILLed; another node wins
    the next term. A new node 0 joins (``--rejoin``, through etcd, started after the loss) and
    is healed. Then the second leader's node is SIGKILLed too: the third term's leader goes
    on, and a new node joins in its place and is healed as well (started as a hot spare
    before that loss, ``--standby 1``: a cold start after it takes about 100 iterations here,
    longer than the job has left). Every sample once, every replica identical at the end (DP3
    again). 250 iterations: at 150, a load of 5-20 let the job end before the second rejoin."""
    iters, gbs = 250, 12
    job = Job(tmp_path, 1, _layout(iters, gbs), nnodes=3, supervisor_args=_etcd_args(etcd),
              MECEFO_TEST_STEP_SLEEP="0.1")  # fmt: skip
    healed = "healed; parameters and optimizer state identical"
    try:
        job.start()
        job.wait_for("iteration        5/")
        _signal_node(job, 0, signal.SIGKILL)
        job.wait_for("this node takes over")
        second = int(job.log().split("] leader node 0 lost")[0].rsplit("[supervisor node ", 1)[1])
        job.start_node(0, rejoin=True)
        job.wait_for(healed)
        _wait_past(job, 5)
        job.start_node(second, rejoin=True, extra=["--standby", "1"])
        job.wait_for(f"rejoin: waiting until rank {second} (incarnation 0) is known dead")
        _signal_node(job, second, signal.SIGKILL)
        job.wait_for(f"leader node {second} lost")
        deadline = time.monotonic() + 300
        while job.log().count(healed) < 2:
            assert time.monotonic() < deadline and job.procs[-1].poll() is None, job.log()[-4000:]
            time.sleep(0.2)
        rejoined_at = max(_train_iterations(job), default=0)
        rc = job.wait(timeout=400)
    finally:
        job.stop()
    log = job.log()
    expect = [-9, 0, 0, 0, 0]
    expect[second] = -9
    assert rc == expect, (rc, log[-5000:])
    assert rejoined_at < iters, f"the second rejoin was healed after the last iteration: {log}"
    assert log.count("this node takes over") == 2, log[-5000:]
    check_every_sample_once(train_records(job.metrics), iters, gbs, 3)
    kinds = [(r["kind"], r["ranks_lost"], r["ranks_joined"]) for r in job.records_of("recovery")]
    assert kinds[0][:2] == ("failure", [0]), kinds
    lost_second = [i for i, (k, lost, _) in enumerate(kinds) if k == "failure" and lost == [second]]
    joined = {tuple(j): i for i, (_, _, j) in enumerate(kinds) if j}
    # Each loss is followed by a join of the lost slot, in that order.
    assert list(joined) == [(0,), (second,)], kinds
    assert 0 < joined[(0,)] < lost_second[0] < joined[(second,)], kinds
    params = job.params()
    assert sorted(params) == [0, 1, 2]
    for slot in (1, 2):
        assert max_param_diff({0: params[0]}, {0: params[slot]}) == 0.0, slot
