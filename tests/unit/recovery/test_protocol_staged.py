"""The staged model check (issue 54 item 9, finding M2): a model of the control plane as the
code has it (``StagedDesign`` in ``tests/helpers/protocol_check.py``): pipeline stages with
the real heal per data-parallel group, the group and node votes, members without leases, the
takeover's publish in the code's steps, calls to a hung store that never return, the
ECONNREFUSED revoke. What it models and what it leaves out is in ``docs/protocol-check.md``.

* A model of today's code must fail: a split vote ends in ``ShardLost`` under PP (C1), and a
  hung group head (or a hung supervisor) wedges the members that wait on it (H1).
* The issue 54 design as the code has it (a prepared step resolved by the next world with
  ``prepared.resolve``; outcomes claimed on etcd, ``commit.claim``; every vote wait with a
  deadline; the sockets of a dead or hung owner's stores shut) holds in every state, and each
  part of it is shown to matter. Without the claims it fails ``agreement``: a node that
  applied the step is outside the next world after a takeover that lost the count.
"""

from __future__ import annotations

from typing import List, Sequence

import pytest
from protocol_check import StagedDesign, explore

OLD = dict(prepared=False, deadlines=False)
NEW = dict(prepared=True, deadlines=True, claims=True)
UNCLAIMED = dict(prepared=True, deadlines=True, claims=False)
"""The design before the outcome claims: the evidence of a commit was on the hot store alone."""


def _replay(design: StagedDesign, schedule: Sequence[str]):
    """Take the steps of ``schedule`` in order (each must be enabled); the last state and the
    invariants each step violated."""
    state = design.initial()
    found: List[List[str]] = []
    for label in schedule:
        steps = {lab: nxt for lab, nxt, _ in design.successors(state)}
        assert label in steps, f"not enabled: {label!r}; enabled: {sorted(steps)}"
        found.append(design.violations(state, steps[label]))
        state = steps[label]
    return state, found


# ---------------------------------------------------------------------------------- today's code
def test_old_code_split_vote_ends_in_shard_lost() -> None:
    """C1, found by the search: a group head dies after its group's vote was counted on the
    hot store; its group is in doubt while the other group commits, and the heal then needs a
    source at the committed iteration in every data-parallel group: the stage of the group in
    doubt has none. (``grace_holds``: a member does not write ``doubt`` while its live head
    still decides, as ``doubt_grace_s`` makes likely in the code.)"""
    report = explore(StagedDesign(kinds=("node crash",), grace_holds=True, **OLD))
    report.show()
    assert report.violation == "shard_lost"
    crash = next(step for step in report.trace if "crashes" in step)
    assert crash in ("node 0: crashes", "node 2: crashes")  # a group head
    counted = report.trace.index(f"head {crash[5]}: collector: votes on the hot store (1 of 2)")
    assert counted < report.trace.index(crash)
    assert report.trace[-1] == "world 1 formed: ShardLost"


def test_old_code_split_vote_by_a_superseded_doubt() -> None:
    """Without the grace's timing, the shortest C1 needs no head to die: a member whose vote
    is superseded (a peer died) writes ``doubt`` for its group before its live head decides,
    and the head's vote on the hot store then completes the other group's commit."""
    report = explore(StagedDesign(kinds=("node crash",), **OLD))
    report.show()
    assert report.violation == "shard_lost"
    assert any("writes doubt for its group" in step for step in report.trace)


def c1_chain(new: bool) -> List[str]:
    """The issue's C1: group 1's head (node 2) dies after its group's vote was counted on the
    hot store; group 0 completes the count and commits."""
    return [
        "world 0: all-reduce of iteration 1 done; every rank votes",
        "node 2: adds its vote on head 2's store (1 of 2)",
        "node 3: adds its vote on head 2's store (2 of 2)",
        "head 2: collector: its group's 2 votes are in",
        "head 2: collector: votes on the hot store (1 of 2)",
        "node 0: adds its vote on head 0's store (1 of 2)",
        "node 1: adds its vote on head 0's store (2 of 2)",
        "head 0: collector: its group's 2 votes are in",
        *(
            [
                "head 0: collector: votes on the hot store (2 of 2)",
                "head 0: collector: claims commit on etcd",
                "head 0: collector: sets the commit key; its check finds it; group outcome commit",
            ]
            if new
            else ["head 0: collector: votes on the hot store (2 of 2); sets the commit key; "
                  "group outcome commit"]  # fmt: skip
        ),
        "node 0: its group's outcome: commit",
        "node 1: its group's outcome: commit",
        "node 2: crashes",
        "node 3: head 2's store is lost: in doubt",
        "coordinator 0: declares node 2 dead (its connections closed)",
        "coordinator 0: publishes generation 1 [1, 3]",
        "rank 0: generation 1: not a member",
        "rank 1: generation 1: arrives",
        "rank 3: generation 1: arrives",
    ]


def test_old_code_c1_as_reported() -> None:
    """The issue's reproduction, replayed step by step on the model of today's code."""
    chain = c1_chain(new=False) + ["world 1 formed: ShardLost"]
    state, found = _replay(StagedDesign(**OLD), chain)
    assert found[-1] == ["shard_lost"] and not any(found[:-1])
    assert "data-parallel group [1]" in state.end  # stage 1: node 3 alone, at iteration 0


def test_old_code_hung_head_wedges_its_group() -> None:
    """H1, found by the search: a SIGSTOPped group head is declared dead (its heartbeats
    stop) and a newer generation is published, but only the hot store's sockets are shut: a
    member's call to the head's TCPStore never returns."""
    report = explore(StagedDesign(kinds=("node hang",), **OLD))
    report.show()
    assert report.violation == "wedged"
    assert any("publishes generation 1" in step for step in report.trace)


def test_old_code_hung_supervisor_wedges() -> None:
    """H1 with every fault kind: the shortest trace is a hung supervisor (its ranks beat on,
    so nobody is declared dead) that heads a group or serves its rank's node vote."""
    report = explore(StagedDesign(**OLD))
    report.show()
    assert report.violation == "wedged"
    assert "supervisor hangs" in report.trace[0]


def test_old_code_node_vote_split_by_a_takeover() -> None:
    """C1's narrower window in the per-node vote (groups of 4: one level): the node that
    completes the count applies the step; the leader's death takes the hot store, so a node
    of the other stage whose wait was cut off by the takeover is in doubt, and its stage has
    no source at the committed iteration."""
    report = explore(StagedDesign(group_size=4, kinds=("node crash",), **OLD))
    report.show()
    assert report.violation == "shard_lost"
    assert any("StoreFailedOver: the vote is in doubt" in step for step in report.trace)
    assert any("publishes hot_store" in step for step in report.trace)


def test_old_code_hung_supervisor_in_node_vote_mode_wedges_its_rank() -> None:
    """H1's other form: a SIGSTOPped follower supervisor in node-vote mode; its rank waits on
    the vote's future for ever, and the others on the count."""
    report = explore(StagedDesign(group_size=4, kinds=("supervisor hang",), **OLD))
    report.show()
    assert report.violation == "wedged"
    assert "supervisor hangs" in report.trace[0]
    assert "supervisor hung/await" in report.detail  # its rank never gets an answer


# ---------------------------------------------------------------------------------- the new design
def test_unclaimed_an_applier_that_died_with_the_leader_splits_the_outcome() -> None:
    """Why outcomes are claimed on etcd: without the claims, ``agreement`` fails (node
    crashes only; 31,107 states, the shortest trace, 23 steps):

    1-11. both groups vote; head 0's collector completes the count on the hot store (node 0,
        the leader), sets the commit key and its check finds it; node 0 applies the step.
    12. node 0 crashes. 13-17. node 1 revokes its lease, wins the election and takes over:
        its hot store is restored from etcd, with no vote counter.
    18. generation 1 = [1, 3]. 19. node 1: head 0's store is lost: in doubt (counted 2).
    21. node 3: superseded: writes doubt for its group (head 2's collector still waits on the
        lost hot store). 23. world 1 formed: nobody in [1, 3] applied iteration 1, and the
        resolver's abort on the new store's (empty) counter finds 0 of 2 votes: abort.

    Node 0 applied iteration 1 of generation 0; nodes 1 and 3 drop it: the evidence (the
    count, the commit key) was on the lost hot store. With the claims, node 0's commit stands
    on etcd before it applies, and world 1's resolver finds it there."""
    report = explore(StagedDesign(kinds=("node crash",), **UNCLAIMED))
    report.show()
    assert report.violation == "agreement"
    assert "node 0: its group's outcome: commit" in report.trace
    assert "node 0: crashes" in report.trace
    assert "resolved abort" in report.trace[-1]


def test_unclaimed_an_applier_left_out_as_a_spare_splits_the_outcome() -> None:
    """Without the claims, ``agreement`` fails in the per-node vote too (groups of 4, node
    crashes only; 18 steps): node 2's vote completes the count on node 0's hot store and it
    applies the step. Node 0 (the leader) crashes; node 1 takes over (a restored store: no
    counter) and publishes generation 1 = [1, 3]: node 2 is alive but a spare (one complete
    replica). Nodes 1 and 3 are cut off by the takeover (in doubt); world 1's resolution
    finds no member that applied it and aborts it. Node 2, alive, holds the step."""
    report = explore(StagedDesign(group_size=4, kinds=("node crash",), **UNCLAIMED))
    report.show()
    assert report.violation == "agreement"
    assert "coordinator 1: publishes generation 1 [1, 3]" in report.trace  # node 2 left out
    assert "resolved abort" in report.trace[-1]


def test_new_design_an_applier_that_died_with_the_leader_is_committed_by_the_next_world() -> None:
    """The first trace above on the code's design: node 0 claimed the commit on etcd before
    it applied; world 1's resolver finds the claim and nodes 1 and 3 apply their kept steps."""
    report = explore(StagedDesign(kinds=("node crash",), **NEW))
    report.show()
    assert report.violation is None, report.trace
    assert report.complete


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(dict(iterations=1), marks=pytest.mark.slow),  # 35-55 s; make test-all
        pytest.param(dict(iterations=2), marks=pytest.mark.slow),
    ],
    ids=["PP2xDP2-1-iteration-1-fault", "PP2xDP2-2-iterations-1-fault"],
)
def test_new_design_holds_every_invariant_in_every_state(config: dict) -> None:
    report = explore(StagedDesign(**config, **NEW))
    report.show()
    assert report.violation is None, report.trace
    assert report.complete
    assert report.states > 100_000


def test_new_design_holds_with_the_per_node_vote() -> None:
    report = explore(StagedDesign(group_size=4, **NEW))
    report.show()
    assert report.violation is None, report.trace
    assert report.complete and report.states > 10_000


@pytest.mark.slow
def test_new_design_two_faults_bounded() -> None:
    """A bounded check with 2 faults: the first 3 million states, breadth first, hold every
    invariant (the whole space is larger)."""
    report = explore(StagedDesign(faults=2, **NEW), max_states=3_000_000)
    report.show()
    assert report.violation is None, report.trace
    assert report.states >= 3_000_000 or report.complete


def test_new_design_c1_chain_ends_at_the_same_iteration() -> None:
    """The C1 schedule on the new design: node 3 kept its step prepared; world 1's resolution
    finds the commit claimed on etcd (node 1 applied it too), so node 3 applies it, and stage 1
    heals from itself."""
    chain = c1_chain(new=True) + [
        "world 1 formed: (0, 1) resolved commit (commit claimed on etcd); healed to iteration 1",
        "the job ends: every member finished",
    ]
    state, found = _replay(StagedDesign(**NEW), chain)
    assert not any(found)
    assert state.end == "done" and state.ends == (1, 1)


def test_new_design_without_deadlines_still_wedges() -> None:
    report = explore(StagedDesign(prepared=True, deadlines=False))
    report.show()
    assert report.violation == "wedged"


def test_new_design_without_prepared_steps_still_loses_a_shard() -> None:
    report = explore(StagedDesign(prepared=False, deadlines=True, kinds=("node crash",)))
    report.show()
    assert report.violation == "shard_lost"
