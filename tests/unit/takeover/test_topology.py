"""Failure units: ReplicaTopology against megatron-core's RankGenerator, in both rank orders."""

from __future__ import annotations

import itertools

import pytest


# ----------------------------------------------------------------------------- topology
def _reference_rank(order: str, tp: int, cp: int, pp: int, dp: int, c) -> int:
    """Megatron's layout: the first axis of the order varies fastest (ep = 1)."""
    if order == "tp-cp-ep-dp-pp":
        return c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp))
    return c.tp + tp * (c.cp + cp * (c.pp + pp * c.dp))


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
@pytest.mark.parametrize(
    "tp,cp,pp,dp", [(2, 1, 2, 2), (2, 1, 2, 4), (1, 2, 1, 2), (2, 2, 2, 2), (1, 1, 1, 3)]
)
def test_topology_matches_megatron_core(order: str, tp: int, cp: int, pp: int, dp: int) -> None:
    from megatron.core.parallel_state import RankGenerator

    from megatron_mecefo.takeover.topology import ReplicaTopology

    topo = ReplicaTopology.build(tp=tp, cp=cp, pp=pp, dp=dp, order=order)
    world = tp * cp * pp * dp
    assert topo.world_size == world
    for rank, c in enumerate(topo.coordinates):
        assert _reference_rank(order, tp, cp, pp, dp, c) == rank, (rank, c)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    for axis, size in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp)):
        groups = gen.get_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(range(world))
        for group in groups:
            assert [getattr(topo.coordinates[r], axis) for r in group] == list(range(size))
            others = {
                tuple(
                    getattr(topo.coordinates[r], a) for a in ("tp", "cp", "pp", "dp") if a != axis
                )
                for r in group
            }
            assert len(others) == 1, (axis, group)
        if axis == "dp":
            for replica in range(dp):
                assert topo.ranks_of_replica(replica) == sorted(g[replica] for g in groups)
    # ranks_of_replica partitions the world; replica_of agrees.
    parts = [topo.ranks_of_replica(r) for r in range(dp)]
    assert sorted(itertools.chain(*parts)) == list(range(world))
    assert all(len(p) == tp * cp * pp for p in parts)
    assert all(topo.replica_of(rank) == r for r, p in enumerate(parts) for rank in p)
    # peer_in_replica keeps tp/cp/pp and moves to the asked replica.
    for rank in range(world):
        c = topo.coordinates[rank]
        assert topo.peer_in_replica(rank, c.dp) == rank
        for replica in range(dp):
            peer = topo.coordinates[topo.peer_in_replica(rank, replica)]
            assert (peer.tp, peer.cp, peer.pp, peer.dp) == (c.tp, c.cp, c.pp, replica)
    with pytest.raises(ValueError):
        topo.ranks_of_replica(dp)


def test_topology_known_groups() -> None:
    from megatron_mecefo.takeover.topology import ReplicaTopology

    topo = ReplicaTopology.build(tp=2, cp=1, pp=2, dp=4, order="tp-cp-ep-dp-pp")
    dp_groups = [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    for group in dp_groups:
        assert [topo.replica_of(r) for r in group] == [0, 1, 2, 3]
    assert topo.ranks_of_replica(0) == [0, 1, 8, 9]
    assert topo.ranks_of_replica(3) == [6, 7, 14, 15]
    assert topo.peer_in_replica(9, 2) == 13
    topo = ReplicaTopology.build(tp=2, cp=1, pp=2, dp=4, order="tp-cp-ep-pp-dp")
    assert topo.ranks_of_replica(1) == [4, 5, 6, 7]
    assert topo.peer_in_replica(2, 3) == 14
    topo = ReplicaTopology.build(tp=1, cp=2, pp=1, dp=2)
    assert topo.ranks_of_replica(0) == [0, 1] and topo.peer_in_replica(1, 1) == 3
    with pytest.raises(ValueError, match="rank order"):
        ReplicaTopology.build(tp=1, cp=1, pp=1, dp=2, order="dp-tp")
    with pytest.raises(ValueError, match="dp size"):
        ReplicaTopology.build(tp=1, cp=1, pp=1, dp=0)
