"""The etcd control plane at its edges, against a real 3-member etcd (one per module; a fresh
one where a test kills members) and the real classes: ``EtcdControl``, ``EtcdStore``,
``StoreHost``, the ``Coordinator``, real TCPStore servers.

* a coordinator thread that fails hands the leadership over with one line;
* durable writes are fenced by the term, not by the store's address (a reused port), and a
  rank declared dead writes nothing; a death and the fatal message: the first writer's stands;
* a follower deposes a leader only on a refusal that lasts and a stale heartbeat;
* the leader compacts etcd's history; NOSPACE is said as NOSPACE, with its fix;
* a node that lost etcd says so, not that etcd lost its quorum.

Time bounds sit far from what they separate (a 10 s lease against a 1-2 s revocation), so
that a loaded machine does not break them. Every etcd member is stopped by its PID.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest
import torch.distributed as dist
from etcd_cluster import EtcdCluster, etcd_missing_reason, free_port_block, running_cluster

from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.etcd_control import (
    ControlPlaneLost,
    EtcdControl,
    EtcdNoSpace,
    Fenced,
)
from megatron_mecefo.recovery.membership import MembershipStore
from megatron_mecefo.recovery.store_etcd import EtcdStore, etcd_address, register_control
from megatron_mecefo.recovery.store_etcd import Fenced as StoreFenced
from megatron_mecefo.recovery.store_forwarding import StoreFailedOver
from megatron_mecefo.recovery.store_host import StoreHost

TTL = 10  # the leases' TTL here: the floor a supervisor's lease gets


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    yield from running_cluster(tmp_path_factory.mktemp("etcd"))


_PREFIXES = iter(range(10**6))


def _prefix() -> str:
    return f"/mecefo/edges{os.getpid()}_{next(_PREFIXES)}"


def _server() -> Tuple[Any, str]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)  # fmt: skip
    return server, f"127.0.0.1:{server.port}"


def _leader(etcd: EtcdCluster, prefix: str, me: str, hot: str, **kw: Any) -> EtcdControl:
    """A leader as a supervisor's: elected, its store's address published in its term."""
    control = EtcdControl(etcd.endpoints, prefix, TTL, **kw)
    control.campaign(me, 10.0)
    control.put_fenced("hot_store", hot)
    return control


def _value(control: EtcdControl, name: str) -> Any:
    kv, _ = control.conn.get(control.key(name))
    return None if kv is None else kv.value.decode()


def _refusing_address() -> str:
    """A port of this machine where nothing listens (a connect is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


# ---------------------------------------------------------------------- the coordinator


def test_a_failed_coordinator_thread_hands_the_leadership_over(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's coordinator gets a ControlPlaneLost on a durable write (the generation a
    death needs). Before, its thread ended with a log line and the node kept its lease: no
    later death made a generation, and no other node could take over. Now the node resigns
    its lease (another candidate is elected at once, long before the 10 s TTL) and stops
    with one line naming the error."""
    job = f"edges{os.getpid()}coord"
    monkeypatch.setenv("MECEFO_JOB_ID", job)
    args = argparse.Namespace(
        store_mode="etcd", etcd_endpoints=etcd.endpoints, node_rank=0, nnodes=1,
        nproc_per_node=1, rejoin=False, store_host="127.0.0.1", store_port=0, store_file=None,
        command=["train.py"],
    )  # fmt: skip
    cfg = RecoveryConfig(heartbeat_timeout_s=4.0, init_timeout_s=60.0)
    host = StoreHost(args, cfg, log=lambda line: None)
    lines: List[str] = []
    host.on_control_lost = lines.append
    other = EtcdControl(etcd.endpoints, f"/mecefo/{job}", TTL)
    try:
        host.open()
        assert host.control is not None and host.control.term is not None
        coordinator = host.coordinator
        assert coordinator is not None and coordinator.thread is not None

        pinned = coordinator.ms.store
        real_set = pinned.set

        def set_failing(key: str, value: Any) -> None:
            if key.startswith("gen/"):
                raise ControlPlaneLost("etcd control plane lost: injected on publish " + key)
            real_set(key, value)

        monkeypatch.setattr(pinned, "set", set_failing)
        client = MembershipStore.connect(cfg.store, 30.0)
        client.set_json("layout", {"tp": 1, "pp": 1, "dp": 1})
        client.mark_ready(0, 0, {})
        client.report_dead(0, 0, {"exit_code": -9, "reason": "test"})  # needs generation 1

        coordinator.thread.join(30)
        assert not coordinator.thread.is_alive()
        assert len(lines) == 1, lines
        assert "coordinator thread failed (ControlPlaneLost" in lines[0], lines
        assert "resigned its etcd lease" in lines[0], lines
        # The lease is gone now, not at its expiry: another node is elected at once.
        term = other.campaign("node1", 3.0)
        assert term.number > 0
    finally:
        other.close()
        host.close()


# ---------------------------------------------------------------------- fencing by term


def test_a_write_of_an_earlier_term_is_refused_when_the_address_is_reused(
    etcd: EtcdCluster,
) -> None:
    """Term 1 serves its store at HOST:PORT; its term ends and term 2 publishes the same
    HOST:PORT (a port derived from the job id, reused). A client of term 1's store writes
    ``progress``: refused on etcd (it compares the term, not the address), and the client
    learns of the failover; its next write lands in term 2. Before, the write compared the
    address and landed."""
    server, address = _server()
    prefix = _prefix()
    first = _leader(etcd, prefix, "node0", address)
    store = EtcdStore(etcd_address(etcd.endpoints, prefix, TTL), 30.0, raise_on_failover=True)
    second = None
    try:
        store.set("progress", "1")
        assert _value(first, "kv/progress") == "1"
        first.resign()
        second = _leader(etcd, prefix, "node1", address)  # the same address, a later term
        with pytest.raises(StoreFailedOver):
            store.set("progress", "2")
        assert _value(second, "kv/progress") == "1", "a write of term 1 landed in term 2"
        store.set("progress", "2")  # it follows term 2 now
        assert _value(second, "kv/progress") == "2"
    finally:
        first.close()
        if second is not None:
            second.close()
        del server


def test_a_rank_declared_dead_writes_nothing(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank (slot 3, incarnation 0) that runs on after it was declared dead (cut off, hung
    and woken) writes ``progress``, ``logged`` and a death: each is refused on etcd, with
    one line naming the rank. A live incarnation of another slot writes as before."""
    server, address = _server()
    prefix = _prefix()
    leader = _leader(etcd, prefix, "node0", address)
    monkeypatch.setenv("MECEFO_RECOVERY_SLOT", "3")
    monkeypatch.setenv("MECEFO_RECOVERY_INC", "0")
    store = EtcdStore(etcd_address(etcd.endpoints, prefix, TTL), 30.0)
    try:
        store.set("progress", "4")
        leader.put_fenced("kv/dead/3/0", json.dumps({"exit_code": None, "reason": "heartbeat"}))
        for key, value in (("progress", "5"), ("logged", "5"), ("dead/2/0", "{}")):
            with pytest.raises(StoreFenced, match="rank 3 .incarnation 0. was declared dead"):
                store.set(key, value)
        assert _value(leader, "kv/progress") == "4"
        assert _value(leader, "kv/logged") is None and _value(leader, "kv/dead/2/0") is None
        monkeypatch.setenv("MECEFO_RECOVERY_INC", "1")  # its replacement
        store.set("progress", "5")
        assert _value(leader, "kv/progress") == "5"
    finally:
        leader.close()
        del server


def test_the_first_death_and_fatal_message_stand(etcd: EtcdCluster) -> None:
    """A death recorded by the coordinator (no exit code: its node was lost) is not
    overwritten by a later report of the same incarnation, and the first fatal message
    stands, on etcd and on the hot store, from a follower's client and the leader's own."""
    server, address = _server()
    prefix = _prefix()
    leader = _leader(etcd, prefix, "node0", address)
    url = etcd_address(etcd.endpoints, prefix, TTL)
    register_control(url, leader)  # as the leader's supervisor does: its client is fenced on it
    follower = MembershipStore(EtcdStore(url, 30.0))
    own = MembershipStore(EtcdStore(url, 30.0, pinned=address))
    try:
        declared = {"exit_code": None, "reason": "heartbeat, no supervisor"}
        own.report_dead(2, 0, declared)
        follower.report_dead(2, 0, {"exit_code": 1, "reason": "a zombie's report"})
        assert json.loads(_value(leader, "kv/dead/2/0")) == declared
        assert follower.dead_info(2, 0) == declared
        follower.set_fatal("first")
        own.set_fatal("second")
        follower.set_fatal("third")
        assert _value(leader, "kv/fatal") == "first"
        assert follower.get_str("fatal") == "first"
    finally:
        leader.close()
        del server


# ---------------------------------------------------------------------- revocation


def _follower(etcd: EtcdCluster, prefix: str) -> Tuple[StoreHost, List[str], threading.Thread]:
    args = argparse.Namespace(node_rank=1, nnodes=2, nproc_per_node=1, rejoin=False)
    lines: List[str] = []
    host = StoreHost(args, RecoveryConfig(), log=lines.append)
    host.control = EtcdControl(etcd.endpoints, prefix, TTL)
    thread = threading.Thread(target=host._watch_leader, daemon=True)
    thread.start()
    return host, lines, thread


def test_a_refusal_alone_deposes_no_live_leader(etcd: EtcdCluster) -> None:
    """The leader's store address refuses connections (a firewall's REJECT, a listener on
    another address) while the leader lives and renews its lease. Before, the follower's
    first refused connect revoked the lease. Now it needs the leader's heartbeat on etcd to
    be stale too: the term stands. Once the leader stops renewing (as a dead process does),
    the follower revokes its lease, well before the lease would expire."""
    prefix = _prefix()
    leader = _leader(etcd, prefix, "node0", _refusing_address())
    assert leader.term is not None
    term = leader.term.number
    host, lines, thread = _follower(etcd, prefix)
    try:
        time.sleep(4.0)  # many refusals, more than 0.5 s apart
        assert leader.leader() == ("node0", term), lines
        assert not leader.lost.is_set() and lines == []
        leader._stop_keepalive.set()  # its renewals stop: dead, its lease not yet expired
        t0 = time.monotonic()
        while leader.leader() is not None:
            assert time.monotonic() - t0 < TTL - 2, "not revoked: the lease had to expire"
            time.sleep(0.05)
        # The follower says so after its revoke returns: the key may vanish a moment before.
        deadline = time.monotonic() + 10.0
        while not any("revoked the lease of node0" in x for x in lines):
            assert time.monotonic() < deadline, lines
            time.sleep(0.05)
    finally:
        host._closing.set()
        thread.join(10)
        assert host.control is not None
        host.control.close()
        leader.close()


# ---------------------------------------------------------------------- history and space


def test_the_leader_compacts_the_history_in_its_term(etcd: EtcdCluster) -> None:
    """Per-iteration writes leave a revision each; the leader compacts the history every
    period to the revision it saw one period before: a watch from the job's first revision
    then finds it compacted. A deposed leader compacts nothing (fenced)."""
    prefix = _prefix()
    leader = _leader(etcd, prefix, "node0", "127.0.0.1:1", compact_every_s=0.5)
    first = leader.conn.range(leader.key(""), prefix=True).header.revision
    try:
        deadline = time.monotonic() + 60
        i = 0
        while True:
            leader.put_fenced("kv/progress", str(i))
            i += 1
            got = leader.conn.watch_once(leader.key("kv/progress"), first, 1.0)
            if got == [None]:  # "compacted": the history before a recent revision is gone
                break
            assert time.monotonic() < deadline, "the history was never compacted"
            time.sleep(0.2)
        assert _value(leader, "kv/progress") == str(i - 1)
        leader.resign()
        with pytest.raises(Fenced):
            leader.compact_history()
    finally:
        leader.close()


@pytest.fixture
def tiny_etcd(tmp_path: Path) -> Iterator[str]:
    """One etcd member whose space quota (200 kB) a few hundred writes fill."""
    missing = etcd_missing_reason()
    if missing:
        pytest.skip(missing)
    base = free_port_block(2)
    client, peer = f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"
    proc = subprocess.Popen(
        ["etcd", "--name", "m0", "--data-dir", str(tmp_path / "data"),
         "--listen-client-urls", f"http://{client}", "--advertise-client-urls", f"http://{client}",
         "--listen-peer-urls", f"http://{peer}", "--initial-advertise-peer-urls", f"http://{peer}",
         "--initial-cluster", f"m0=http://{peer}", "--quota-backend-bytes", "200000"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "etcd.log", "w"), start_new_session=True,
    )  # fmt: skip
    try:
        conn = EtcdControl([client], "/probe", 2).conn
        deadline = time.monotonic() + 60
        while True:
            try:
                conn.get(b"/probe")
                break
            except ControlPlaneLost:
                assert time.monotonic() < deadline and proc.poll() is None, "etcd did not start"
        conn.close()
        yield client
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_nospace_is_said_as_nospace_with_its_fix(tiny_etcd: str) -> None:
    """etcd over its space quota refuses writes (RESOURCE_EXHAUSTED, "database space
    exceeded"). Before, that was retried as transient until the call's bound and reported as
    a lost quorum. Now the write fails at its first answer with one line that names NOSPACE
    and the fix; a supervisor's last line says the job stops."""
    control = EtcdControl([tiny_etcd], _prefix(), TTL, call_timeout_s=30.0)
    control.campaign("node0", 10.0)
    try:
        with pytest.raises(EtcdNoSpace) as caught:
            for i in range(10_000):
                t0 = time.monotonic()
                control.put_fenced(f"kv/record/{i}", "x" * 4000)
        refused_in = time.monotonic() - t0
        line = str(caught.value)
        assert "\n" not in line and "quorum" not in line, line
        for fix in ("NOSPACE", "etcdctl compact", "etcdctl defrag", "etcdctl alarm disarm",
                    "--quota-backend-bytes"):  # fmt: skip
            assert fix in line, (fix, line)
        assert refused_in < 25.0, f"retried for {refused_in:.1f} s (the bound is 30 s)"
        from megatron_mecefo.recovery.supervisor import control_lost_line

        assert "the job stops" in control_lost_line(line, 0)
    finally:
        control.close()


# ---------------------------------------------------------------------- a node's last line


def test_a_node_that_lost_etcd_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two of three etcd members killed: this node gets no answer with a quorum. It cannot
    tell a lost quorum from its own lost links (a partition shows it the same), so its
    supervisor's last line says "this node lost etcd", never "etcd has no quorum" (before,
    chosen by the word "quorum" in the error, which every such error has)."""
    from megatron_mecefo.recovery import supervisor as supervisor_module

    for etcd in running_cluster(tmp_path / "etcd"):
        etcd.signal(1, signal.SIGKILL)
        etcd.signal(2, signal.SIGKILL)
        control = EtcdControl(etcd.endpoints, _prefix(), 2)
        with pytest.raises(ControlPlaneLost) as caught:
            control.conn.get(control.key("leader"))
        control.close()
    said: List[str] = []
    sup = supervisor_module.Supervisor.__new__(supervisor_module.Supervisor)
    sup.children, sup.standby, sup.node = {}, [], 1
    monkeypatch.setattr(sup, "log", said.append)

    def no_exit(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(supervisor_module.os, "_exit", no_exit)
    with pytest.raises(SystemExit) as exited:
        sup._control_lost(str(caught.value))
    assert exited.value.code == 1
    assert len(said) == 1 and "this node lost etcd" in said[0], said
    assert "etcd has no quorum" not in said[0], said
