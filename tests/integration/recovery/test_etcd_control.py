"""The etcd control plane (recovery/etcd_control.py) against a real 3-member etcd.

Real etcd processes and real signals: candidates in their own processes (tests/workers/
etcd_candidate.py) SIGSTOPped or SIGKILLed, etcd members SIGKILLed. Time bounds are generous
(3 TTLs + 5 s), so that a machine load of 15 does not break them; what they catch is a hang.
Each module's cluster is its own (free ports, its own directory), stopped by PID.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
from conftest import WORKERS, child_env
from etcd_cluster import EtcdCluster, running_cluster

from megatron_mecefo.recovery.etcd_control import (
    ControlPlaneLost,
    EtcdControl,
    Fenced,
    GenerationConflict,
    NotElected,
)

TTL = 3
BOUND = 3 * TTL + 5  # the most any call may take when etcd has no quorum (a hang fails it)


class Candidate:
    """``tests/workers/etcd_candidate.py`` in its own process; its stdout read by a thread."""

    def __init__(self, endpoints: List[str], prefix: str, me: str) -> None:
        self.id = me
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKERS / "etcd_candidate.py"), ",".join(endpoints), prefix]
            + [str(TTL), me],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        self._events: List[Dict[str, Any]] = []  # every event, none dropped
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self._events.append(json.loads(line))
                self._cond.notify_all()

    def poll(self, event: str) -> Optional[Dict[str, Any]]:
        """Take the first received, not yet taken ``event``; None if there is none."""
        with self._cond:
            for i, e in enumerate(self._events):
                if e["event"] == event:
                    return self._events.pop(i)
        return None

    def next(self, event: str, timeout: float) -> Dict[str, Any]:
        """Take the first ``event``, waiting up to ``timeout`` for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                e = self.poll(event)
                if e is not None:
                    return e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"candidate {self.id}: no '{event}' within {timeout} s")
                self._cond.wait(left)

    def command(self, timeout: float = 30, **cmd: Any) -> Dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.next("result", timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """A private 3-member etcd for this module's tests that kill no member."""
    yield from running_cluster(tmp_path_factory.mktemp("etcd"))


@pytest.fixture
def etcd_fresh(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A private 3-member etcd for one test that kills members."""
    yield from running_cluster(tmp_path / "etcd")


@pytest.fixture
def candidates() -> Iterator[List["Candidate"]]:
    started: List[Candidate] = []
    yield started
    for c in started:
        c.stop()


def _control(etcd: EtcdCluster, prefix: str, ttl: float = TTL, **kw: Any) -> EtcdControl:
    return EtcdControl(etcd.endpoints, prefix, ttl, **kw)


def _elected(cands: List[Candidate], timeout: float) -> Candidate:
    """The one candidate that reports its election within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in cands:
            e = c.poll("elected")
            if e is not None:
                c.term = e["term"]  # type: ignore[attr-defined]
                return c
        time.sleep(0.05)
    raise AssertionError(f"no candidate elected within {timeout} s")


def test_two_candidates_one_wins(etcd: EtcdCluster) -> None:
    a, b = _control(etcd, "/two"), _control(etcd, "/two")
    results: Dict[str, Any] = {}
    start = threading.Barrier(2)

    def run(ctl: EtcdControl, me: str) -> None:
        start.wait()
        try:
            results[me] = ctl.campaign(me, timeout_s=2.0)
        except NotElected as e:
            results[me] = e

    try:
        threads = [threading.Thread(target=run, args=(c, n)) for c, n in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND)
        won = [n for n, r in results.items() if not isinstance(r, Exception)]
        lost = [n for n, r in results.items() if isinstance(r, NotElected)]
        assert len(won) == 1 and len(lost) == 1, results
        assert "\n" not in str(results[lost[0]]) and won[0] in str(results[lost[0]])
        leader = a.leader()
        assert leader == (won[0], results[won[0]].number)
    finally:
        a.close()
        b.close()


def test_hung_leader_is_replaced_and_fenced(etcd: EtcdCluster, candidates: List[Candidate]) -> None:
    """The leader SIGSTOPped: its lease expires after the TTL, another candidate wins a higher
    term; after SIGCONT the old leader learns it lost, and its fenced write fails, changing
    nothing."""
    old = Candidate(etcd.endpoints, "/hung", "old")
    candidates.append(old)
    term_old = old.next("elected", 60)["term"]
    assert old.command(cmd="publish", n=0, text="gen 0 by old")["ok"]
    new = _control(etcd, "/hung")
    try:
        # While the leader lives (its keepalive runs), nobody else is elected.
        with pytest.raises(NotElected, match=f"old \\(term {term_old}\\) leads"):
            new.campaign("new", timeout_s=TTL + 1.0)
        old.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        term_new = new.campaign("new", timeout_s=BOUND)
        assert time.monotonic() - t0 < BOUND
        assert term_new.number > term_old
        new.publish_generation(1, "gen 1 by new")

        old.signal(signal.SIGCONT)
        res = old.command(cmd="publish", n=2, text="gen 2 by old")
        assert not res["ok"] and res["error"] == "Fenced", res
        assert "\n" not in res["message"] and f"term {term_old} is over" in res["message"]
        res = old.command(cmd="put", name="progress", value="999")
        assert not res["ok"] and res["error"] == "Fenced", res
        assert "lease" in old.next("lost", BOUND)["why"]
        # Nothing the old leader wrote after its term landed.
        assert new.generation() == 1
        assert new.generation_info(2) is None
        assert new.generation_info(1) == "gen 1 by new"
        assert new.conn.get(new.key("progress"))[0] is None
        assert new.leader() == ("new", term_new.number)
        assert not new.lost.is_set()
    finally:
        new.close()


def test_end_term_of_revokes_only_the_publishing_term(etcd: EtcdCluster) -> None:
    """A follower that knows the leader dead (its store refuses connections) ends its term at
    once: the next campaign wins well within the lease TTL (30 s: an expiry cannot explain
    it), and the old leader's writes are fenced. A stale value, or a value written before the
    current term, ends nothing: a newer leader is never deposed."""
    ttl = 30
    a, b = _control(etcd, "/end", ttl), _control(etcd, "/end", ttl)
    try:
        term_a = a.campaign("a", timeout_s=5.0)
        a.put_fenced("hot_store", "h:1")
        assert b.end_term_of("hot_store", "h:2", "{}") is None  # not what the leader wrote
        assert a.leader() == ("a", term_a.number)
        ended = b.end_term_of("hot_store", "h:1", '{"by": "b"}')
        assert ended is not None and (ended.candidate, ended.number) == ("a", term_a.number)
        t0 = time.monotonic()
        term_b = b.campaign("b", timeout_s=ttl / 2)
        assert time.monotonic() - t0 < ttl / 2 and term_b.number > term_a.number
        with pytest.raises(Fenced, match=f"term {term_a.number} is over"):
            a.put_fenced("progress", "999")
        # hot_store still names a's store, written before b's term: b's term stands.
        assert b.end_term_of("hot_store", "h:1", "{}") is None
        assert a.leader() == ("b", term_b.number)
        assert b.conn.get(b.key("ended"))[0].value == b'{"by": "b"}'
    finally:
        a.close()
        b.close()


def test_generations_cannot_roll_back(etcd: EtcdCluster) -> None:
    ctl = _control(etcd, "/gens")
    try:
        ctl.campaign("leader", timeout_s=10)
        with pytest.raises(GenerationConflict, match="current generation is none, not 0"):
            ctl.publish_generation(1, "skips 0")
        for n in range(3):
            ctl.publish_generation(n, f"g{n}")
        with pytest.raises(GenerationConflict, match="current generation is 2, not 0"):
            ctl.publish_generation(1, "an older one")
        with pytest.raises(GenerationConflict, match="current generation is 2, not 3"):
            ctl.publish_generation(4, "skips 3")
        with pytest.raises(GenerationConflict):
            ctl.publish_generation(2, "g2, other contents")
        assert ctl.generation() == 2
        assert [ctl.generation_info(n) for n in range(5)] == ["g0", "g1", "g2", None, None]
    finally:
        ctl.close()


def test_watch_generation_after(etcd: EtcdCluster) -> None:
    leader, member = _control(etcd, "/watch"), _control(etcd, "/watch")
    try:
        leader.campaign("leader", timeout_s=10)
        leader.publish_generation(0, "g0")
        t0 = time.monotonic()
        assert member.watch_generation_after(0, timeout_s=1.0) is None
        assert 1.0 <= time.monotonic() - t0 < BOUND
        threading.Timer(0.5, leader.publish_generation, args=(1, "g1")).start()
        t0 = time.monotonic()
        assert member.watch_generation_after(0, timeout_s=BOUND) == 1
        assert time.monotonic() - t0 < BOUND
        assert member.watch_generation_after(0, timeout_s=0.1) == 1  # already above: at once
    finally:
        leader.close()
        member.close()


def test_claim_outcome_first_claim_stands(etcd: EtcdCluster) -> None:
    ctls = [_control(etcd, "/claims") for _ in range(4)]
    got: Dict[int, str] = {}
    start = threading.Barrier(len(ctls))

    def claim(i: int) -> None:
        start.wait()
        got[i] = ctls[i].claim_outcome(3, 17, "commit" if i % 2 else "abort")

    try:
        threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(ctls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND)
        assert len(got) == len(ctls) and len(set(got.values())) == 1, got
        assert ctls[0].claim_outcome(3, 17, "other") == got[0]  # late claims read it too
        assert ctls[0].claim_outcome(3, 18, "abort") == "abort"  # another step: its own
        # Deaths, incarnations and the fatal message: the first write stands as well.
        assert ctls[1].report_dead(2, 1, {"by": 1}) and not ctls[2].report_dead(2, 1, {"by": 2})
        assert ctls[3].deaths() == {(2, 1): {"by": 1}}
        assert [ctls[i % 2].next_incarnation(5) for i in range(3)] == [1, 2, 3]
        assert ctls[2].set_fatal("first") == "first" and ctls[3].set_fatal("second") == "first"
    finally:
        for c in ctls:
            c.close()


def test_one_member_killed_writes_keep_working(etcd_fresh: EtcdCluster) -> None:
    # The leader's keepalive must bridge the raft election that the kill causes (about 1-2 s,
    # more under load) within its own TTL: a longer TTL than the other tests'.
    ctl = _control(etcd_fresh, "/one", ttl=2 * TTL)
    try:
        term = ctl.campaign("leader", timeout_s=10)
        ctl.publish_generation(0, "g0")
        # The member this client talks to, when it is the raft leader the worst case (an
        # election first): kill the raft leader, and point the client at it.
        victim = etcd_fresh.leader()
        ctl.conn._current = victim
        etcd_fresh.signal(victim, signal.SIGKILL)
        t0 = time.monotonic()
        ctl.publish_generation(1, "g1")
        assert time.monotonic() - t0 < BOUND
        assert ctl.claim_outcome(1, 1, "commit") == "commit"
        time.sleep(2 * TTL)  # several keepalives through the survivors
        assert not ctl.lost.is_set(), ctl.lost_reason
        assert ctl.leader() == ("leader", term.number)
        ctl.publish_generation(2, "g2")
        assert ctl.generation() == 2
    finally:
        ctl.close()


def test_quorum_lost_raises_within_bound(etcd_fresh: EtcdCluster) -> None:
    lost: "queue.Queue[str]" = queue.Queue()
    ctl = _control(etcd_fresh, "/quorum", on_lost=lost.put)
    other = _control(etcd_fresh, "/quorum")
    try:
        ctl.campaign("leader", timeout_s=10)
        ctl.publish_generation(0, "g0")
        for m in (0, 1):
            etcd_fresh.signal(m, signal.SIGKILL)
        t_kill = time.monotonic()
        calls = {
            "publish": lambda: ctl.publish_generation(1, "g1"),
            "generation": ctl.generation,
            "claim": lambda: other.claim_outcome(0, 1, "abort"),
            "campaign": lambda: other.campaign("other", timeout_s=BOUND),
            "watch": lambda: other.watch_generation_after(0, timeout_s=BOUND),
        }
        for name, call in calls.items():
            t0 = time.monotonic()
            with pytest.raises(ControlPlaneLost) as info:
                call()
            took = time.monotonic() - t0
            assert took < BOUND, (name, took)
            message = str(info.value)
            assert "\n" not in message and message.startswith("etcd control plane lost"), message
        # The leader's keepalive found no member for a TTL: it declares the leadership lost.
        why = lost.get(timeout=max(0.1, BOUND - (time.monotonic() - t_kill)))
        assert "unreachable" in why and ctl.lost.is_set()
    finally:
        ctl.close()
        other.close()


def test_leader_lost_twice(etcd: EtcdCluster, candidates: List[Candidate]) -> None:
    """Three candidates: the leader SIGKILLed, then the next one SIGSTOPped; the third is
    elected, each term above the last; the stopped one, resumed, is fenced."""
    for name in ("c0", "c1", "c2"):
        candidates.append(Candidate(etcd.endpoints, "/twice", name))
    first = _elected(candidates, 90)
    first.command(cmd="publish", n=0, text=f"g0 by {first.id}")
    first.signal(signal.SIGKILL)
    rest = [c for c in candidates if c is not first]
    second = _elected(rest, BOUND + 30)  # + the candidates' start-up under load
    assert second.term > first.term  # type: ignore[attr-defined]
    assert second.command(cmd="publish", n=1, text=f"g1 by {second.id}")["ok"]
    second.signal(signal.SIGSTOP)
    third = _elected([c for c in rest if c is not second], BOUND)
    assert third.term > second.term  # type: ignore[attr-defined]
    assert third.command(cmd="publish", n=2, text=f"g2 by {third.id}")["ok"]
    second.signal(signal.SIGCONT)
    res = second.command(cmd="publish", n=3, text=f"g3 by {second.id}")
    assert not res["ok"] and res["error"] == "Fenced", res
    reader = _control(etcd, "/twice")
    try:
        assert reader.generation() == 2
        assert reader.generation_info(2) == f"g2 by {third.id}"
        assert reader.leader() == (third.id, third.term)  # type: ignore[attr-defined]
    finally:
        reader.close()
