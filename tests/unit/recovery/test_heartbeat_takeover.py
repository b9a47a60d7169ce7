"""Heartbeats across a takeover of the leader (``--store-mode etcd``): a live rank must not be
SIGKILLed for a heartbeat timeout because the leader changed.

Seen under Slurm (Megatron-LM, node 0 SIGKILLed with etcd member m0): after the takeover the
new leader asked node 4's supervisor to SIGKILL rank 4, a live spare, for "no heartbeat for
10.1 s". Two causes, one test each:

* the rank's heartbeat thread ended at its first failed beat (a store call that failed while
  the takeover was under way), so the rank fell silent for good;
* the new leader's coordinator counted silence from its own start, before it had published its
  store's address, i.e. before any rank could beat there.

The generation watchdog had the first flaw too (it ended at a failed look, and its rank could
no longer be aborted out of a collective).

Real TCPStore servers and clients (one process); etcd is a stand-in that holds ``hot_store``
(the client that follows the leader on a real etcd: ``tests/integration/recovery``).
"""

from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Tuple

import pytest
import torch.distributed as dist
from coordinator_setup import coordinator_over

from megatron_mecefo.recovery import store_etcd
from megatron_mecefo.recovery.abort import GenerationWatchdog, WorldAborter
from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.coordinator import Coordinator
from megatron_mecefo.recovery.heartbeat import Heartbeat
from megatron_mecefo.recovery.membership import MembershipStore


class HotStoreControl:
    """What ``EtcdStore`` uses of ``EtcdControl``: the value of ``hot_store`` and the term
    that published it (each address its own term here)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.conn = SimpleNamespace(get=self._get)

    def key(self, name: str) -> bytes:
        return name.encode()

    def _get(self, key: bytes) -> Tuple[Any, int]:
        return SimpleNamespace(value=self.address.encode()), 1

    def published_store(self, name: str) -> Tuple[str, int]:
        return self.address, (int(self.address.rsplit(":", 1)[1]) if self.address else 0)


def _server() -> Tuple[Any, str]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)  # fmt: skip
    return server, f"127.0.0.1:{server.port}"


def _count(address: str, key: str) -> int:
    client = MembershipStore.connect(address, 5.0)
    return int(client.store.add(key, 0))


def test_heartbeat_goes_on_after_a_long_takeover(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old leader's store dies; no new one is published for longer than a client waits
    for one (its beats fail meanwhile); then the new leader publishes its store. The rank's
    heartbeat must reach it: before, the thread had ended at the first failed beat."""
    monkeypatch.setattr(store_etcd, "FAILOVER_WAIT_MIN_S", 0.3)
    old, old_address = _server()
    control = HotStoreControl(old_address)
    address = "etcd://127.0.0.1:1/mecefo/hbtest?ttl=0.05"  # the stand-in serves this address
    store_etcd.register_control(address, control)
    beat = Heartbeat(address, slot=4, inc=0, interval_s=0.05).start()
    new = None
    try:
        deadline = time.monotonic() + 10
        while _count(old_address, "hb/4/0") < 3:
            assert time.monotonic() < deadline, "no heartbeat on the first leader's store"
            time.sleep(0.02)
        control.address = ""  # the takeover under way: the next leader restores its store
        del old  # the old leader's process died: its store's connections close
        time.sleep(1.5)  # several failed waits (0.3 s each) for the next store, failed beats
        assert beat.thread.is_alive(), "the heartbeat thread ended at a failed beat"
        new, new_address = _server()
        control.address = new_address
        deadline = time.monotonic() + 15
        while _count(new_address, "hb/4/0") < 3:
            assert time.monotonic() < deadline, "the rank's heartbeats never reached the new store"
            time.sleep(0.02)
        assert beat.failures > 0  # the outage was seen, and survived
    finally:
        beat.stop()
        beat.thread.join(5)
        del new


def test_takeover_counts_silence_from_the_store_publication(store: str) -> None:
    """A new leader's coordinator that started well before its store was published (etcd slow
    to answer the publication) must not count that time as the ranks' silence. After the
    publication, a rank that has not beaten on the new store yet (reconnecting) gets twice the
    timeout; one that beat there and fell silent, the timeout; both are then asked killed."""
    timeout = 6.0
    cfg = RecoveryConfig(store=store, heartbeat_interval_s=0.5, heartbeat_timeout_s=timeout)
    ms = MembershipStore.connect(store)
    ms.mark_ready(4, 0, {})
    coord = Coordinator(MembershipStore.connect(store), 8, cfg, log=lambda line: None)
    coord._rescan()
    assert (4, 0) in coord.ready
    started = time.monotonic() - 10.0  # the coordinator's first look, 10 s ago
    coord._check_heartbeats(started)
    coord.restart_heartbeat_clock()  # the store's address published now
    published = time.monotonic()
    coord._check_heartbeats(published)  # no beat yet: the rank is only now finding the store
    assert ms.get_str("kill/4/0") is None, "a live rank was killed for the takeover's duration"
    coord._check_heartbeats(published + timeout + 0.5)
    assert ms.get_str("kill/4/0") is None, "killed while still reconnecting to the new store"
    coord._check_heartbeats(published + 2 * timeout + 0.5)  # never beat here: twice the timeout
    assert ms.get_str("kill/4/0") is not None, "a rank that never beat again was not killed"
    # A rank that beat on the new store and then fell silent: the plain timeout.
    ms.mark_ready(5, 0, {})
    coord._rescan()
    ms.heartbeat(5, 0)
    coord._check_heartbeats(published + 1.0)
    coord._check_heartbeats(published + 1.0 + timeout + 0.5)
    assert ms.get_str("kill/5/0") is not None, "a rank silent for the timeout was not killed"


def test_watchdog_survives_a_failed_look() -> None:
    """Looks at the generation that fail (the store lost mid-takeover) are retried: the
    failure generation published meanwhile still aborts the world."""
    looks: list = []
    fired: list = []

    def current() -> int:
        looks.append(time.monotonic())
        if len(looks) <= 2:
            raise RuntimeError("the membership store was lost (a takeover under way)")
        return 5

    class Recorder(WorldAborter):
        def abort(self) -> None:
            fired.append(time.monotonic())

    dog = GenerationWatchdog(current, 4, Recorder(), 0.05).start()
    try:
        deadline = time.monotonic() + 10
        while not fired:
            assert time.monotonic() < deadline, "the watchdog ended at a failed look"
            time.sleep(0.01)
        assert dog.fired == 5 and len(looks) >= 3
    finally:
        dog.stop()
        dog.thread.join(5)


def test_silent_node_is_declared_dead_after_one_timeout(store: str) -> None:
    """A node lost whole (SIGKILL or SIGSTOP of its supervisor and ranks): its ranks fall
    silent and so does their supervisor, so nobody will answer the kill request. They are
    declared dead at the first check past one heartbeat timeout; before, the coordinator
    waited a second timeout for the dead supervisor to confirm (a follower node's loss cost
    two timeouts: 13 s under Slurm at a 6 s timeout). A silent rank whose supervisor beats
    is only asked killed, and its supervisor's report is awaited as before."""
    timeout = 6.0
    ms, coord = coordinator_over(store, timeout, {2: "1@lost:11", 3: "1@lost:11", 4: "2@alive:12"})

    def node_2_beats() -> None:
        ms.supervisor_heartbeat("2@alive:12")

    t0 = time.monotonic()
    coord._check_heartbeats(t0)  # the last beats seen; from here on node 1 is silent
    node_2_beats()
    ms.heartbeat(4, 0)
    coord._check_heartbeats(t0 + timeout - 0.5)
    assert ms.get_str("kill/2/0") is None and ms.dead_info(2, 0) is None, "dead too early"
    node_2_beats()
    ms.heartbeat(4, 0)  # rank 4's last beat
    t1 = t0 + timeout + 0.5
    coord._check_heartbeats(t1)
    for slot in (2, 3):
        assert ms.get_str(f"kill/{slot}/0") is not None  # a hung supervisor that wakes kills
        info = ms.dead_info(slot, 0)
        assert info is not None, f"rank {slot} of a silent node not declared after one timeout"
        assert info["exit_code"] is None
    assert (2, 0) in coord.dead and (3, 0) in coord.dead
    # Rank 4 falls silent; its supervisor beats: the rank is asked killed, not declared dead.
    node_2_beats()
    coord._check_heartbeats(t1 + timeout + 0.5)
    assert ms.get_str("kill/4/0") is not None, "a silent rank was not asked killed"
    node_2_beats()
    coord._check_heartbeats(t1 + timeout + 1.0)
    assert ms.dead_info(4, 0) is None, "declared dead while its live supervisor may answer"
