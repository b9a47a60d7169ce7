"""A follower's watch of the leader's store (``StoreHost._watch_leader``): a store whose port
refuses connections (its process is dead) ends the leader's term at once; a silent one (a
hung process: its socket listens, nothing answers) does not. One process: the leader's store
is a real TCPStore server in this process, and etcd is a stand-in that records the
revocation (the revocation on a real etcd: ``test_etcd_control.py``)."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.etcd_control import Term
from megatron_mecefo.recovery.store_host import StoreHost


class FakeControl:
    """What the watch uses of ``EtcdControl``: ``hot_store``'s value, the leader's lease and
    how long it has not been renewed (a dead leader's: never again), and ``end_term_of``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.term: Optional[Term] = None
        self.ended: List[Tuple[str, float]] = []
        self.conn = SimpleNamespace(get=self._get)
        self.leader_key = b"leader"
        self.silent_s = 5

    def key(self, name: str) -> bytes:
        return name.encode()

    def _get(self, key: bytes) -> Tuple[Any, int]:
        return SimpleNamespace(value=self.address.encode(), lease=7), 1

    def lease_silent_s(self, lease: int) -> Optional[int]:
        return self.silent_s

    def end_term_of(self, name: str, value: str, note: str) -> Optional[Term]:
        self.ended.append((value, time.monotonic()))
        self.address = ""  # as the next leader does first: the watch waits for its store
        return Term("leader", 1, 7, 0)


def _watching(address: str) -> Tuple[StoreHost, FakeControl, threading.Thread]:
    args = argparse.Namespace(node_rank=1, nnodes=2, nproc_per_node=1, rejoin=False)
    host = StoreHost(args, RecoveryConfig(), log=lambda line: None)
    host.control = control = FakeControl(address)
    thread = threading.Thread(target=host._watch_leader, daemon=True)
    thread.start()
    return host, control, thread


def test_a_dead_store_ends_the_term_at_once() -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)  # fmt: skip
    address = f"127.0.0.1:{server.port}"
    host, control, thread = _watching(address)
    try:
        time.sleep(1.5)  # the watch holds its connection; a living store ends nothing
        assert control.ended == []
        t0 = time.monotonic()
        del server  # its listener and connections close, as at the process's death
        deadline = time.monotonic() + 10
        while not control.ended and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [v for v, _ in control.ended] == [address]
        # At the connection's close (here ~0.05 s), not after a poll or a lease TTL; 5 s
        # leaves room for a loaded machine's scheduling.
        assert control.ended[0][1] - t0 < 5.0
    finally:
        host._closing.set()
        thread.join(5)


def test_a_silent_store_ends_nothing() -> None:
    """A socket that listens and never accepts: connects succeed (the kernel's backlog), no
    answer ever comes; the watch waits (the lease TTL ends such a term)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    host, control, thread = _watching(f"127.0.0.1:{listener.getsockname()[1]}")
    try:
        time.sleep(2.5)
        assert control.ended == []
    finally:
        host._closing.set()
        thread.join(5)
        listener.close()
