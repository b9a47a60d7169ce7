"""The commit vote per node: one store operation per node per iteration, not one per rank.

:mod:`.commit`'s vote adds to the store counter ``votes/<g>/<iteration>`` once per rank, so the
store serves O(ranks) operations per iteration (issue 43, item 9: 16,384 at 2,048 nodes of 8).
Here each node's supervisor runs a :class:`NodeVoteServer` that gathers the votes of its local
ranks over a Unix domain socket and casts ONE vote for the node with :func:`.commit.vote`,
whose member count is the number of nodes: the same counter, the same all-or-nothing rule
(COMMIT exactly when the last node's vote comes before the first abort), the same commit and
decision keys, the same first claim on the standby (or etcd) for the outcome key.

The node's vote is the AND of its ranks' votes:

* every local rank of the generation voted: the node votes (``commit.vote``) and tells each
  rank the outcome that stands for every node;
* a local rank aborts, its connection closes before it voted (it died), or it has not voted
  ``gather_timeout_s`` after the node's first local vote: the node aborts (``commit.abort``),
  and every local rank that voted gets that outcome. Before its own vote is cast the node's
  abort always finds fewer than every vote, so the outcome is ABORT for every node; after it
  is cast, the abort tells the outcome that stands (as a late abort does in :mod:`.commit`).

A node that dies before casting never completes the count: the other nodes wait, as they do
today for a dead rank, until the coordinator publishes the failure generation (``vote`` then
aborts). One that dies after casting leaves the outcome to the counter. Its ranks' clients
raise :class:`NodeVoteLost` (the outcome is unknown to them; they must not apply the step), as
they do when the node's vote ended in doubt (its group's head or the hot store lost, or its
commit did not land): they keep the step prepared for the next generation (:mod:`.prepared`).

:class:`NodeVoteClient` is the rank's side, with :class:`.commit.AsyncVoter`'s interface
(``start`` returns a future of ``(commit, completed_the_count, seconds)``), plus ``abort``
for the step hook's error path, which today calls :func:`.commit.abort` on the store.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from megatron_mecefo.recovery.commit import (
    DECISION_WAIT_S,
    VoteInDoubt,
    abort,
    forget,
    vote,
    vote_after_failover,
)
from megatron_mecefo.recovery.group_vote import GroupStore, GroupVote, groups_of, two_level
from megatron_mecefo.recovery.membership import MembershipStore
from megatron_mecefo.recovery.store_forwarding import StoreFailedOver

GATHER_TIMEOUT_S = 30.0
"""Default bound on the wait for a node's last local vote after its first: the local ranks
vote right after the same gradient all-reduce, so a rank this late has hung or died."""


def _hang_up(conn: Connection) -> None:
    """Close ``conn`` so that its peer sees EOF now: a plain close leaves the socket open while
    a thread of this process is blocked in ``recv`` on it."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    conn.close()


class NodeVoteLost(VoteInDoubt):
    """The node's vote server went away during a vote, or the node's vote ended in doubt: this
    rank does not know the outcome and must not apply the step now; it keeps it prepared for
    the next generation's resolution (:mod:`.prepared`)."""


@dataclass
class _Round:
    """One (generation, iteration) on one node."""

    local: int
    nodes: Tuple[int, ...]  # the generation's nodes (their count is the store's member count)
    first_vote: float
    voters: Dict[int, Connection] = field(default_factory=dict)
    progress: bool = False
    state: str = "gathering"  # gathering -> cast (vote in flight) -> decided
    outcome: Optional[bool] = None
    completed: bool = False


class NodeVoteServer:
    """A node's vote aggregator (its supervisor runs one).

    Args:
        path: The Unix domain socket the local ranks connect to.
        store: ``HOST:PORT`` of the membership store (two clients: one for the vote, which
            waits in the store, one for aborts and the bookkeeping).
        node: This node's index (names the node in errors only: the counter counts votes).
        poll_interval_s: As for :func:`.commit.vote`.
        gather_timeout_s: The bound on the last local vote after the first.
        membership: A :class:`MembershipStore` factory; default:
            :meth:`MembershipStore.connect` of ``store``.
        vote_membership: The factory of the casting client only (default: ``membership``);
            a supervisor's raises ``StoreFailedOver`` on a takeover (:mod:`.node_vote_host`).
        group_size: Nodes per group of the two-level vote (:mod:`.group_vote`), used by a
            generation of more nodes than that; 0: never (every node of a job must agree).
        group_host: This machine's address for its group store (``group_size`` > 0).
    """

    def __init__(
        self,
        path: str,
        store: str,
        node: int = 0,
        poll_interval_s: float = 0.005,
        gather_timeout_s: float = GATHER_TIMEOUT_S,
        decision_wait_s: float = DECISION_WAIT_S,
        membership: Optional[Callable[[], MembershipStore]] = None,
        vote_membership: Optional[Callable[[], MembershipStore]] = None,
        group_size: int = 0,
        group_host: str = "127.0.0.1",
    ) -> None:
        self.path, self.node = path, node
        self.poll_interval_s, self.gather_timeout_s = poll_interval_s, gather_timeout_s
        self.decision_wait_s = decision_wait_s
        connect = membership or (lambda: MembershipStore.connect(store))
        self._vote_ms, self._ms = (vote_membership or connect)(), connect()
        self.group: Optional[GroupVote] = None
        """The two-level vote (``group_size`` > 0)."""
        if group_size > 0:
            self.group = GroupVote(
                node, GroupStore(group_host), connect(), vote_membership or connect,
                group_size=group_size, poll_interval_s=poll_interval_s,
                decision_wait_s=decision_wait_s,
            )  # fmt: skip
        self._ms_lock = threading.Lock()  # one request at a time on the shared client
        self._lock = threading.Condition()
        self._rounds: Dict[Tuple[int, int], _Round] = {}
        self._casts: List[Tuple[int, int]] = []
        self._conns: Set[Connection] = set()
        self._closed = False
        self.casts = 0
        """Votes this node cast into the store (one per iteration)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead supervisor's socket
        self._listener = Listener(path, family="AF_UNIX")
        for target, name in (
            (self._accept, "accept"),
            (self._cast_loop, "cast"),
            (self._deadline_loop, "deadline"),
        ):
            threading.Thread(target=target, name=f"node-vote-{name}", daemon=True).start()

    # ------------------------------------------------------------------ connections
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        """One local rank's requests: ``("vote"|"abort", g, i, local, nodes, progress)``."""
        try:
            while True:
                kind, g, i, local, nodes, progress = conn.recv()
                if kind == "vote":
                    self._on_vote(conn, g, i, local, nodes, progress)
                else:
                    self._on_abort(conn, g, i, nodes, f"a rank aborted {g}/{i}")
        except (EOFError, OSError):
            pass
        with self._lock:
            self._conns.discard(conn)
            open_rounds = [
                (key, r.nodes)
                for key, r in self._rounds.items()
                if r.state == "gathering" and conn not in r.voters.values()
            ]
        for (g, i), nodes in open_rounds:  # a rank died before its vote: the node aborts
            self._on_abort(None, g, i, nodes, f"a rank left before voting {g}/{i}")

    def _send(self, conn: Optional[Connection], message: tuple) -> None:
        if conn is None:
            return
        try:
            conn.send(message)
        except OSError:
            pass  # the rank is gone; nothing to tell

    # ------------------------------------------------------------------ rounds
    def _two_level(self, nodes: Tuple[int, ...]) -> bool:
        return self.group is not None and two_level(nodes, self.group.group_size)

    def _on_vote(
        self, conn: Connection, g: int, i: int, local: int, nodes: Tuple[int, ...], progress: bool
    ) -> None:
        with self._lock:
            r = self._rounds.setdefault((g, i), _Round(local, nodes, time.monotonic()))
            if r.state == "decided":  # the node aborted before this vote came
                reply = ("outcome", g, i, r.outcome, False)
            elif (r.local, r.nodes) != (local, nodes):
                reply = None  # ranks disagree on the generation's shape: abort below
            else:
                r.voters[id(conn)] = conn
                r.progress |= progress
                if r.state == "gathering" and len(r.voters) == r.local:
                    r.state = "cast"
                    self._casts.append((g, i))
                    self._lock.notify_all()
                return
        if reply is None:
            self._on_abort(conn, g, i, nodes, f"local ranks disagree on the members of {g}")
        else:
            self._send(conn, reply)

    def _on_abort(
        self, conn: Optional[Connection], g: int, i: int, nodes: Tuple[int, ...], why: str
    ) -> None:
        """Abort the node's vote of ``g/i`` (or, once cast, learn the outcome that stands)."""
        with self._lock:
            r = self._rounds.setdefault((g, i), _Round(0, nodes, time.monotonic()))
            if r.state == "decided":
                self._send(conn, ("outcome", g, i, r.outcome, False))
                return
            was_gathering = r.state == "gathering"
            if was_gathering:
                r.state = "aborting"  # no cast after this; later votes wait for the outcome
        if self._two_level(r.nodes):
            assert self.group is not None
            ok = self.group.abort(g, i, r.nodes)
        else:
            with self._ms_lock:
                ok = abort(self._ms, g, i, len(r.nodes), self.decision_wait_s)
        # Gathering: this abort decides the node's vote (its voters learn it here). Cast: the
        # cast's own outcome goes to the voters; this abort only learns the one that stands.
        for c in self._decide(g, i, ok, False) if was_gathering else []:
            self._send(c, ("outcome", g, i, ok, False))
        self._send(conn, ("outcome", g, i, ok, False))

    def _decide(self, g: int, i: int, ok: bool, completed: bool) -> List[Connection]:
        with self._lock:
            r = self._rounds[(g, i)]
            r.state, r.outcome, r.completed = "decided", ok, completed
            late = list(r.voters.values())
            # Keep a few decided rounds (a late abort or vote reads them), not one per step.
            for key in [k for k, v in self._rounds.items() if v.state == "decided"][:-8]:
                del self._rounds[key]
            return late

    def _cast_loop(self) -> None:
        """Casts the node's votes, one at a time (its client waits in the store)."""
        while True:
            with self._lock:
                while not self._casts and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                g, i = self._casts.pop(0)
                r = self._rounds[(g, i)]
            outcome: Dict[str, bool] = {"last": False}
            if self._two_level(r.nodes):  # the group's head casts; the hot store counts groups
                assert self.group is not None
                counted = len(groups_of(r.nodes, self.group.group_size))
                try:
                    ok, completed = self.group.vote(g, i, r.nodes)
                except Exception:  # noqa: BLE001 (e.g. this node not in the generation)
                    for c in self._decide(g, i, False, False):
                        self._send(c, ("lost", g, i, counted, False))
                    continue
                self.casts += 1
                # In doubt (the head or the hot store lost after this node voted yes): "lost"
                # (with the hot counter's member count), so that the ranks keep the step
                # prepared (NodeVoteLost), not drop it.
                doubt = not ok and self.group.in_doubt(g, i)
                message = (
                    ("lost", g, i, counted, False) if doubt else ("outcome", g, i, ok, completed)
                )
                for c in self._decide(g, i, ok, completed):
                    self._send(c, message)
                if ok and r.progress:
                    with contextlib.suppress(Exception), self._ms_lock:
                        self._ms.set_durable("progress", str(i))
                continue
            try:
                try:
                    ok = vote(
                        self._vote_ms, g, i, self.node, range(len(r.nodes)),
                        self.poll_interval_s, outcome, self.decision_wait_s,
                    )  # fmt: skip
                except StoreFailedOver:  # etcd mode: the leader's store moved mid-vote
                    ok = vote_after_failover(
                        self._vote_ms, g, i, self.node, range(len(r.nodes)),
                        self.poll_interval_s, outcome, self.decision_wait_s,
                    )  # fmt: skip
            except Exception:  # noqa: BLE001 (store lost: the ranks must not apply the step)
                for c in self._decide(g, i, False, False):
                    self._send(c, ("lost", g, i, len(r.nodes), False))
                continue
            self.casts += 1
            doubt = outcome.get("doubt")  # cut off by a takeover: in doubt
            for c in self._decide(g, i, ok, outcome["last"]):
                if doubt:
                    self._send(c, ("lost", g, i, len(r.nodes), False))
                else:
                    self._send(c, ("outcome", g, i, ok, outcome["last"]))
            if ok and (r.progress or outcome["last"]):  # off the ranks' path, after the replies
                try:
                    with self._ms_lock:
                        if r.progress:
                            self._ms.set_durable("progress", str(i))
                        if outcome["last"]:
                            forget(self._ms, g, i - 1)
                except Exception:  # noqa: BLE001 (the store is gone; the outcome is out)
                    pass

    def _deadline_loop(self) -> None:
        """Aborts a round whose last local vote is ``gather_timeout_s`` late."""
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                late = [
                    (key, r.nodes)
                    for key, r in self._rounds.items()
                    if r.state == "gathering" and now - r.first_vote > self.gather_timeout_s
                ]
            for (g, i), nodes in late:
                self._on_abort(None, g, i, nodes, f"a local rank did not vote {g}/{i} in time")
            time.sleep(min(0.05, self.gather_timeout_s / 4))

    def close(self) -> None:
        """Stop listening and drop the local connections (their clients raise)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            conns = list(self._conns)
        self._listener.close()
        for c in conns:
            _hang_up(c)
        if self.group is not None:
            self.group.close()
            if self.group.own is not None:
                self.group.own.close()


class NodeVoteClient:
    """A rank's side of the node vote, with :class:`.commit.AsyncVoter`'s interface.

    Args:
        path: The node's :class:`NodeVoteServer` socket.
        node_of: The node of a training slot (every rank of a job uses the same map), which
            gives each vote its node's local count and the number of nodes.
    """

    def __init__(self, path: str, node_of: Callable[[int], int], timeout_s: float = 60.0):
        self.node_of = node_of
        deadline = time.monotonic() + timeout_s
        while True:  # the supervisor's server may start after its ranks
            try:
                self._conn = Client(path, family="AF_UNIX")
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._send_lock = threading.Lock()
        # Replies come in request order per (generation, iteration): a vote, then an abort.
        self._pending: Dict[Tuple[int, int], List[Tuple[Future, float]]] = {}
        self._lock = threading.Lock()
        self._lost: Optional[str] = None
        self._shape_of: Optional[Tuple[Tuple[int, int], Tuple[int, Tuple[int, ...]]]] = None
        self.cpu_s = 0.0
        """Kept for the supervisor's accounting (the rank's thread only reads replies)."""
        threading.Thread(target=self._read, name="mecefo-node-vote", daemon=True).start()

    def _shape(self, g: int, slot: int, members: Sequence[int]) -> Tuple[int, Tuple[int, ...]]:
        """(this node's members, the generation's nodes, sorted) of ``members``; computed once
        per generation (its members do not change), not on every iteration's vote: it walks
        every member, 16,384 at 2,048 nodes of 8."""
        if self._shape_of is None or self._shape_of[0] != (g, slot):
            node = self.node_of(slot)
            nodes = tuple(sorted({self.node_of(m) for m in members}))
            local = sum(1 for m in members if self.node_of(m) == node)
            self._shape_of = ((g, slot), (local, nodes))
        return self._shape_of[1]

    def _request(
        self, kind: str, g: int, i: int, slot: int, members: Sequence[int], progress: bool
    ):
        future: Future = Future()
        local, nodes = self._shape(g, slot, members)
        with self._lock:
            if self._lost is not None:
                future.set_exception(NodeVoteLost(self._lost))
                return future
            self._pending.setdefault((g, i), []).append((future, time.perf_counter()))
        try:
            with self._send_lock:
                self._conn.send((kind, g, i, local, nodes, progress))
        except OSError as err:
            self._fail(f"node vote server unreachable: {err}")
        return future

    def start(
        self,
        generation: int,
        iteration: int,
        slot: int,
        members: Sequence[int],
        report_progress: bool = False,
    ) -> Future:
        """Vote through the node; the future gives ``(commit, completed_the_count, seconds)``
        (``completed_the_count``: the node's vote completed the count)."""
        return self._request("vote", generation, iteration, slot, members, report_progress)

    def abort(
        self,
        generation: int,
        iteration: int,
        slot: int,
        members: Sequence[int],
        timeout_s: Optional[float] = None,
    ) -> bool:
        """Abort (the step hook's error path); returns the outcome that stands (True: commit,
        when this rank's vote had been counted and every node's was in). Raises
        :class:`NodeVoteLost` when no answer comes within ``timeout_s`` (a hung supervisor)."""
        future = self._request("abort", generation, iteration, slot, members, False)
        try:
            ok, _, _ = future.result(timeout=timeout_s)
        except FutureTimeout:
            raise NodeVoteLost(f"no answer from the node's vote server in {timeout_s} s") from None
        return ok

    def _read(self) -> None:
        try:
            while True:
                kind, g, i, ok, completed = self._conn.recv()
                with self._lock:
                    waiting = self._pending.get((g, i))
                    if not waiting:
                        continue
                    future, t0 = waiting.pop(0)
                    if not waiting:
                        del self._pending[(g, i)]
                if kind == "lost":  # ``ok`` is the hot counter's member count here
                    future.set_exception(
                        NodeVoteLost(f"the node's vote of {g}/{i} is in doubt", counted=ok)
                    )
                else:
                    future.set_result((bool(ok), bool(completed), time.perf_counter() - t0))
        except (EOFError, OSError) as err:
            self._fail(f"node vote server gone: {err!r}")

    def _fail(self, why: str) -> None:
        with self._lock:
            self._lost = why
            pending = [f for waiting in self._pending.values() for f, _ in waiting]
            self._pending = {}
        for future in pending:
            if not future.done():
                future.set_exception(NodeVoteLost(why))

    def close(self) -> None:
        """Hang up (the server takes it as this rank's death)."""
        _hang_up(self._conn)
