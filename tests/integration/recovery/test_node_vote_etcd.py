"""The node-level vote with its outcome claimed on a real 3-member etcd
(:class:`megatron_mecefo.recovery.node_vote.EtcdClaimedMembership`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from etcd_cluster import EtcdCluster, running_cluster

from megatron_mecefo.recovery.etcd_control import EtcdControl
from megatron_mecefo.recovery.membership import Generation, MembershipStore
from megatron_mecefo.recovery.node_vote import (
    EtcdClaimedMembership,
    NodeVoteClient,
    NodeVoteServer,
)
from megatron_mecefo.recovery.store_forwarding import tcp_client


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    yield from running_cluster(tmp_path / "etcd")


def test_commit_claims_the_outcome_on_etcd_and_a_prior_abort_claim_wins(
    store: str, etcd: EtcdCluster
) -> None:
    """Two nodes of one rank: iteration 1 commits and etcd holds ``commit`` for it; for
    iteration 2 an ``abort`` was claimed on etcd first (a resolver after a failover), so the
    node whose vote completes the count finds it and every rank aborts."""
    ctl = EtcdControl(etcd.endpoints, "/test/nodevote", ttl_s=5)
    MembershipStore.connect(store).publish(Generation(number=0, replicas=(), members={0: 0, 1: 0}))
    with tempfile.TemporaryDirectory(prefix="nv") as d:
        servers = [
            NodeVoteServer(
                f"{d}/n{n}", store, node=n, poll_interval_s=0.005, gather_timeout_s=30,
                membership=lambda: EtcdClaimedMembership(tcp_client(store, 60), ctl, store),
            )  # fmt: skip
            for n in (0, 1)
        ]
        clients = [NodeVoteClient(f"{d}/n{s}", lambda slot: slot) for s in (0, 1)]
        try:
            futures = [c.start(0, 1, s, [0, 1]) for s, c in enumerate(clients)]
            assert [f.result(timeout=60)[0] for f in futures] == [True, True]
            assert ctl.claim_outcome(0, 1, "abort") == "commit"
            assert ctl.claim_outcome(0, 2, "abort") == "abort"
            futures = [c.start(0, 2, s, [0, 1]) for s, c in enumerate(clients)]
            # The completing node's claim lost: no commit key; a failure generation ends it.
            MembershipStore.connect(store).publish(
                Generation(number=1, replicas=(), members={0: 0, 1: 0})
            )
            assert [f.result(timeout=60)[0] for f in futures] == [False, False]
        finally:
            for s in servers:
                s.close()
            ctl.close()
