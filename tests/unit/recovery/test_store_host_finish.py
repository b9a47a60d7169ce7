"""The store's host at the job's end (``StoreHost.finish_node``): it waits for the nodes that
still run, not for a node already declared lost (every rank of it, in its current
incarnation, declared dead by someone other than its supervisor). One in-process TCPStore."""

from __future__ import annotations

import argparse
import threading
import time

from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.membership import MembershipStore
from megatron_mecefo.recovery.store_forwarding import tcp_client
from megatron_mecefo.recovery.store_host import StoreHost


def _host(store: str, nnodes: int = 3, nproc: int = 2) -> StoreHost:
    args = argparse.Namespace(node_rank=0, nnodes=nnodes, nproc_per_node=nproc, rejoin=False)
    host = StoreHost(args, RecoveryConfig(), log=lambda line: None)
    host.ms = MembershipStore(tcp_client(store, 10))
    return host


def _dead(ms: MembershipStore, slot: int, inc: int, exit_code: object) -> None:
    ms.report_dead(slot, inc, {"exit_code": exit_code, "reason": "test", "t": 0})


def test_lost_nodes_counts_only_nodes_declared_dead_in_their_current_incarnation(
    store: str,
) -> None:
    host = _host(store)
    ms = host.ms
    assert ms is not None
    assert host._lost_nodes() == 0
    _dead(ms, 2, 0, None)  # node 1: one rank of two declared dead
    assert host._lost_nodes() == 0
    _dead(ms, 3, 0, None)  # node 1: both
    assert host._lost_nodes() == 1
    _dead(ms, 4, 0, -9)  # node 2: its supervisor reported (it lives, it says done itself)
    _dead(ms, 5, 0, -9)
    assert host._lost_nodes() == 1
    ms.store.set("inc/2", "1")  # node 1 rejoined: a newer incarnation runs on slot 2
    ms.store.set("inc/3", "1")
    assert host._lost_nodes() == 0


def test_finish_node_does_not_wait_for_a_lost_node(store: str) -> None:
    """Three nodes: node 1 finished, node 2 was declared dead: the host returns at once
    (before, it waited 30 s for node 2). A node that neither finished nor is lost is waited
    for: the same call with node 2 alive does not return within a second."""
    host = _host(store)
    ms = host.ms
    assert ms is not None
    host.hosts_store = True
    ms.store.add("nodes_done", 1)  # node 1
    for slot in (4, 5):
        _dead(ms, slot, 0, None)
    t0 = time.monotonic()
    host.finish_node()
    assert time.monotonic() - t0 < 5.0
    # Again, with node 2 alive: the host waits until it says it finished (a second later).
    ms.store.delete_key("dead/4/0")
    ms.store.add("nodes_done", -1)  # the host's own count of the call above
    t0 = time.monotonic()  # before the timer starts, so the lower bound holds under any load
    threading.Timer(1.0, lambda: ms.store.add("nodes_done", 1)).start()
    host.finish_node()
    waited = time.monotonic() - t0
    assert 1.0 <= waited < 5.0, waited
