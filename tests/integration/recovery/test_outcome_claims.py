"""Outcomes claimed on etcd (``commit.claim``): a commit outlives the hot store that counted it.

In ``--store-mode etcd`` the vote counts on the leader's hot store, which dies with the
leader. Before the claims, the evidence of a commit (the count, the commit key) lived there
alone: a step that only a node lost with the leader applied was aborted by the next world,
which could not tell it from a step nobody applied (the staged model check's ``agreement``,
``tests/unit/recovery/test_protocol_staged.py``). Here, with a real etcd and a hot store in a
process of its own that is SIGKILLed:

* the completer's commit stands after the takeover: the next world's resolver commits it;
* an abort claimed first refuses a later commit claim: its completer applies nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Iterator, Tuple

import pytest
import torch.distributed as dist
from etcd_cluster import EtcdCluster, running_cluster

from megatron_mecefo.recovery import commit
from megatron_mecefo.recovery.etcd_control import EtcdControl
from megatron_mecefo.recovery.membership import MembershipStore
from megatron_mecefo.recovery.prepared import resolve
from megatron_mecefo.recovery.store_etcd import EtcdStore, etcd_address, restore

TTL = 10

_SERVE = (
    "import sys, time, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', 0, None, True, wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    yield from running_cluster(tmp_path_factory.mktemp("etcd"))


@pytest.fixture
def hot_store() -> Iterator[Tuple[subprocess.Popen, str]]:
    """A leader's hot TCPStore in a process of its own (SIGKILLed by PID at the end)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield proc, f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _leader(etcd: EtcdCluster, prefix: str, me: str, hot: str) -> EtcdControl:
    control = EtcdControl(etcd.endpoints, prefix, TTL)
    control.campaign(me, 10.0)
    control.put_fenced("hot_store", hot)
    return control


def _take_over(etcd: EtcdCluster, prefix: str, old: EtcdControl) -> Tuple[EtcdControl, object]:
    """The next leader: elected once the old one's lease is gone, serves a store restored
    from etcd (no vote counter, no commit key) and publishes it."""
    old.resign()
    new = EtcdControl(etcd.endpoints, prefix, TTL)
    new.campaign("node1", 10.0)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)  # fmt: skip
    restore(new, server)
    new.put_fenced("hot_store", f"127.0.0.1:{server.port}")
    return new, server


def test_a_commit_applied_only_by_a_node_lost_with_the_hot_store_stands(
    etcd: EtcdCluster, hot_store: Tuple[subprocess.Popen, str]
) -> None:
    """Two voters (the hot counter counts 2: two groups). The second vote completes the count
    and its voter applies the step; then the leader's node dies with the hot store. The next
    world's members are in doubt (counted 2) and none of them applied it: the resolver finds
    the commit claimed on etcd and commits (before: its abort on the new store's empty counter
    aborted a step that the dead node had applied). A second resolver reads the same."""
    proc, address = hot_store
    prefix = f"/mecefo/claims{os.getpid()}_a"
    url = etcd_address(etcd.endpoints, prefix, TTL)
    first = _leader(etcd, prefix, "node0", address)
    voter = MembershipStore(EtcdStore(url, 30.0, raise_on_failover=True))
    second = server = None
    try:
        voter.store.add("votes/0/1", 1)  # the other group's vote, counted on the hot store
        assert commit.vote(voter, 0, 1, 0, [0, 1], 0.01)  # completes the count: applies
        os.kill(proc.pid, signal.SIGKILL)  # the leader's node, and its hot store, are lost
        proc.wait(10)
        second, server = _take_over(etcd, prefix, first)
        world = MembershipStore(EtcdStore(url, 30.0))
        assert not world.store.check(["votes/0/1"])  # the count was lost with the store
        assert resolve(world, 0, 1, counted=2, applied=False, decision_wait_s=0.5) is True
        later = MembershipStore(EtcdStore(url, 30.0))
        assert resolve(later, 0, 1, counted=2, applied=False, decision_wait_s=0.5) is True
    finally:
        for control in (first, second):
            if control is not None:
                control.close()
        del server


def test_an_abort_claimed_first_refuses_a_later_commit(
    etcd: EtcdCluster, hot_store: Tuple[subprocess.Popen, str]
) -> None:
    """The count completes on the old hot store, but its completer stalls before its claim;
    the leader is lost and the next world resolves the step first: nobody applied it, so it
    claims abort. The stalled completer's commit (``commit._commit``, its client now following
    the new leader) finds the abort standing and applies nothing; the new store has no commit
    key for anyone to find."""
    proc, address = hot_store
    prefix = f"/mecefo/claims{os.getpid()}_b"
    url = etcd_address(etcd.endpoints, prefix, TTL)
    first = _leader(etcd, prefix, "node0", address)
    completer = MembershipStore(EtcdStore(url, 30.0))
    second = server = None
    try:
        assert completer.store.add("votes/0/1", 2) == 2  # every vote in: a commit to claim
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        second, server = _take_over(etcd, prefix, first)
        world = MembershipStore(EtcdStore(url, 30.0))
        assert resolve(world, 0, 1, counted=2, applied=False, decision_wait_s=0.5) is False
        t0 = time.monotonic()
        assert commit._commit(completer, 0, 1) is False  # the abort stands
        assert time.monotonic() - t0 < 60
        assert not world.store.check(["commit/0/1"])
    finally:
        for control in (first, second):
            if control is not None:
                control.close()
        del server
