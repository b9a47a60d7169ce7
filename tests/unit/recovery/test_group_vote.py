"""The two-level commit vote (:mod:`megatron_mecefo.recovery.group_vote`): nodes as
:class:`GroupVote` objects driven from threads, each with its own real TCPStore group server,
over a real in-process hot TCPStore; one test drives it end to end through the node vote's
servers and rank clients. A head's death is its group store stopped mid-vote."""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Sequence

import pytest
from daemon_threads import in_daemon_thread
from group_faults import die_after_hot_vote

from megatron_mecefo.recovery.commit import ABORT_WEIGHT
from megatron_mecefo.recovery.group_vote import (
    DOUBT,
    GroupStore,
    GroupVote,
    groups_of,
    two_level,
)
from megatron_mecefo.recovery.membership import Generation, MembershipStore
from megatron_mecefo.recovery.node_vote import NodeVoteClient, NodeVoteServer

# A store server looks up each client's name (::ffff:127.0.0.1 goes to DNS here): with the
# resolver's 5 s timeout a dropped query stalls a connect by 5 s (benchmarks/commit_at_scale.py).
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

G = 2  # nodes per group


class _Daemons:
    """Runs each call on a daemon thread: a vote that never ends (a failed test) must not
    hold up the test process's exit, as a pool's worker would."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return in_daemon_thread(fn, *args)


@pytest.fixture
def pool() -> _Daemons:
    return _Daemons()


def _job(store: str, nodes: int, **kw) -> List[GroupVote]:
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={n: 0 for n in range(nodes)}))
    connect = lambda: MembershipStore.connect(store)  # noqa: E731
    return [
        GroupVote(n, GroupStore("127.0.0.1"), connect(), connect, group_size=G,
                  poll_interval_s=0.005, decision_wait_s=5.0, **kw)
        for n in range(nodes)
    ]  # fmt: skip


def _vote(pool: _Daemons, gvs: Sequence[GroupVote], it: int, skip=()) -> Dict:
    nodes = list(range(len(gvs)))
    return {gv.node: pool.submit(gv.vote, 0, it, nodes) for gv in gvs if gv.node not in skip}


def _wait_counter(client, key: str, value: int) -> None:
    deadline = time.monotonic() + 30
    while int(client.add(key, 0)) % ABORT_WEIGHT < value:
        assert time.monotonic() < deadline, f"{key} never reached {value}"
        time.sleep(0.01)


def test_groups_follow_the_membership() -> None:
    """Groups by node index; the head is the group's first live node; one group: one level."""
    assert groups_of([5, 0, 1, 2, 3, 4], 2) == {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    assert groups_of([1, 3, 4, 5], 2) == {0: [1], 1: [3], 2: [4, 5]}  # nodes 0 and 2 died
    assert two_level(range(3), 2) and not two_level(range(2), 2) and not two_level(range(9), 0)


def test_every_node_commits_and_the_hot_store_counts_groups(store: str, pool: _Daemons) -> None:
    """Five nodes in groups of two (three groups), three iterations: every node commits, the
    hot store's counter counts groups (3), each head's counter its group's nodes, and only the
    heads cast on the hot store; exactly one head completes the hot count per iteration."""
    gvs = _job(store, 5)
    ms = MembershipStore.connect(store)
    for it in (1, 2, 3):
        results = {n: f.result(timeout=30) for n, f in _vote(pool, gvs, it).items()}
        assert all(ok for ok, _ in results.values()), results
        assert sum(last for _, last in results.values()) == 1
        assert int(ms.store.add(f"votes/0/{it}", 0)) == 3
        for head, size in ((0, 2), (2, 2), (4, 1)):
            client = gvs[head]._head_client(head)
            assert int(client.add(f"gv/0/{it}", 0)) == size
    assert [gv.collected for gv in gvs] == [3, 0, 3, 0, 3]
    # Forgotten as it goes: iteration 1's keys are gone from the heads' stores.
    assert not gvs[0]._head_client(0).check(["gv/0/1"])


def test_a_rejoined_head_is_found_in_the_next_generation(store: str, pool: _Daemons) -> None:
    """Group 1's head (node 2) dies between two votes and comes back with a new store (a new
    supervisor): in the next generation its member, whose cached client is of the dead store,
    finds the new one (looked up once per generation) and every node commits."""
    gvs = _job(store, 4)
    assert all(f.result(timeout=30)[0] for f in _vote(pool, gvs, 1).values())
    gvs[2].own.close()
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=1, replicas=(), members={n: 0 for n in range(4)}))
    connect = lambda: MembershipStore.connect(store)  # noqa: E731
    gvs[2] = GroupVote(2, GroupStore("127.0.0.1"), connect(), connect, group_size=G,
                       poll_interval_s=0.005, decision_wait_s=5.0)  # fmt: skip
    nodes = list(range(4))
    futures = {gv.node: pool.submit(gv.vote, 1, 2, nodes) for gv in gvs}
    assert all(f.result(timeout=30)[0] for f in futures.values())


def test_a_member_abort_aborts_every_group(store: str, pool: _Daemons) -> None:
    """Node 3 (a member of group 1) aborts while the others vote: every node of every group
    sees ABORT, and group 1's head aborted on the hot store (the other groups are woken)."""
    gvs = _job(store, 6)
    futures = _vote(pool, gvs, 1, skip=(3,))
    assert gvs[3].abort(0, 1, list(range(6))) is False
    assert {n: f.result(timeout=30)[0] for n, f in futures.items()} == dict.fromkeys(
        (0, 1, 2, 4, 5), False
    )
    ms = MembershipStore.connect(store)
    assert int(ms.store.add("votes/0/1", 0)) >= ABORT_WEIGHT


def test_head_dying_before_its_cast_leaves_its_group_in_doubt(store: str, pool: _Daemons) -> None:
    """Group 1's head (node 2) dies (its store stops) after its member voted and before it
    cast: node 3 is in doubt at once (no step applied); groups 0 and 2 cast and wait, and
    abort when the failure generation supersedes the vote. No node commits."""
    gvs = _job(store, 6)
    futures = _vote(pool, gvs, 1, skip=(2,))
    _wait_counter(gvs[3]._head_client(2), "gv/0/1", 1)
    gvs[2].own.close()
    assert futures[3].result(timeout=30) == (False, False)
    ms = MembershipStore.connect(store)
    _wait_counter(ms.store, "votes/0/1", 2)  # groups 0 and 2 cast
    time.sleep(0.3)
    assert not any(futures[n].done() for n in (0, 1, 4, 5))  # waiting: no outcome yet
    ms.publish(Generation(number=1, replicas=(), members={n: 0 for n in (0, 1, 3, 4, 5)}))
    outcomes = {n: futures[n].result(timeout=30)[0] for n in (0, 1, 4, 5)}
    assert outcomes == dict.fromkeys((0, 1, 4, 5), False)
    assert not ms.store.check(["commit/0/1"])


def test_head_dying_after_its_cast_never_splits(store: str, pool: _Daemons) -> None:
    """Group 1's head (node 2) casts its group's vote on the hot store, which completes the
    count, and dies before it tells its group: group 0 commits; node 3 is in doubt (it does
    not apply the step; the regroup heals it). No node of group 1 sees COMMIT while another
    node's outcome is ABORT."""
    gvs = _job(store, 4)
    die_after_hot_vote(gvs[2])  # the head's node dies between its hot vote and its group
    results = {n: f.result(timeout=30) for n, f in _vote(pool, gvs, 1).items()}
    assert results[0][0] and results[1][0]  # group 0: COMMIT
    assert not results[2][0] and not results[3][0]  # group 1: in doubt, nothing applied
    ms = MembershipStore.connect(store)
    assert ms.store.check(["commit/0/1"])  # the hot store's outcome: every group voted


def test_superseded_without_a_head_decision_is_doubt_for_the_whole_group(
    store: str, pool: _Daemons
) -> None:
    """Group 0's head (node 0) never votes (its ranks died before voting): node 1 waits; when
    a newer generation supersedes the vote, node 1 writes ``doubt`` after its grace, and the
    head's late abort finds it standing: the whole group is in doubt; group 1 aborts."""
    gvs = _job(store, 4, doubt_grace_s=0.3)
    futures = _vote(pool, gvs, 1, skip=(0,))
    ms = MembershipStore.connect(store)
    _wait_counter(ms.store, "votes/0/1", 1)  # group 1 cast
    ms.publish(Generation(number=1, replicas=(), members={n: 0 for n in range(4)}))
    assert {n: f.result(timeout=30)[0] for n, f in futures.items()} == dict.fromkeys(
        (1, 2, 3), False
    )
    assert gvs[0].abort(0, 1, list(range(4))) is False
    assert gvs[0]._head_client(0).get("go/0/1").decode() == DOUBT


def test_end_to_end_through_the_node_servers(store: str) -> None:
    """Three nodes of two ranks, node servers with ``group_size=2`` (two groups): every rank
    commits and the hot store counts 2 groups; then one rank aborts: every rank aborts."""
    ranks = 2
    node_of = lambda s: s // ranks  # noqa: E731
    ms = MembershipStore.connect(store)
    members = {s: 0 for s in range(3 * ranks)}
    ms.publish(Generation(number=0, replicas=(), members=members))
    with tempfile.TemporaryDirectory(prefix="gv") as d:
        servers = [
            NodeVoteServer(f"{d}/n{n}", store, node=n, poll_interval_s=0.005, group_size=G)
            for n in range(3)
        ]
        try:
            clients = {s: NodeVoteClient(f"{d}/n{node_of(s)}", node_of) for s in members}
            order = sorted(members)
            futures: Dict[int, Future] = {s: c.start(0, 1, s, order) for s, c in clients.items()}
            assert all(f.result(timeout=30)[0] for f in futures.values())
            assert int(ms.store.add("votes/0/1", 0)) == 2
            futures = {s: c.start(0, 2, s, order) for s, c in clients.items() if s != 3}
            assert clients[3].abort(0, 2, 3, order) is False
            assert not any(f.result(timeout=30)[0] for f in futures.values())
        finally:
            for s in servers:
                s.close()
