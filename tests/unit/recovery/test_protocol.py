"""The recovery protocol without training: config checks, kill specs, layout, coordinator
decisions and the commit vote, on a real in-process TCPStore."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Tuple

import pytest

from megatron_mecefo.recovery.abort import GenerationWatchdog, WorldAborter
from megatron_mecefo.recovery.commit import ABORT_WEIGHT, AsyncVoter, abort, vote
from megatron_mecefo.recovery.config import RecoveryConfig, RecoveryConfigError
from megatron_mecefo.recovery.coordinator import Coordinator
from megatron_mecefo.recovery.fault_injection import KillSpecError, parse_kills
from megatron_mecefo.recovery.membership import (
    CompleteReplicas,
    Generation,
    JobLayout,
    MembershipStore,
)
from megatron_mecefo.recovery.membership_schedule import MembershipSchedule
from megatron_mecefo.recovery.replacement import build_replacement
from megatron_mecefo.takeover.failure_schedule import FailureSchedule


def test_timeout_hierarchy_is_checked_at_startup() -> None:
    RecoveryConfig().validate()
    with pytest.raises(RecoveryConfigError, match="--heartbeat-timeout=40.0 must be below "
                       "--collective-timeout=30.0"):  # fmt: skip
        RecoveryConfig(heartbeat_timeout_s=40.0).validate()
    with pytest.raises(RecoveryConfigError, match="--collective-timeout=90.0 must be below"):
        RecoveryConfig(collective_timeout_s=90.0).validate()
    with pytest.raises(RecoveryConfigError, match="--replace=sometimes"):
        RecoveryConfig(replace="sometimes").validate()


def test_replacement_policies() -> None:
    assert build_replacement("never").delay_s(3) is None
    assert build_replacement("immediately").delay_s(3) == 0.0
    assert build_replacement("after:2.5").delay_s(3) == 2.5
    with pytest.raises(RecoveryConfigError):
        build_replacement("after:soon")


def test_kill_specs_are_checked_and_seeded() -> None:
    (k,) = parse_kills(["3:5:grad-sync"], 4, 10, seed=1)
    assert (k.rank, k.iteration, k.phase) == (3, 5, "grad-sync")
    drawn = parse_kills(["?:?:?"] * 3, 8, 50, seed=7)
    assert drawn == parse_kills(["?:?:?"] * 3, 8, 50, seed=7)  # every rank draws the same
    assert drawn != parse_kills(["?:?:?"] * 3, 8, 50, seed=8)
    for bad, match in [
        ("4:5:forward", "rank 4 does not exist"),
        ("1:99:forward", "outside"),
        ("1:5:sideways", "PHASE must be"),
        ("1:5", "RANK:ITERATION:PHASE"),
    ]:
        with pytest.raises(KillSpecError, match=match):  # fmt: skip
            parse_kills([bad], 4, 10, seed=1)


def test_layout_matches_megatron_rank_order() -> None:
    layout = JobLayout(tp=2, pp=2, dp=2)  # order tp-cp-ep-dp-pp
    assert layout.replica_slots(0) == [0, 1, 4, 5]
    assert layout.replica_slots(1) == [2, 3, 6, 7]
    assert layout.coords(6) == (0, 1, 1)
    # Replica 1 alone: its ranks renumbered as a TP2 x PP2 x DP1 world.
    assert [layout.rank_in(s, [1]) for s in layout.replica_slots(1)] == [0, 1, 2, 3]
    replicas, spares = CompleteReplicas().assign(layout, [0, 1, 2, 4, 5, 7])
    assert replicas == [0] and spares == [2, 7]


def test_membership_schedule_opens_and_closes_events() -> None:
    sched = MembershipSchedule(FailureSchedule([], 4))
    sched.apply_generation([0, 2, 3], 5)
    assert sched.failed_at(4) == frozenset() and sched.failed_at(9) == {1}
    sched.apply_generation([0, 1, 2, 3], 12)
    assert sched.failed_at(11) == {1} and sched.failed_at(12) == frozenset()


@contextlib.contextmanager
def _coordinating(
    store: str, dp: int, join_at_boundary_only: bool = False
) -> Iterator[Tuple[MembershipStore, RecoveryConfig]]:
    """A running coordinator over a DP-``dp`` job whose ranks (incarnation 0) are all ready."""
    cfg = RecoveryConfig(store=store, poll_interval_s=0.005, heartbeat_interval_s=0.2,
                         heartbeat_timeout_s=1.0)  # fmt: skip
    ms = MembershipStore.connect(store)
    coord = Coordinator(MembershipStore.connect(store), dp, cfg, log=lambda line: None,
                        join_at_boundary_only=join_at_boundary_only)  # fmt: skip
    coord.start()
    try:
        ms.set_json("layout", {"tp": 1, "pp": 1, "dp": dp})
        for s in range(dp):
            ms.store.set(f"inc/{s}", "0")
            ms.mark_ready(s, 0, {})
        yield ms, cfg
    finally:
        coord.stop()


def test_coordinator_failure_rejoin_and_abort(store: str) -> None:
    with _coordinating(store, 4) as (ms, cfg):
        ms.report_dead(1, 0, {"exit_code": -9, "t": time.time()})
        gen = _wait_gen(ms, 1)
        assert gen.replicas == (0, 2, 3) and gen.lost == (1,) and gen.at_iteration is None
        assert gen.rank_of(3) == 2
        ms.store.set("progress", "7")
        ms.store.set("inc/1", "1")
        ms.mark_ready(1, 1, {})
        gen = _wait_gen(ms, 2)
        assert gen.joined == (1,) and gen.at_iteration == 7 + cfg.join_margin_iterations
        assert gen.members == {0: 0, 1: 1, 2: 0, 3: 0}
        for s in (0, 1, 2, 3):
            ms.report_dead(s, gen.members[s], {"exit_code": -9, "t": time.time()})
        gen = _wait_gen(ms, 3)
        assert gen.replicas == () and "every data-parallel replica" in gen.abort


def test_replacement_up_before_the_failure_generation_joins_it(store: str) -> None:
    """A dead rank's replacement that is ready before the coordinator publishes the failure
    joins that generation at once: it is listed as joined (a new incarnation of a slot that
    was a member), so its record reports the rejoin."""
    with _coordinating(store, 2) as (ms, _):
        ms.store.set("inc/1", "1")
        ms.mark_ready(1, 1, {})
        ms.report_dead(1, 0, {"exit_code": -9, "t": time.time()})
        gen = _wait_gen(ms, 1)
        assert gen.lost == (1,) and gen.at_iteration is None
        assert gen.members == {0: 0, 1: 1} and gen.joined == (1,)


def test_under_the_distributed_optimizer_a_replacement_joins_only_at_a_boundary(
    store: str,
) -> None:
    """``join_at_boundary_only`` (the supervisor sets it for --use-distributed-optimizer): a
    replacement ready before the failure is published stays out of the failure's world (its
    survivors rebuild the lost shards from parity, a collective it cannot join), and the
    rejoin waits until that world has committed an iteration past the one it was made at."""
    with _coordinating(store, 2, join_at_boundary_only=True) as (ms, cfg):
        ms.store.set("progress", "4")
        ms.store.set("inc/1", "1")
        ms.mark_ready(1, 1, {})
        ms.report_dead(1, 0, {"exit_code": -9, "t": time.time()})
        gen = _wait_gen(ms, 1)
        assert gen.members == {0: 0} and gen.joined == () and gen.lost == (1,)
        time.sleep(0.3)  # the failure's world has not committed: no rejoin yet
        assert ms.generation_number() == 1
        ms.store.set("progress", "5")
        gen = _wait_gen(ms, 2)
        assert gen.joined == (1,) and gen.at_iteration == 5 + cfg.join_margin_iterations


def _wait_gen(ms: MembershipStore, number: int) -> Generation:
    deadline = time.time() + 10
    while ms.generation_number() < number:
        assert time.time() < deadline, f"no generation {number}"
        time.sleep(0.01)
    return ms.generation(number)


def test_coordinator_kills_silent_rank(store: str) -> None:
    """A rank whose heartbeat stops (SIGSTOP) gets a kill request for its supervisor."""
    cfg = RecoveryConfig(store=store, poll_interval_s=0.005, heartbeat_interval_s=0.1,
                         heartbeat_timeout_s=0.5)  # fmt: skip
    ms = MembershipStore.connect(store)
    coord = Coordinator(MembershipStore.connect(store), 2, cfg, log=lambda line: None)
    coord.start()
    try:
        ms.set_json("layout", {"tp": 1, "pp": 1, "dp": 2})
        for s in range(2):
            ms.mark_ready(s, 0, {})
        deadline = time.time() + 10
        while ms.get_str("kill/1/0") is None:
            ms.heartbeat(0, 0)  # rank 0 beats, rank 1 is silent
            assert time.time() < deadline
            time.sleep(0.05)
        assert ms.get_str("kill/0/0") is None
    finally:
        coord.stop()


def test_commit_vote_is_all_or_nothing(store: str) -> None:
    """Members that all vote commit; if a member never votes and a failure generation is
    published, every voter aborts, and late voters adopt the same decision."""
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={0: 0, 1: 0, 2: 0}))
    results = {}

    def member(slot: int, iteration: int) -> None:
        results[(slot, iteration)] = vote(MembershipStore.connect(store), 0, iteration, slot,
                                          [0, 1, 2], 0.005)  # fmt: skip

    threads = [threading.Thread(target=member, args=(s, 1)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [results[(s, 1)] for s in range(3)] == [True, True, True]
    # Iteration 2: rank 2 dies before voting.
    threads = [threading.Thread(target=member, args=(s, 2)) for s in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    ms.publish(Generation(number=1, replicas=(), members={0: 0, 1: 0}, lost=(2,)))
    for t in threads:
        t.join(10)
    assert results[(0, 2)] is False and results[(1, 2)] is False
    # A planned generation (switch after this iteration) does not abort the vote.
    ms.publish(Generation(number=2, replicas=(), members={0: 0, 1: 0}, at_iteration=9))
    assert vote(ms, 1, 3, 0, [0], 0.005) is True
    # The member that completes the count knows it (its vote never waited for a peer).
    first, last = {}, {}
    t = threading.Thread(target=lambda: vote(ms_first, 2, 4, 0, [0, 1], 0.005, first))
    ms_first = MembershipStore.connect(store)
    t.start()
    time.sleep(0.1)
    assert vote(ms, 2, 4, 1, [0, 1], 0.005, last) is True
    t.join(10)
    assert first == {"last": False} and last == {"last": True}


def test_vote_counter_orders_votes_and_aborts(store: str) -> None:
    """The counter decides: COMMIT exactly when the last vote precedes the first abort, and
    every later vote or abort, in any order, finds that same outcome."""
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={0: 0, 1: 0}))
    # Iteration 1: both vote, then a member aborts (its step failed after its vote counted).
    t = threading.Thread(
        target=lambda: vote(MembershipStore.connect(store), 0, 1, 0, [0, 1], 0.005)
    )
    t.start()
    assert vote(ms, 0, 1, 1, [0, 1], 0.005) is True
    t.join(10)
    assert abort(ms, 0, 1, 2) is True and abort(ms, 0, 1, 2) is True  # both find the commit
    assert ms.store.get("decision/0/1") == b"commit"
    # Iteration 2: one vote, then an abort, then the last vote (too late), then another abort
    # that finds every vote in and reads the first abort's decision.
    waiting = AsyncVoter(store, 0.02).start(0, 2, 0, [0, 1])
    time.sleep(0.1)
    assert abort(ms, 0, 2, 2) is False
    assert waiting.result(10)[0] is False
    assert vote(ms, 0, 2, 1, [0, 1], 0.005) is False  # its add finds the abort
    assert abort(ms, 0, 2, 2) is False
    # Iteration 3: an abort before any vote; a later abort with votes still missing.
    assert abort(ms, 0, 3, 2) is False and abort(ms, 0, 3, 2) is False
    assert vote(ms, 0, 3, 0, [0, 1], 0.005) is False
    # Iteration 4: the last voter dies between its count and its commit key; the waiting
    # member reads the complete count at its next look and commits, as would any abort.
    waiting = AsyncVoter(store, 0.02).start(0, 4, 0, [0, 1])
    time.sleep(0.1)
    assert ms.store.add("votes/0/4", 1) == 2  # the vote, without the commit key
    assert waiting.result(10)[0] is True
    assert ms.store.check(["commit/0/4"])  # a committer makes it durable before applying it
    assert abort(ms, 0, 4, 2) is True


def test_a_later_abort_is_bounded_when_the_first_aborter_died(store: str) -> None:
    """The first aborter dies between its ``add`` and its ``set`` (no decision key), then the
    last votes arrive: a reader finds every vote and an abort, neither key, and aborts after
    ``decision_wait_s``, not after the store client's timeout (60 s here) with an error."""
    ms = MembershipStore.connect(store)  # a 60 s client timeout
    ms.publish(Generation(number=0, replicas=(), members={0: 0, 1: 0}))
    ms.store.add("votes/0/1", ABORT_WEIGHT)  # the first abort's add; it died before its set
    assert ms.store.add("votes/0/1", 1) == ABORT_WEIGHT + 1
    t0 = time.perf_counter()
    assert vote(ms, 0, 1, 1, [0, 1], 0.005, decision_wait_s=0.3) is False
    assert abort(ms, 0, 1, 2, decision_wait_s=0.3) is False
    assert 0.6 <= time.perf_counter() - t0 < 5
    # Votes complete, then an abort: a reader finds the commit key at once, whatever the wait.
    assert vote(ms, 0, 2, 0, [0], 0.005) is True
    ms.store.add("votes/0/2", ABORT_WEIGHT)
    t0 = time.perf_counter()
    assert abort(ms, 0, 2, 1, decision_wait_s=30) is True
    assert time.perf_counter() - t0 < 1


def test_committed_iterations_leave_no_vote_keys(store: str) -> None:
    """The member that completes the count of iteration i deletes iteration i - 1's keys:
    after 6 iterations only the last one's (and none of the earlier) are in the store."""
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={0: 0, 1: 0}))
    voters = [AsyncVoter(store, 0.02), AsyncVoter(store, 0.02)]
    for iteration in range(1, 7):
        futures = [v.start(0, iteration, slot, [0, 1]) for slot, v in enumerate(voters)]
        assert [f.result(10)[0] for f in futures] == [True, True]
    # The deletion follows the result on the voter thread, one key after the other: wait for
    # both keys of iteration 5 (waiting for the first alone raced the second's deletion).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        ms.store.check([f"{kind}/0/5"]) for kind in ("votes", "commit")
    ):
        time.sleep(0.01)
    left = [f"{kind}/0/{i}" for i in range(1, 7) for kind in ("votes", "commit")
            if ms.store.check([f"{kind}/0/{i}"])]  # fmt: skip
    assert left == ["votes/0/6", "commit/0/6"], left


def test_async_vote_overlaps_and_a_member_that_fails_aborts_everyone(store: str) -> None:
    """The worker-thread vote decides like :func:`vote` while the caller keeps computing, and
    leaves the store client's timeout as it was (its waits are longer than the vote's); a
    member whose optimizer step failed before the count completed aborts, which the waiting
    peer finds at its next look at the counter (``10 * poll``, not after its ``50 * poll``
    look for a newer generation), and which stands against a late vote."""
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={0: 0, 1: 0}))
    # poll 0.2 s: the counter looks are 2 s apart, the generation looks 10 s, far enough apart
    # for a bound between them that load does not break.
    voters = [AsyncVoter(store, 0.2), AsyncVoter(store, 0.2)]
    futures = [v.start(0, 1, slot, [0, 1]) for slot, v in enumerate(voters)]
    spins = 0
    while not all(f.done() for f in futures):  # the caller is not blocked meanwhile
        spins += 1
    results = [f.result(10) for f in futures]
    assert [r[0] for r in results] == [True, True] and spins > 0
    assert sorted(r[1] for r in results) == [False, True]  # exactly one completed the count
    # Iteration 2: member 0 votes, member 1's step fails first (it never votes): it aborts.
    waiting = voters[0].start(0, 2, 0, [0, 1])
    time.sleep(0.1)
    assert not waiting.done()
    t0 = time.perf_counter()
    assert abort(ms, 0, 2, 2) is False
    assert waiting.result(30)[0] is False
    assert time.perf_counter() - t0 < 6  # found at a 2 s look, not at its 10 s one
    assert voters[1].start(0, 2, 1, [0, 1]).result(30)[0] is False  # the late vote adopts it
    # Its short waits pass their timeout per call: the client keeps its own (60 s), so a
    # blocking wait longer than them (a key set 0.5 s later) still succeeds on it.
    later = threading.Timer(0.5, lambda: MembershipStore.connect(store).store.set("later", "1"))
    later.daemon = True  # a failed wait must not leave the test process waiting for it
    later.start()
    try:
        voters[0]._ms.store.wait(["later"])
    finally:
        later.cancel()
        later.join(10)
    assert voters[0].cpu_s > 0


def test_unformed_failure_generations_are_found(store: str) -> None:
    """A failure generation superseded before its world formed is owed a record; one that
    formed, or that already has its record, ends the scan."""
    ms = MembershipStore.connect(store)
    layout = {"tp": 1, "pp": 1, "dp": 4}
    four = {s: 0 for s in range(4)}
    gens = [
        Generation(1, (0, 2, 3), {0: 0, 2: 0, 3: 0}, lost=(1,), layout=layout),  # formed
        Generation(2, (0, 3), {0: 0, 3: 0}, lost=(2,), layout=layout),  # superseded
        Generation(3, (0,), {0: 0}, lost=(3,), layout=layout),  # superseded
        Generation(4, (0, 1, 2, 3), four, joined=(1, 2, 3), at_iteration=9, layout=layout),
    ]
    for gen in gens:
        ms.publish(gen)
    for s in (0, 2, 3):
        ms.store.set(f"arrive/1/{s}", "1")
    ms.store.set("arrive/2/0", "1")  # slot 3 never arrived: generation 2 never formed
    assert [g.number for g in ms.unformed_failures(4)] == [2, 3]
    ms.store.set("record/3", "{}")
    assert ms.unformed_failures(4) == []
    assert [g.number for g in ms.unformed_failures(3)] == [2]
    # A collective-error generation that lost nobody (the death was not known yet) is a step
    # towards the next generation, not a failure of its own.
    ms.publish(Generation(5, (0, 2, 3), {0: 0, 2: 0, 3: 0}, layout=layout))
    ms.publish(Generation(6, (0, 2), {0: 0, 2: 0}, lost=(3,), layout=layout))
    ms.store.set("record/4", "{}")
    assert ms.unformed_failures(6) == []
    # Generation 1 formed: nothing below 2 is owed.
    assert ms.unformed_failures(2) == []


def test_watchdog_wakes_on_the_generation_key(store: str) -> None:
    """The watchdog sleeps in a store wait: a failure generation fires the abort at once
    (its 30 s wait interval would miss the 2 s deadline if it polled), a planned one does
    not, and ``latest`` follows both."""
    fired: list = []

    class Recorder(WorldAborter):
        def abort(self) -> None:
            fired.append(time.time())

    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=3, replicas=(0, 1), members={0: 0, 1: 0}))
    watch = MembershipStore.connect(store)
    dog = GenerationWatchdog(watch.generation_number, 3, Recorder(), 30.0,
                             is_failure=lambda n: watch.generation(n).at_iteration is None,
                             wait_after=watch.wait_generation_after).start()  # fmt: skip
    try:
        time.sleep(0.2)
        ms.publish(Generation(number=4, replicas=(0, 1), members={0: 0, 1: 0}, at_iteration=9))
        deadline = time.time() + 2
        while dog.latest != 4:
            assert time.time() < deadline, "the planned generation was not seen"
            time.sleep(0.01)
        assert fired == []
        t0 = time.time()
        ms.publish(Generation(number=5, replicas=(0,), members={0: 0}, lost=(1,)))
        while not fired:
            assert time.time() < t0 + 2, "the failure generation did not fire the abort"
            time.sleep(0.01)
        assert dog.fired == 5 and dog.latest == 5
    finally:
        dog.stop()
        ms.publish(Generation(number=6, replicas=(0,), members={0: 0}))  # wake its last wait
        dog.thread.join(5)
    assert not dog.thread.is_alive() and dog.fired == 5


def test_watchdog_fires_on_a_failure_hidden_behind_a_rejoin(store: str) -> None:
    """A failure generation and a rejoin right after it, both published before the watchdog
    looks: the latest generation is the planned one, and the failure still ends the world
    (before, the watchdog read only the latest, and a member waited out the store timeout)."""
    fired: list = []

    class Recorder(WorldAborter):
        def abort(self) -> None:
            fired.append(time.time())

    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=3, replicas=(0, 1, 2), members={0: 0, 1: 0, 2: 0}))
    ms.publish(Generation(number=4, replicas=(0, 1), members={0: 0, 1: 0}, lost=(2,)))
    ms.publish(Generation(number=5, replicas=(0, 1, 2), members={0: 0, 1: 0, 2: 1}, at_iteration=9))
    watch = MembershipStore.connect(store)
    dog = GenerationWatchdog(watch.generation_number, 3, Recorder(), 30.0,
                             is_failure=lambda n: watch.generation(n).at_iteration is None,
                             wait_after=watch.wait_generation_after).start()  # fmt: skip
    try:
        deadline = time.time() + 5
        while not fired:
            assert time.time() < deadline, "the failure behind the rejoin did not fire"
            time.sleep(0.01)
        assert dog.fired == 5 and dog.latest == 5
    finally:
        dog.stop()
