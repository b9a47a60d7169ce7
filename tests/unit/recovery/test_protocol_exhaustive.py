"""The recovery control plane checked exhaustively (issue 43 item 6): every interleaving,
crash point and hang of a 2-3 member job, over in-memory stores (``tests/helpers/
protocol_check.py``; what is real code and what is a model is in its docstring and in
``docs/protocol-check.md``).

* The old primary/standby mirror (the removed ``--store-mode replicated``, now a model in
  ``protocol_check.py`` only) must fail: the checker finds
  the generation rollback on the standby, and a replay of one schedule follows it to a
  takeover that publishes a different generation with the number ranks already use.
* The etcd design must hold every invariant in every reachable state; and each of its rules
  (fencing, the member's fence, not deciding a vote in doubt) is shown to matter: without it
  the checker finds a violation. The commit vote runs on the leader's hot TCPStore (no etcd
  request per iteration); a member whose vote the store's loss cut off does not apply the
  step, and the takeover's regroup settles it.
"""

from __future__ import annotations

from typing import List, Sequence

import pytest
from fake_etcd import Compare, FakeEtcd, Get, LeaseNotFound, Put, Range
from protocol_check import EtcdDesign, MirrorDesign, explore


def _replay(design: MirrorDesign, schedule: Sequence[str]) -> List[List[str]]:
    """Take the steps of ``schedule`` in order (each must be enabled); the invariants each
    step violates."""
    state = design.initial()
    found = []
    for label in schedule:
        steps = {lab: nxt for lab, nxt, _ in design.successors(state)}
        assert label in steps, f"not enabled: {label!r}; enabled: {sorted(steps)}"
        found.append(design.violations(state, steps[label]))
        state = steps[label]
    return found


# ---------------------------------------------------------------------------------- the store
def test_fake_etcd_has_the_semantics_the_protocol_relies_on() -> None:
    etcd = FakeEtcd()
    assert etcd.revision == 1
    lease = etcd.grant(5.0)
    # Create-if-absent: a compare on create_revision == 0 holds for a missing key only.
    absent = Compare("leader", "create", "==", 0)
    first = etcd.txn([absent], [Put("leader", "a", lease)], [Get("leader")])
    assert first.succeeded and first.revision == 2
    second = etcd.txn([absent], [Put("leader", "b")], [Get("leader")])
    assert not second.succeeded and second.responses[0].value == "a"
    assert second.revision == 2  # a transaction that writes nothing keeps the revision
    # A compare on the value of a missing key is false, whatever the operand.
    assert not etcd.txn([Compare("nope", "value", "!=", "x")]).succeeded
    assert etcd.txn([Compare("nope", "version", "==", 0)]).succeeded
    # One revision per transaction; version counts puts; create_revision stays.
    r = etcd.txn([], [Put("gen", "0"), Put("other", "x")])
    assert (etcd.get("gen").mod_revision, etcd.get("other").mod_revision) == (r.revision,) * 2
    etcd.put("gen", "1")
    gen = etcd.get("gen")
    assert (gen.version, gen.create_revision, gen.mod_revision) == (2, r.revision, r.revision + 1)
    stale = Compare("gen", "mod", "==", r.revision)
    assert not etcd.txn([stale], [Put("gen", "rolled back")]).succeeded
    assert etcd.get("gen").value == "1"
    # A lease's end deletes its keys (one revision); a put on an ended lease changes nothing.
    before = etcd.revision
    etcd.expire(lease)
    assert etcd.get("leader") is None and etcd.revision == before + 1
    with pytest.raises(LeaseNotFound):
        etcd.txn([], [Put("x", "1"), Put("leader", "a", lease)])
    assert etcd.get("x") is None and etcd.revision == before + 1
    assert not etcd.keepalive(lease)
    # The clock: a lease not renewed for its TTL ends.
    short = etcd.grant(2.0)
    etcd.put("member/0", "up", short)
    etcd.advance(1.5)
    assert etcd.keepalive(short)
    etcd.advance(1.5)
    assert etcd.get("member/0") is not None
    etcd.advance(0.6)
    assert etcd.range("member/") == ()
    # copy/freeze: equal contents, equal values; a copy is independent.
    twin = etcd.copy()
    assert twin.freeze() == etcd.freeze() and FakeEtcd.thaw(etcd.freeze()) == etcd
    twin.put("y", "1")
    assert twin.freeze() != etcd.freeze()
    assert [kv.key for kv in etcd.txn([], [Range("g")]).responses[0]] == ["gen"]


# ---------------------------------------------------------------------------------- the old mirror
def test_old_mirror_rolls_a_generation_back() -> None:
    """The exhaustive search of the mirror stops at its first violation: the standby's copy
    thread writes back a generation it read before the coordinator published the next one
    there (standby first)."""
    report = explore(MirrorDesign())
    report.show()
    assert report.violation == "generations_only_increase"
    trace = report.trace
    read = trace.index("standby copy thread: reads gen = 0 on the primary")
    publish = trace.index("coordinator on node 0: sets gen = 1 on the standby")
    assert read < publish and trace[-1] == "standby copy thread: writes gen = 0 on the standby"


ROLLBACK_CHAIN = [
    "standby copy thread: reads gen = 0 on the primary",
    "standby copy thread: reads the deaths and generations on the primary",
    "member 2: crashes",
    "rank 2 is reported dead on P",
    "coordinator on node 0: decides generation 1 [0, 1]",
    "coordinator on node 0: writes gen/1 on the standby",
    "coordinator on node 0: writes gen/1 on its store",
    "coordinator on node 0: sets gen = 1 on the standby",
    "standby copy thread: writes gen = 0 on the standby",  # the rollback
    "coordinator on node 0: sets gen = 1 on its store",
    "member 0: watchdog: generation 1; leaves the world",
    "member 1: watchdog: generation 1; leaves the world",
    "member 0: reads generation 1",
    "member 1: reads generation 1",
    "member 0: arrives in generation 1",
    "member 1: arrives in generation 1",
    "member 0: world 1 formed; healed to iteration 0",
    "member 1: world 1 formed; healed to iteration 0",
    "member 0: all-reduce of iteration 1 done",
    "member 1: all-reduce of iteration 1 done",
    "member 1: votes (1 of 2)",
    "node 0: crashes",
    "standby copy thread: writes the deaths and generations on the standby",
    "standby copy thread: the primary's socket closed: takes over",
    "standby copy thread: takeover: reads gen = 0 on the standby",
    "standby copy thread: takeover: declares node 0's rank dead",
    "standby copy thread: takeover: sets primary (generation 0); starts a coordinator",
    "coordinator on node 1: starts from generation 0",
    "coordinator on node 1: decides generation 1 [1, 2]",
    "coordinator on node 1: no standby",
    "coordinator on node 1: writes gen/1 on its store",  # a second generation 1
    "member 1: fails over to the standby",
    "member 1: generation 1 is above the takeover's 0: votes again",
    "member 1: votes (1 of 2)",
]


def test_old_mirror_rollback_leads_to_a_second_generation_with_the_same_number() -> None:
    """The rollback followed to its end (one schedule of the checker's steps, replayed): the
    takeover starts from the rolled-back generation 0 and publishes another generation 1
    ({1, 2}: rank 2's death was reported only to the lost primary), which ranks in the first
    generation 1 ({0, 1}) already run; the vote worker then takes its cut-off vote of the old
    generation 1 for one of the new generation (``AsyncVoter._after_failover``: 1 > 0) and
    casts it again in the new ``votes/1/1`` counter."""
    found = _replay(MirrorDesign(kinds=("rank crash", "node crash")), ROLLBACK_CHAIN)
    first = [i for i, bad in enumerate(found) if bad]
    assert found[first[0]] == ["generations_only_increase"]
    assert ROLLBACK_CHAIN[first[0]] == "standby copy thread: writes gen = 0 on the standby"
    second = ROLLBACK_CHAIN.index("coordinator on node 1: writes gen/1 on its store")
    assert "one_leader_per_term" in found[second]
    assert not any("one_leader_per_term" in bad for bad in found[:second])
    print("\nthe rollback chain (old mirror), violations per step:")
    for i, (step, bad) in enumerate(zip(ROLLBACK_CHAIN, found, strict=True), 1):
        print(f"  {i:2d}. {step}" + (f"   <- {', '.join(bad)}" if bad else ""))


# ---------------------------------------------------------------------------------- the etcd design
@pytest.mark.parametrize(
    "config",
    [
        dict(n_members=2, faults=1, iterations=2),
        dict(n_members=3, faults=1, iterations=1),
        pytest.param(dict(n_members=2, faults=2, iterations=1), marks=pytest.mark.slow),
        pytest.param(dict(n_members=3, faults=1, iterations=2), marks=pytest.mark.slow),
    ],
    ids=[
        "2-members-1-fault-2-iterations",  # 33,904 states, 3 s here
        "3-members-1-fault",  # 156,230 states, 16 s
        "2-members-2-faults",  # 612,208 states, 52 s
        "3-members-1-fault-2-iterations",  # 631,580 states, 78 s
    ],
)
def test_etcd_design_holds_every_invariant_in_every_state(config: dict) -> None:
    report = explore(EtcdDesign(**config))
    report.show()
    assert report.violation is None, report.trace
    assert report.complete
    assert report.states > 10_000  # the whole space, not a stub's handful of states


def test_etcd_design_without_fencing_lets_a_deposed_leader_write() -> None:
    """The leader's writes conditioned on its leader key are what stops a coordinator that
    hung past its lease: without them, its generation lands after a new leader took over."""
    report = explore(EtcdDesign(n_members=2, faults=2, fencing=False))
    report.show()
    assert report.violation == "one_leader_per_term"
    assert any("hangs" in step for step in report.trace)


def test_etcd_design_deciding_a_vote_in_doubt_splits_it() -> None:
    """The hot store decides a commit without etcd, so a member cut off by the store's loss
    must not decide: claiming ABORT on etcd (first claim stands) while a peer committed on the
    lost store before it died splits the vote. Not deciding, and letting the regroup's heal
    settle it, is what the design does (the test above)."""
    report = explore(EtcdDesign(n_members=2, faults=1, doubt_decides=True))
    report.show()
    assert report.violation == "agreement"
    assert any("in doubt, claims abort" in step for step in report.trace)
    assert any("sets the commit key" in step for step in report.trace)


@pytest.mark.slow
def test_etcd_design_three_members_two_faults() -> None:
    """A bounded check: the first 5 million states, breadth first (every schedule up to the
    depth they reach), hold every invariant; 800 s here. The whole space with the hot store
    is larger than that (1.1 million states before the hot store was modelled). Its first
    run found a model gap (a resumed deposed leader idled for ever: 'progress')."""
    report = explore(EtcdDesign(n_members=3, faults=2), max_states=5_000_000)
    report.show()
    assert report.violation is None, report.trace
    assert report.states >= 5_000_000 or report.complete


def test_etcd_design_without_member_fencing_lets_a_dead_member_act() -> None:
    """A member's requests conditioned on its own lease are what make a member that comes
    back after it was declared dead (SIGCONT, a healed partition) change nothing."""
    report = explore(EtcdDesign(n_members=3, faults=1, member_fencing=False))
    report.show()
    assert report.violation == "fenced_changes_nothing"
    assert any("resumes" in step for step in report.trace)
