"""The node vote's supervisor/rank wiring (:mod:`megatron_mecefo.recovery.node_vote_host`),
over a real in-process TCPStore: off by default; with ``MECEFO_NODE_VOTE=1`` each node's
server gathers its ranks' votes and the store counts nodes."""

from __future__ import annotations

import pytest

from megatron_mecefo.recovery import node_vote_host
from megatron_mecefo.recovery.commit import AsyncVoter
from megatron_mecefo.recovery.membership import Generation, MembershipStore
from megatron_mecefo.recovery.node_vote import NodeVoteClient

NPROC = 2


def test_off_by_default(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(node_vote_host.SWITCH, raising=False)
    monkeypatch.delenv(node_vote_host.SOCKET_ENV, raising=False)
    assert node_vote_host.host(store, 0, 0.005) is None
    assert node_vote_host.rank_env(None, NPROC) == {}
    assert isinstance(node_vote_host.voter(store, 0.005, 5.0), AsyncVoter)


def test_default_follows_the_store_mode_and_node_count() -> None:
    """On by default in multi-node etcd mode only; the variable overrides either way."""
    etcd = "etcd://127.0.0.1:2379/mecefo/j?ttl=8"
    assert node_vote_host.enabled({}, etcd, nnodes=2)
    assert not node_vote_host.enabled({}, etcd, nnodes=1)
    assert not node_vote_host.enabled({}, "127.0.0.1:29500", nnodes=4)
    assert not node_vote_host.enabled({node_vote_host.SWITCH: "0"}, etcd, nnodes=2)
    assert node_vote_host.enabled({node_vote_host.SWITCH: "1"}, "127.0.0.1:29500", nnodes=1)


def test_switched_on_the_store_counts_nodes(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes of two ranks: every rank commits, through its node's server, and the vote
    counter holds 2 (nodes), not 4 (ranks)."""
    monkeypatch.setenv(node_vote_host.SWITCH, "1")
    ms = MembershipStore.connect(store)
    members = {s: 0 for s in range(2 * NPROC)}
    ms.publish(Generation(number=0, replicas=(), members=members))
    servers = [node_vote_host.host(store, node, 0.005) for node in (0, 1)]
    try:
        voters = {}
        for slot in members:
            env = node_vote_host.rank_env(servers[slot // NPROC], NPROC)
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            voters[slot] = node_vote_host.voter(store, 0.005, 5.0)
            assert isinstance(voters[slot], NodeVoteClient)
        futures = [v.start(0, 1, s, sorted(members)) for s, v in voters.items()]
        assert all(f.result(timeout=30)[0] for f in futures)
        assert int(ms.store.add("votes/0/1", 0)) == 2
        assert [s.casts for s in servers] == [1, 1]
    finally:
        for s in servers:
            s.close()
