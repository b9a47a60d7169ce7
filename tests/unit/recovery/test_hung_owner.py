"""A hung owner of a store the vote waits on (issue 54, H1), with the classes and real stores.

A SIGSTOPped server keeps its sockets open and never answers, so a call to it never returns,
a client timeout or not. The pieces that end such waits, each on its own (the end-to-end
tests with real supervisors are ``tests/integration/recovery/test_hung_owner_jobs.py``):

* the coordinator declares the ranks of a node whose supervisor is silent for the heartbeat
  timeout dead, although they beat (their votes go through it);
* a group member's call to a SIGSTOPped head's store (a real process) is cut by its guard once
  a failure generation superseded the vote: the member is in doubt;
* a rank's wait for its vote ends in doubt once its world's watchdog saw a failure generation,
  and its abort through a SIGSTOPped node vote server (a real process) has a deadline.

Every process a test starts is continued and killed by its PID in ``finally``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Iterator, List

import pytest
from conftest import REPO, child_env
from coordinator_setup import coordinator_over
from daemon_threads import in_daemon_thread

from megatron_mecefo.recovery.group_vote import STORE_KEY, GroupVote
from megatron_mecefo.recovery.membership import Generation, MembershipStore
from megatron_mecefo.recovery.node_vote import NodeVoteClient, NodeVoteLost
from megatron_mecefo.recovery.step_hooks import DOUBT_GRACE_S, VoteInDoubt, await_vote
from megatron_mecefo.recovery.store_forwarding import tcp_client

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

MARGIN_S = 10.0
"""Generous: the bounds must hold at a load average of 15."""


class _Procs:
    """Processes started by a test, ended by PID (SIGCONT first: a stopped one too)."""

    def __init__(self) -> None:
        self.procs: List[subprocess.Popen] = []

    def start(self, code: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, env=child_env(),
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def end(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(proc.pid, sig)
                    except ProcessLookupError:
                        pass
            proc.wait(timeout=30)


@pytest.fixture
def procs() -> Iterator[_Procs]:
    started = _Procs()
    try:
        yield started
    finally:
        started.end()


def _in_thread(fn, *args) -> Future:
    return in_daemon_thread(fn, *args)


# ---------------------------------------------------------------------- the coordinator


def test_ranks_of_a_hung_supervisor_are_declared_dead(store: str) -> None:
    """Node 1's supervisor falls silent (SIGSTOP) while its ranks beat on: at the first check
    past one heartbeat timeout its ranks are declared dead (reason "supervisor hung") and
    asked killed; node 2's ranks, whose supervisor beats, are left alone. Before, nothing was
    declared, and the ranks waited for their supervisor's vote for ever. While the job stops
    (a signal), a silent supervisor is no failure."""
    timeout = 6.0
    ms, coord = coordinator_over(store, timeout, {2: "1@hung:11", 3: "1@hung:11", 4: "2@alive:12"})

    def beats() -> None:  # every rank beats; only node 2's supervisor does
        for slot in (2, 3, 4):
            ms.heartbeat(slot, 0)
        ms.supervisor_heartbeat("2@alive:12")

    t0 = time.monotonic()
    coord._check_heartbeats(t0)
    beats()
    coord._check_heartbeats(t0 + timeout - 0.5)
    assert ms.dead_info(2, 0) is None, "declared before the timeout"
    beats()
    ms.store.set("stopping", "SIGTERM")
    coord._check_heartbeats(t0 + timeout + 0.5)
    assert ms.dead_info(2, 0) is None, "a silent supervisor while the job stops is no failure"
    ms.store.delete_key("stopping")
    beats()
    coord._check_heartbeats(t0 + timeout + 1.0)
    for slot in (2, 3):
        info = ms.dead_info(slot, 0)
        assert info is not None, f"rank {slot} of a hung supervisor not declared dead"
        assert info["exit_code"] is None and info["reason"] == "supervisor hung", info
        assert ms.get_str(f"kill/{slot}/0") is not None  # the supervisor, if it wakes, kills
    assert ms.dead_info(4, 0) is None and ms.get_str("kill/4/0") is None


# ---------------------------------------------------------------------- a hung group head

_SERVE = """
from megatron_mecefo.recovery.store_forwarding import serve
import time
server = serve("127.0.0.1", 0)
print(server.port, flush=True)
time.sleep(600)
"""


def test_a_member_of_a_sigstopped_head_is_in_doubt_once_superseded(
    store: str, procs: _Procs
) -> None:
    """Nodes 0-3 in groups of two; node 2 heads group 1, its group store served by a real
    process. Node 3 votes (its add is counted) and waits for the outcome on the head's store;
    the head is SIGSTOPped mid-vote, then a failure generation (node 2 declared lost) is
    published. Node 3's guard shuts its sockets to the head's store: its vote ends in doubt
    (no step applied) within its slice, grace and a margin. Before, it stayed blocked."""
    head = procs.start(_SERVE)
    assert head.stdout is not None
    address = f"127.0.0.1:{int(head.stdout.readline())}"
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={n: 0 for n in range(4)}))
    ms.store.set(STORE_KEY.format(node=2), address)
    connect = lambda: MembershipStore.connect(store)  # noqa: E731
    member = GroupVote(3, None, connect(), connect, group_size=2, poll_interval_s=0.005,
                       decision_wait_s=5.0, doubt_grace_s=0.5)  # fmt: skip
    vote = _in_thread(member.vote, 0, 1, [0, 1, 2, 3])
    counted = tcp_client(address, 10.0)  # a client of the test's own
    deadline = time.monotonic() + 30
    while int(counted.add("gv/0/1", 0)) < 1:
        assert time.monotonic() < deadline, "the member's vote was never counted"
        time.sleep(0.01)
    os.kill(head.pid, signal.SIGSTOP)
    time.sleep(2.0)  # the member is in a wait slice that will never be answered
    assert not vote.done()
    t0 = time.monotonic()
    ms.publish(Generation(number=1, replicas=(), members={n: 0 for n in (0, 1, 3)}))
    bound = member.member_wait_s + 1.0 + member.doubt_grace_s + MARGIN_S
    assert vote.result(timeout=bound + 20) == (False, False)  # in doubt: nothing applied
    took = time.monotonic() - t0
    assert took < bound, took
    assert member.shut_heads == [2]
    member.close()


# ---------------------------------------------------------------------- a hung node vote

_NODE_SERVER = """
import sys, time
from megatron_mecefo.recovery.node_vote import NodeVoteServer
server = NodeVoteServer(sys.argv[1], sys.argv[2], node=0, poll_interval_s=0.005)
print("up", flush=True)
time.sleep(600)
"""


def test_a_rank_vote_wait_ends_in_doubt_under_a_sigstopped_supervisor(
    store: str, procs: _Procs
) -> None:
    """A node vote server in a real process (a supervisor's), SIGSTOPped; its rank votes and
    waits (the step hook's :func:`await_vote`). Its world's watchdog then sees a failure
    generation (the coordinator declared the node lost): the wait ends in doubt after the
    grace. The rank's abort through the stopped server ends at its deadline. Before, both
    waited for ever (``future.result()`` with no timeout)."""
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={0: 0, 1: 0}))
    with tempfile.TemporaryDirectory(prefix="nv") as d:
        path = f"{d}/node0"
        server = subprocess.Popen(
            [sys.executable, "-c", _NODE_SERVER, path, store], cwd=REPO, env=child_env(),
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs.procs.append(server)
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        client = NodeVoteClient(path, lambda slot: slot)
        os.kill(server.pid, signal.SIGSTOP)
        session = SimpleNamespace(watchdog=SimpleNamespace(fired=None), decision_wait_s=5.0)
        future = client.start(0, 1, 0, [0, 1])
        waiting = _in_thread(await_vote, future, session, 1)
        time.sleep(1.5)
        assert not waiting.done(), "the vote ended with no outcome and no failure generation"
        t0 = time.monotonic()
        session.watchdog.fired = 1  # the watchdog saw the failure generation
        with pytest.raises(VoteInDoubt):
            waiting.result(timeout=DOUBT_GRACE_S + MARGIN_S + 20)
        took = time.monotonic() - t0
        assert DOUBT_GRACE_S <= took < DOUBT_GRACE_S + MARGIN_S, took
        t0 = time.monotonic()
        with pytest.raises(NodeVoteLost):
            client.abort(0, 1, 0, [0, 1], timeout_s=1.0)
        assert time.monotonic() - t0 < 1.0 + MARGIN_S


def test_a_vote_with_no_outcome_and_no_failure_ends_at_the_backstop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A voter that never answers while no failure generation comes (a hang nobody found):
    the rank's wait ends in doubt at the backstop (its error report then has the coordinator
    regroup), not never; an outcome that comes in time is returned as it is."""
    from megatron_mecefo.recovery import step_hooks

    monkeypatch.setattr(step_hooks, "VOTE_BACKSTOP_S", 0.5)
    session = SimpleNamespace(watchdog=SimpleNamespace(fired=None), decision_wait_s=0.0)
    t0 = time.monotonic()
    with pytest.raises(VoteInDoubt, match="no vote outcome in"):
        await_vote(Future(), session, 7, slice_s=0.05)
    assert 0.5 <= time.monotonic() - t0 < 0.5 + MARGIN_S
    done: Future = Future()
    done.set_result((True, False, 0.01))
    assert await_vote(done, session, 8) == (True, False, 0.01)
