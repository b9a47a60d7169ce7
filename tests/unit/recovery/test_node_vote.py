"""The node-level commit vote (:mod:`megatron_mecefo.recovery.node_vote`): node servers as
threads (and one as a process, to kill it), ranks as threads with their own clients, over a
real in-process TCPStore."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
from concurrent.futures import Future
from typing import Dict, Iterator, List, Tuple

import pytest

from megatron_mecefo.recovery.commit import ABORT_WEIGHT
from megatron_mecefo.recovery.membership import Generation, MembershipStore
from megatron_mecefo.recovery.node_vote import NodeVoteClient, NodeVoteLost, NodeVoteServer

RANKS = 2  # ranks per node; slot s lives on node s // RANKS


def node_of(slot: int) -> int:
    return slot // RANKS


@pytest.fixture
def sockdir() -> Iterator[str]:
    # Unix socket paths are limited to 108 bytes: pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="nv") as d:
        yield d


def _job(store: str, sockdir: str, nodes: int, **kw) -> Tuple[List, Dict[int, NodeVoteClient]]:
    ms = MembershipStore.connect(store)
    members = {s: 0 for s in range(nodes * RANKS)}
    ms.publish(Generation(number=0, replicas=(), members=members))
    servers = [
        NodeVoteServer(f"{sockdir}/n{n}", store, node=n, poll_interval_s=0.005, **kw)
        for n in range(nodes)
    ]
    clients = {s: NodeVoteClient(f"{sockdir}/n{node_of(s)}", node_of) for s in members}
    return servers, clients


def _vote_all(clients: Dict[int, NodeVoteClient], iteration: int, skip=()) -> Dict[int, Future]:
    members = sorted(clients)
    return {s: c.start(0, iteration, s, members) for s, c in clients.items() if s not in skip}


def test_every_rank_of_every_node_commits(store: str, sockdir: str) -> None:
    """Three nodes of two ranks, three iterations: every rank sees COMMIT, and the store's
    counter counted nodes (3), not ranks (6)."""
    servers, clients = _job(store, sockdir, nodes=3)
    ms = MembershipStore.connect(store)
    for it in (1, 2, 3):
        results = {s: f.result(timeout=30) for s, f in _vote_all(clients, it).items()}
        assert all(ok for ok, _, _ in results.values()), results
        # Exactly one node's vote completed the count (both its ranks say so).
        assert len({node_of(s) for s, (_, last, _) in results.items() if last}) == 1
        assert sum(1 for _, last, _ in results.values() if last) == RANKS
        if it == 3:  # iteration 2's keys were forgotten by the node that completed 3
            assert int(ms.store.add("votes/0/3", 0)) == 3
    assert [s.casts for s in servers] == [3, 3, 3]  # one vote per node per iteration
    for s in servers:
        s.close()


def test_one_rank_aborts_every_rank_aborts(store: str, sockdir: str) -> None:
    """Rank 3 (node 1) aborts instead of voting: every rank of every node sees ABORT."""
    servers, clients = _job(store, sockdir, nodes=3)
    futures = _vote_all(clients, 1, skip=(3,))
    time.sleep(0.2)  # the other nodes have cast their votes and wait
    assert clients[3].abort(0, 1, 3, sorted(clients)) is False
    outcomes = {s: f.result(timeout=30)[0] for s, f in futures.items()}
    assert outcomes == {s: False for s in futures}
    ms = MembershipStore.connect(store)
    assert int(ms.store.add("votes/0/1", 0)) == ABORT_WEIGHT + 2  # two nodes voted, one aborted
    for s in servers:
        s.close()


def test_silent_rank_aborts_within_the_bound(store: str, sockdir: str) -> None:
    """Rank 5 never votes: its node aborts after the gather bound (0.5 s), every rank aborts."""
    servers, clients = _job(store, sockdir, nodes=3, gather_timeout_s=0.5)
    t0 = time.monotonic()
    futures = _vote_all(clients, 1, skip=(5,))
    outcomes = {s: f.result(timeout=30)[0] for s, f in futures.items()}
    assert outcomes == {s: False for s in futures}
    assert time.monotonic() - t0 >= 0.5  # not before the bound
    # The node is not stuck: the next iteration commits when everyone votes.
    assert all(f.result(timeout=30)[0] for f in _vote_all(clients, 2).values())
    for s in servers:
        s.close()


def test_rank_death_before_voting_aborts(store: str, sockdir: str) -> None:
    """A rank whose connection closes before it voted (it died) aborts its node at once."""
    servers, clients = _job(store, sockdir, nodes=2, gather_timeout_s=60)
    futures = _vote_all(clients, 1, skip=(1,))
    time.sleep(0.2)
    clients[1].close()
    outcomes = {s: f.result(timeout=30)[0] for s, f in futures.items()}
    assert outcomes == {s: False for s in futures}
    for s in servers:
        s.close()


def _serve_node(path: str, store: str, node: int, ready) -> None:
    NodeVoteServer(path, store, node=node, poll_interval_s=0.005)
    ready.set()
    while True:
        time.sleep(1)


def test_node_dying_mid_vote_never_splits(store: str, sockdir: str) -> None:
    """Node 1's server (a process) gathers one of its two votes and is SIGKILLed. Nodes 0 and
    2 have cast and wait; when the failure generation is published (as the coordinator does
    after the node's heartbeat stops), they abort. No rank sees COMMIT; node 1's ranks raise
    :class:`NodeVoteLost`."""
    ms = MembershipStore.connect(store)
    members = {s: 0 for s in range(3 * RANKS)}
    ms.publish(Generation(number=0, replicas=(), members=members))
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_serve_node, args=(f"{sockdir}/n1", store, 1, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(120), "node 1's server did not start"
        servers = [
            NodeVoteServer(f"{sockdir}/n{n}", store, node=n, poll_interval_s=0.005) for n in (0, 2)
        ]
        clients = {s: NodeVoteClient(f"{sockdir}/n{node_of(s)}", node_of) for s in members}
        futures = _vote_all(clients, 1, skip=(3,))  # slot 3 (node 1) is slow
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(NodeVoteLost):
            futures[2].result(timeout=30)
        with pytest.raises(NodeVoteLost):
            clients[3].start(0, 1, 3, sorted(members)).result(timeout=30)
        time.sleep(0.3)
        assert not any(futures[s].done() for s in (0, 1, 4, 5))  # waiting: no outcome yet
        ms.publish(Generation(number=1, replicas=(), members={0: 0, 1: 0, 4: 0, 5: 0}))
        outcomes = {s: futures[s].result(timeout=30)[0] for s in (0, 1, 4, 5)}
        assert outcomes == {0: False, 1: False, 4: False, 5: False}
        assert int(ms.store.add("votes/0/1", 0)) % ABORT_WEIGHT == 2  # node 1 never voted
        for s in servers:
            s.close()
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)


def test_abort_after_the_node_voted_learns_the_outcome(store: str, sockdir: str) -> None:
    """A rank that aborts after every node voted (its optimizer step failed after its vote)
    learns the outcome that stands, COMMIT, like a late abort in commit.py."""
    servers, clients = _job(store, sockdir, nodes=2)
    futures = _vote_all(clients, 1)
    assert all(f.result(timeout=30)[0] for f in futures.values())
    assert clients[0].abort(0, 1, 0, sorted(clients)) is True
    for s in servers:
        s.close()


def test_node_dying_after_its_vote_leaves_the_commit(store: str, sockdir: str) -> None:
    """Node 1's server casts its node's vote and is SIGKILLed while it waits for node 0's:
    when node 0's last rank votes, the count is complete and nodes 0 and 2 commit; node 1's
    ranks raise :class:`NodeVoteLost` (they do not apply the step): no rank sees ABORT while
    another sees COMMIT."""
    ms = MembershipStore.connect(store)
    members = {s: 0 for s in range(3 * RANKS)}
    ms.publish(Generation(number=0, replicas=(), members=members))
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_serve_node, args=(f"{sockdir}/n1", store, 1, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(120), "node 1's server did not start"
        servers = [
            NodeVoteServer(f"{sockdir}/n{n}", store, node=n, poll_interval_s=0.005) for n in (0, 2)
        ]
        clients = {s: NodeVoteClient(f"{sockdir}/n{node_of(s)}", node_of) for s in members}
        futures = _vote_all(clients, 1, skip=(1,))  # slot 1 (node 0) is slow
        deadline = time.monotonic() + 30
        while int(ms.store.add("votes/0/1", 0)) < 2:  # nodes 1 and 2 have cast
            assert time.monotonic() < deadline, "nodes 1 and 2 did not cast"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        for s in (2, 3):
            with pytest.raises(NodeVoteLost):
                futures[s].result(timeout=30)
        futures[1] = clients[1].start(0, 1, 1, sorted(members))
        outcomes = {s: futures[s].result(timeout=30)[0] for s in (0, 1, 4, 5)}
        assert outcomes == {0: True, 1: True, 4: True, 5: True}
        for s in servers:
            s.close()
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
