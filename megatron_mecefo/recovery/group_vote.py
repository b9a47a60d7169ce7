"""The commit vote's second level: nodes gathered in groups, one vote per group on the hot store.

:mod:`.node_vote` casts one vote per node, so the leader's hot store still serves O(nodes)
requests per iteration (issue 43, item 9: about 51 ms of its CPU per iteration at 2,048 nodes;
``results/commit_at_scale.json``; 2.2 ms with the groups).
Here the nodes of a generation are grouped deterministically from its membership: node ``n``
is in group ``n // group_size``, and a group's *head* is its lowest-numbered live node (every
node computes the same from the generation's members). Each node's supervisor serves a small
TCPStore (:class:`GroupStore`), whose address it publishes on the hot store as
``groupstore/<node>`` (a durable key: it outlives a takeover in ``--store-mode etcd``).

A node's vote (:meth:`GroupVote.vote`, from its :class:`.node_vote.NodeVoteServer` once every
local rank voted) goes to its head's store:

* ``add(gv/<g>/<i>, 1)``; the member whose add makes the count the group's size sets the
  wake-up key ``gw/<g>/<i>``; a node abort adds :data:`.commit.ABORT_WEIGHT` instead (the
  first one, found before every vote was in, sets the wake-up key);
* the head's collector (a thread started by the head's own vote or abort) waits for the
  wake-up key, reads the counter, and decides for the group: every vote and no abort: it
  casts the group's vote on the hot store with :func:`.commit.vote` (the counter there
  counts groups); otherwise it aborts there with :func:`.commit.abort`, which wakes the
  other groups. It writes the group's outcome ``go/<g>/<i>`` with ``compare_set``: the
  first writer wins;
* every member waits for ``go/<g>/<i>`` on its head's store: the members learn the outcome
  from their head, and the hot store serves one add and one wait per group, not per node.

The head is the group's only arbiter: no member decides by itself, so every node of a group
(and every rank of those nodes) takes the same path. Safety under failures follows the hot
store's rule (:mod:`.commit`): a member that loses its head's store mid-vote (the head's node
died, or hung past the client's bound) is *in doubt*: it does not apply the step, and the
regroup heals it to the highest committed iteration among the survivors (the head's death is
a node death, so a failure generation follows). The same holds when the head's own hot vote
is cut off by a takeover, and when a newer generation supersedes the vote before the head
decided (its ranks died before they voted, so it never collects): a member that finds the
generation superseded writes ``doubt`` into ``go/<g>/<i>`` itself, after a grace of
``doubt_grace_s`` (an alive head has decided by then); whoever wrote first stands for
the whole group. A group in doubt applies nothing now; the other groups learn the hot store's
outcome, which a group in doubt never contradicts: its members that voted yes
(:meth:`GroupVote.in_doubt`) keep the step prepared, and apply or drop it when the next
generation resolves the outcome (:mod:`.prepared`), so a group that is a whole pipeline stage
needs no peer of its stage to reach the committed iteration.

Waits are bounded: the group store's client has a timeout (``call_timeout_s``), and a
member's wait for the outcome is cut into slices that look for a superseding generation.
A call to a *hung* head (SIGSTOPped: its sockets stay open and its store never answers, a
client timeout or not) never returns by itself, so a guard thread (:meth:`GroupVote._guard`)
shuts this process's sockets to the head's store when a call to it has had no answer for
``member_wait_s`` and a second and either the vote was superseded ``doubt_grace_s`` ago (the
coordinator declared the hung head's node lost: issue 54, H1) or ``call_timeout_s`` passed:
the call fails, and the member is in doubt, as when the head dies.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_mecefo.recovery.commit import (
    ABORT_WEIGHT,
    DECISION_WAIT_S,
    _superseded,
    abort,
    forget,
    vote,
    vote_after_failover,
)
from megatron_mecefo.recovery.fault_injection import die_at
from megatron_mecefo.recovery.membership import MembershipStore
from megatron_mecefo.recovery.store_forwarding import StoreFailedOver, serve

GROUP_SIZE = 32
"""Default nodes per group (``RecoveryConfig.vote_group_size``): at 2,048 nodes, 64 votes on the
hot store and 32 on each head's store per iteration."""

STORE_KEY = "groupstore/{node}"
"""Hot-store key: ``HOST:PORT`` of a node's :class:`GroupStore`."""

COMMIT, ABORT, DOUBT = "commit", "abort", "doubt"


def groups_of(nodes: Sequence[int], group_size: int) -> Dict[int, List[int]]:
    """The generation's groups: group ``k`` holds the live nodes ``n`` with ``n // group_size
    == k``, sorted (its head first)."""
    out: Dict[int, List[int]] = {}
    for n in sorted(set(nodes)):
        out.setdefault(n // group_size, []).append(n)
    return out


def two_level(nodes: Sequence[int], group_size: int) -> bool:
    """Whether a generation of these nodes votes in groups: more nodes than one group holds
    (every node decides this from the same members, so all take the same path)."""
    return group_size > 0 and len(set(nodes)) > group_size


def _keys(g: int, i: int) -> Tuple[str, str, str]:
    return f"gv/{g}/{i}", f"gw/{g}/{i}", f"go/{g}/{i}"


class _Call:
    """A member's exchange with its head's store for ``g/i`` (watched by the guard)."""

    __slots__ = ("head", "g", "i", "answered", "looked", "superseded", "shut")

    def __init__(self, head: int, g: int, i: int) -> None:
        self.head, self.g, self.i = head, g, i
        self.answered = time.monotonic()  # the last answer of the head's store (or the start)
        self.looked = 0.0  # the guard's last look for a superseding generation
        self.superseded: Optional[float] = None
        self.shut = False


def _client(address: str, timeout_s: float):
    from megatron_mecefo.recovery.store_forwarding import tcp_client

    return tcp_client(address, timeout_s)


class GroupStore:
    """A node's small TCPStore for its group's gather (it serves while the node heads one).

    Args:
        host: This machine's address, as the other nodes reach it (``--store-host``).
    """

    def __init__(self, host: str) -> None:
        import torch.distributed as dist

        self.server: Optional[dist.TCPStore] = serve(host, 0)
        self.address = f"{host}:{self.server.port}"

    def close(self) -> None:
        """Stop serving (the connected clients' calls fail, as on the node's death)."""
        self.server = None


class GroupVote:
    """A node's side of the two-level vote (members and, when it heads a group, collector).

    Args:
        node: This node's index.
        store: This node's :class:`GroupStore` (``None``: look its address up like any other).
        hot: The node's client of the hot store for lookups and the superseded check.
        hot_voter: A factory of the collector's hot-store client (in etcd mode one that raises
            ``StoreFailedOver``: a group vote cut off by a takeover is in doubt).
        group_size: Nodes per group (:data:`GROUP_SIZE`).
        poll_interval_s: As for :func:`.commit.vote` (waits are sliced at 10x it).
        decision_wait_s: As for :func:`.commit.vote`.
        doubt_grace_s: A member's grace, once the vote is superseded, before it writes
            ``doubt`` for its group (an alive head decides within about a second then; a
            doubt is always safe, so the grace only spares a group a heal).
        call_timeout_s: The bound on any call to a head's store (a hung head).
        member_wait_s: A member's wait slice for its group's outcome (it looks for a
            superseding generation after each).
    """

    def __init__(
        self,
        node: int,
        store: Optional[GroupStore],
        hot: MembershipStore,
        hot_voter: Callable[[], MembershipStore],
        group_size: int = GROUP_SIZE,
        poll_interval_s: float = 0.01,
        decision_wait_s: float = DECISION_WAIT_S,
        doubt_grace_s: float = 2.0,
        call_timeout_s: float = 10.0,
        member_wait_s: float = 1.0,
    ) -> None:
        self.node, self.own, self.hot = node, store, hot
        # Connected now, not at the first vote: a connect can stall (the server resolves the
        # client's name), and the heads' first vote should not pay for it. A node without a
        # group store of its own never heads a group, and never casts on the hot store.
        self._hot_voter = hot_voter() if store is not None else hot
        self.group_size, self.poll_interval_s = group_size, poll_interval_s
        self.decision_wait_s, self.call_timeout_s = decision_wait_s, call_timeout_s
        self.doubt_grace_s, self.member_wait_s = doubt_grace_s, member_wait_s
        self._hot_lock = threading.Lock()  # the shared hot client: one request at a time
        self._lock = threading.Lock()
        # head -> (address, client of its store, generation it was looked up for)
        self._clients: Dict[int, Tuple[str, object, int]] = {}
        self._idle: List[object] = []  # the collectors' clients of this node's own store
        self._collecting: Dict[Tuple[int, int], threading.Thread] = {}
        self._last: Dict[Tuple[int, int], bool] = {}
        self._doubts: Dict[Tuple[int, int], None] = {}  # the last few votes left in doubt
        self.collected = 0
        """Group votes this node cast on the hot store as a head."""
        self._addresses: Dict[int, str] = {}  # head -> its store's address, once looked up
        self._calls: List[_Call] = []  # calls to other heads' stores (the guard watches)
        self._guard_cv = threading.Condition(self._lock)  # the guard sleeps while none
        self._closed = threading.Event()
        self.shut_heads: List[int] = []
        """Heads whose store's sockets the guard shut (hung)."""
        threading.Thread(target=self._guard, name="group-vote-guard", daemon=True).start()
        if store is not None:
            self._idle.append(_client(store.address, call_timeout_s))
            hot.store.set(STORE_KEY.format(node=node), store.address)

    # ------------------------------------------------------------------ member side
    def _head_client(self, head: int, generation: int = -1):
        """A client of ``head``'s store; its address is looked up again once per generation
        (a node that rejoined serves a new store)."""
        with self._lock:
            cached = self._clients.get(head)
        if cached is not None and cached[2] >= generation:
            return cached[1]
        if head == self.node and self.own is not None:
            address = self.own.address
        else:
            with self._hot_lock:
                address = self.hot.store.get(STORE_KEY.format(node=head)).decode()
        with self._lock:
            self._addresses[head] = address  # before the connect, which a hung head stalls
        if cached is not None and cached[0] == address:
            client = cached[1]
        else:
            client = _client(address, self.call_timeout_s)
        with self._lock:
            self._clients[head] = (address, client, generation)
        return client

    def _drop(self, head: int) -> None:
        with self._lock:
            self._clients.pop(head, None)

    def prepare(self, generation: int, nodes: Sequence[int]) -> None:
        """Connect to this node's head for ``generation`` (of ``nodes``) ahead of its first
        vote (a connect can stall; the vote's path should not)."""
        self._head_client(self._shape(nodes)[0], generation)

    def _shape(self, nodes: Sequence[int]) -> Tuple[int, int, int]:
        """(head, group size, number of groups) of this node in a generation of ``nodes``."""
        groups = groups_of(nodes, self.group_size)
        mine = groups[self.node // self.group_size]
        return mine[0], len(mine), len(groups)

    def vote(self, g: int, i: int, nodes: Sequence[int]) -> Tuple[bool, bool]:
        """This node's vote for ``g/i`` in a generation of ``nodes``: ``(commit, completed)``
        (``completed``: this node, as its group's head, completed the hot store's count)."""
        return self._cast(g, i, nodes, 1)

    def abort(self, g: int, i: int, nodes: Sequence[int]) -> bool:
        """Abort this node's vote for ``g/i``; returns the group's outcome that stands."""
        return self._cast(g, i, nodes, ABORT_WEIGHT)[0]

    def _cast(self, g: int, i: int, nodes: Sequence[int], amount: int) -> Tuple[bool, bool]:
        head, n, ngroups = self._shape(nodes)
        if head == self.node:
            self._collect(g, i, n, ngroups)
        votes, wake, _ = _keys(g, i)
        call = _Call(head, g, i) if head != self.node else None  # its own store serves here
        if call is not None:
            with self._guard_cv:
                self._calls.append(call)
                self._guard_cv.notify()
        try:
            client = self._head_client(head, g)
            count = int(client.add(votes, amount))
            if call is not None:
                call.answered = time.monotonic()
            # The vote that completes the count, or the abort that comes before it, wakes the
            # head: exactly one of them, by the counter's order.
            if (amount == 1 and count == n) or (amount > 1 and count - amount < n):
                client.set(wake, "")
            standing = self._await(client, g, i, call)
        except Exception:  # noqa: BLE001 (the head's store is lost or hung: in doubt)
            self._drop(head)
            standing = DOUBT
        finally:
            if call is not None:
                with self._lock:
                    self._calls.remove(call)
        if standing == DOUBT and amount == 1:  # voted yes, outcome unknown: prepared
            self._doubted(g, i)
        ok = standing == COMMIT
        return ok, self._last.pop((g, i), False) if head == self.node else False

    def _doubted(self, g: int, i: int) -> None:
        with self._lock:
            self._doubts[(g, i)] = None
            for key in list(self._doubts)[:-8]:  # a few, not one per vote
                del self._doubts[key]

    def in_doubt(self, g: int, i: int) -> bool:
        """Whether this node's vote for ``g/i`` (a yes) ended in doubt: ``vote`` returned no
        commit, yet the step may have been committed by other groups. The node's ranks keep
        the step prepared for the next generation's resolution (:mod:`.prepared`)."""
        with self._lock:
            return (g, i) in self._doubts

    def _guard(self) -> None:
        """Shut the sockets to a hung head's store (module docstring): its calls never return,
        a client timeout or not, so the member's thread cannot look for itself."""
        from megatron_mecefo.recovery.store_etcd import shutdown_store_sockets

        while True:
            with self._guard_cv:
                while not self._calls and not self._closed.is_set():
                    self._guard_cv.wait()
            if self._closed.wait(0.25):
                return
            now = time.monotonic()
            with self._lock:
                stalled = [c for c in self._calls if now - c.answered > self.member_wait_s + 1.0]
            for call in stalled:
                if call.shut:
                    continue
                # The shared hot client may be in a call that hangs (the hot store's own watch
                # cuts that): the guard looks again later rather than wait behind it.
                if (
                    call.superseded is None
                    and now - call.looked >= 0.5
                    and self._hot_lock.acquire(timeout=0.5)
                ):
                    call.looked = now
                    try:
                        if _superseded(self.hot, call.g, call.i):
                            call.superseded = now
                    except Exception:  # noqa: BLE001 (as above)
                        pass
                    finally:
                        self._hot_lock.release()
                superseded = call.superseded is not None and now - call.superseded > (
                    self.doubt_grace_s
                )
                if not superseded and now - call.answered <= self.call_timeout_s:
                    continue
                with self._lock:
                    address = self._addresses.get(call.head)
                if address is None:
                    continue
                call.shut = True
                self.shut_heads.append(call.head)
                shut = shutdown_store_sockets(address)
                why = "its vote superseded" if superseded else f"past {self.call_timeout_s:g} s"
                print(
                    f"[supervisor node {self.node}] group vote {call.g}/{call.i}: the store of "
                    f"head {call.head} ({address}) has not answered for "
                    f"{now - call.answered:.1f} s, {why}: {shut} sockets shut (hung; in doubt)",
                    flush=True,
                )

    def close(self) -> None:
        """Stop the guard (the node's vote server closes)."""
        with self._guard_cv:
            self._closed.set()
            self._guard_cv.notify_all()

    def _await(self, client, g: int, i: int, call: Optional[_Call] = None) -> str:
        """The group's outcome from the head's store (``commit``, ``abort`` or ``doubt``);
        ``doubt`` written by this member once the vote is superseded and the head has not
        decided within ``doubt_grace_s``."""
        from torch.distributed import DistNetworkError, DistStoreError

        _, _, out = _keys(g, i)
        # The head's store answers the wait the moment the outcome is written, and a dead
        # head's closes the connection: the slice only paces the look for a superseding
        # generation (one hot-store read per node per slice of waiting, none in a normal
        # iteration; short slices made every waiting node poll both stores).
        wait = timedelta(seconds=self.member_wait_s)
        superseded_at = None
        while True:
            try:
                client.wait([out], wait)
                return client.get(out).decode()
            except DistStoreError as err:
                if isinstance(err, DistNetworkError):
                    raise
            if call is not None:
                call.answered = time.monotonic()
            if superseded_at is None:
                with self._hot_lock:
                    if _superseded(self.hot, g, i):
                        superseded_at = time.monotonic()
            elif time.monotonic() - superseded_at > self.doubt_grace_s:
                return client.compare_set(out, "", DOUBT).decode()

    # ------------------------------------------------------------------ head side
    def _own_client(self):
        with self._lock:
            if self._idle:
                return self._idle.pop()
        assert self.own is not None
        return _client(self.own.address, self.call_timeout_s)

    def _collect(self, g: int, i: int, n: int, ngroups: int) -> None:
        """Start the collector of ``g/i`` on this head (once)."""
        with self._lock:
            if (g, i) in self._collecting or self.own is None:
                return
            t = threading.Thread(
                target=self._collector, args=(g, i, n, ngroups), name="group-vote", daemon=True
            )
            self._collecting[(g, i)] = t
            # Keep a few finished rounds (a late abort must not start a second collector).
            for key in [k for k, v in self._collecting.items() if not v.is_alive()][:-8]:
                del self._collecting[key]
        t.start()

    def _collector(self, g: int, i: int, n: int, ngroups: int) -> None:
        from torch.distributed import DistNetworkError, DistStoreError

        votes, wake, out = _keys(g, i)
        client = self._own_client()
        wait = timedelta(seconds=max(self.poll_interval_s * 10, 0.02))
        looks = 0
        try:
            while True:
                try:
                    client.wait([wake], wait)
                except DistStoreError as err:
                    if isinstance(err, DistNetworkError):
                        raise
                count = int(client.add(votes, 0))
                if count == n or count >= ABORT_WEIGHT:
                    break
                looks += 1
                if looks % 5 == 0:  # a member died before voting: the coordinator moved on
                    with self._hot_lock:
                        if _superseded(self.hot, g, i):
                            break
            decision = self._decide_hot(g, i, ngroups, count == n)
            die_at("after-hot-vote", i)  # tests: the head dies before its group learns it
            completed = self._last.get((g, i), False)  # read before the members learn it
            standing = client.compare_set(out, "", decision).decode()
            if standing == COMMIT and completed:  # off the members' path: after the outcome
                try:  # the hot keys of i - 1, and its claim on etcd (etcd mode)
                    forget(self._hot_voter, g, i - 1)
                except Exception:  # noqa: BLE001 (bookkeeping only)
                    pass
            if standing == COMMIT and count == n:  # every member voted: i - 1 is known
                for key in _keys(g, i - 1):
                    client.delete_key(key)
            with self._lock:
                self._idle.append(client)
        except Exception:  # noqa: BLE001 (own store gone: the node is going down)
            pass

    def _decide_hot(self, g: int, i: int, ngroups: int, full: bool) -> str:
        """The group's vote (``full``) or abort on the hot store; the outcome for the group."""
        ms = self._hot_voter
        outcome: Dict[str, bool] = {"last": False}
        try:
            if full:
                try:
                    ok = vote(
                        ms, g, i, self.node, range(ngroups), self.poll_interval_s, outcome,
                        self.decision_wait_s,
                    )  # fmt: skip
                except StoreFailedOver:
                    ok = vote_after_failover(
                        ms, g, i, self.node, range(ngroups), self.poll_interval_s, outcome,
                        self.decision_wait_s,
                    )  # fmt: skip
                    if outcome.get("doubt"):  # cut off by a takeover: the group is in doubt
                        return DOUBT
            else:
                ok = abort(ms, g, i, ngroups, self.decision_wait_s)
        except Exception:  # noqa: BLE001 (the hot store lost mid-vote: the group is in doubt)
            return DOUBT
        self._last[(g, i)] = outcome["last"]
        self.collected += full
        return COMMIT if ok else ABORT
