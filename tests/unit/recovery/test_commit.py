"""The commit vote (``recovery/commit.py``) on a real TCPStore: what ends a vote's wait."""

from __future__ import annotations

from megatron_mecefo.recovery.commit import _superseded, abort, vote
from megatron_mecefo.recovery.membership import Generation, MembershipStore


def _members(n: int) -> dict:
    return {slot: 0 for slot in range(n)}


def test_a_failure_generation_ends_the_vote_even_under_a_later_rejoin(store: str) -> None:
    """Generation 0 votes on iteration 14; a member dies before voting (failure generation 1),
    and a warm standby's rejoin is published at once as generation 2, switching at iteration
    16. The vote of 0/14 can never complete: it is superseded. Before, only the newest
    generation was read (a rejoin at 16 > 14: "not superseded"), so a node's vote waited on
    0/14 for ever and its next vote queued behind it (found by the Slurm test: every vote of
    the rejoin world hung for the 60 s deadline)."""
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(0, 1), members=_members(4)))
    assert not _superseded(ms, 0, 14)
    ms.publish(Generation(number=1, replicas=(0,), members=_members(3)))
    ms.publish(Generation(number=2, replicas=(0, 1), members=_members(4), at_iteration=16))
    assert _superseded(ms, 0, 14)  # by the failure generation 1
    assert not _superseded(ms, 1, 14)  # generation 1's own vote: the rejoin switches at 16
    assert _superseded(ms, 1, 16)
    # A waiter on 0/14 (3 of 4 votes in) finds it superseded and aborts: no commit.
    for _ in range(3):
        ms.store.add("votes/0/14", 1)
    assert vote(ms, 0, 14, 3, list(range(5)), poll_interval_s=0.002, decision_wait_s=0.1) is False
    assert abort(ms, 0, 14, 5, decision_wait_s=0.1) is False
