"""The recovery control state on etcd v3: a leader elected with a lease, fenced writes, and the
keys every member must read the same (generations, step outcomes, deaths, incarnations, the
fatal message).

Keys, under ``<prefix>/``:

* ``leader``: the elected coordinator's id, attached to its lease. Its ``create_revision`` is
  the *term*: etcd's revisions only grow, so a later leader always has a higher term.
* ``gen``: the current generation number; ``gen/<n>``: generation ``n`` (its JSON, written
  once, with ``gen``, by the leader of the term, in one transaction).
* ``outcome/<g>/<iteration>``: the outcome of a step (first claim stands).
* ``dead/<slot>/<inc>``: a death (first report stands); ``inc/<slot>``: the incarnation of a
  slot (a compare-and-swap counter); ``fatal``: the message that ends the job (first stands).
* ``ended``: why the last term was ended early (:meth:`EtcdControl.end_term_of`: a follower
  found the leader's store refusing connections and revoked its lease).

Fencing: every write of the leader is a transaction whose compare includes ``leader`` ==
its id and ``create_revision(leader)`` == its term. A leader whose lease expired (hung,
cut off) finds the key gone or re-created by the next leader, and its write fails with
:class:`Fenced`, having changed nothing. Its own keepalive thread also notices (the lease's
TTL is 0, or no member answered for a TTL) and sets :attr:`EtcdControl.lost`.

Every call is bounded (``call_timeout_s``, default the lease TTL); when no member answers
with a quorum (etcd lost it, or this node lost its links to etcd: the two look the same from
here), calls raise :class:`ControlPlaneLost` with one line within that bound. A write over
etcd's space quota raises :class:`EtcdNoSpace` at once. While it leads, a process renews its
lease every half second (its heartbeat on etcd, :meth:`EtcdControl.lease_silent_s`) and
compacts the history every :data:`COMPACT_EVERY_S`.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_mecefo.recovery.etcd_transport import (
    ControlError,
    ControlPlaneLost,
    EtcdConnection,
    EtcdNoSpace,
    b,
    cmp_create,
    cmp_mod,
    cmp_value,
    cmp_version,
    op_get,
    op_put,
    txn_kv,
)

__all__ = [
    "ControlError",
    "ControlPlaneLost",
    "EtcdControl",
    "EtcdNoSpace",
    "Fenced",
    "GenerationConflict",
    "NotElected",
    "Term",
    "lease_ttl_s",
]

LEASE_TTL_FLOOR_S = 10.0
"""The shortest lease TTL a supervisor's leadership gets, whatever ``--heartbeat-timeout``: a
loaded machine (load average 35 on 2 cores, seen at start-up) starved the keepalive for a
4 s TTL with no fault anywhere. A hung or cut-off leader is replaced after the TTL; a dead one
(its store refuses connections) at once, by its followers (``store_host``)."""

KEEPALIVE_EVERY_S = 0.5
"""The leader renews its lease at least this often (TTL/3 when shorter), so that the lease's
remaining TTL is the leader's heartbeat on etcd (:meth:`EtcdControl.lease_silent_s`)."""

CONTACT_GAP_S = 2.0
"""A renewal later than its period by more than this ends a gap in the leader's contact with
etcd: the coordinator counts heartbeat silences again from then (:class:`~.coordinator.
Coordinator`'s ``leader_contact``)."""

COMPACT_EVERY_S = 300.0
"""The leader compacts etcd's history this often, to the revision it saw one period before
(the history of the last period stays for watches that resume from a recent revision)."""


def lease_ttl_s(heartbeat_timeout_s: float) -> float:
    """The leader's lease TTL for ``--heartbeat-timeout``: never below
    :data:`LEASE_TTL_FLOOR_S`."""
    return max(float(heartbeat_timeout_s), LEASE_TTL_FLOOR_S)


class Fenced(ControlError):
    """A write of a leader whose term is over (its lease expired, another leader was elected)."""


class GenerationConflict(ControlError):
    """Generation ``n`` was published while the current one is not ``n - 1``."""


class NotElected(ControlError):
    """A campaign found the leader key held until its bound."""


@dataclass(frozen=True)
class Term:
    """A leadership: ``candidate`` holds ``leader`` since revision ``number``, on ``lease``."""

    candidate: str
    number: int
    lease: int
    ttl_s: int


class EtcdControl:
    """The control plane of one process (a supervisor): its connection, and its leadership.

    Args:
        endpoints: every etcd member, ``"h:p,h:p,h:p"`` or a list.
        prefix: the job's key prefix (e.g. ``/mecefo/<job id>``).
        ttl_s: the leader's lease TTL (s). A hung or cut-off leader is replaced after it; etcd
            raises TTLs below its minimum (1.5 election timeouts: 2 s by default) to it.
        call_timeout_s: the bound of every call (default ``ttl_s``).
        request_timeout_s: the deadline of one try on one member (default: a third of the
            call's bound, at most 1 s), after which the next member is tried.
        on_lost: called once (from the keepalive thread) with a one-line reason when this
            process's leadership is lost.
        compact_every_s: while it leads, how often it compacts etcd's history.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        prefix: str,
        ttl_s: float,
        call_timeout_s: Optional[float] = None,
        request_timeout_s: Optional[float] = None,
        on_lost: Optional[Callable[[str], None]] = None,
        compact_every_s: float = COMPACT_EVERY_S,
    ) -> None:
        self.ttl_s = max(1, math.ceil(ttl_s))
        self.compact_every_s = compact_every_s
        call = float(call_timeout_s if call_timeout_s is not None else self.ttl_s)
        req = request_timeout_s if request_timeout_s is not None else min(1.0, call / 3)
        self.conn = EtcdConnection(endpoints, call, req)
        self.prefix = prefix.rstrip("/")
        self.on_lost = on_lost
        self.term: Optional[Term] = None
        self.lost = threading.Event()
        self.lost_reason = ""
        self._stop_keepalive = threading.Event()
        self._keepalive: Optional[threading.Thread] = None
        self._compact_seen = 0
        self.contact_at = time.monotonic()
        """When the leader last heard etcd renew its lease (``time.monotonic``; an answer's
        arrival): its evidence that it is connected (:meth:`in_contact`)."""
        self.contact_regained_at = 0.0
        """When a renewal last came after a gap (:data:`CONTACT_GAP_S` past its period): the
        leader was cut off before then, and silences it saw meanwhile prove nothing."""

    @property
    def _watch_slice_s(self) -> float:
        # A watch on a member without quorum stays silent: re-read (bounded) this often.
        return max(0.2, self.conn.call_timeout_s / 2)

    def key(self, name: str) -> bytes:
        return f"{self.prefix}/{name}".encode()

    @property
    def leader_key(self) -> bytes:
        return self.key("leader")

    def close(self) -> None:
        """Stop the keepalive (the lease then expires by itself) and close the channels."""
        self._stop_keepalive.set()
        if self._keepalive is not None:
            self._keepalive.join(self.conn.call_timeout_s + 1.0)
        self.conn.close()

    # ------------------------------------------------------------------ leader election
    def leader(self) -> Optional[Tuple[str, int]]:
        """(the leader's id, its term), or None while there is none."""
        kv, _ = self.conn.get(self.leader_key)
        return (kv.value.decode(), kv.create_revision) if kv is not None else None

    def campaign(self, candidate_id: str, timeout_s: float) -> Term:
        """Become the leader: create ``leader`` with a fresh lease if it is absent; else wait
        (a watch) until it is deleted (its lease expired or was revoked) and try again.

        Ends within ``timeout_s`` plus a few call bounds (the last try's grant, txn, revoke).

        Returns:
            The term, whose lease a thread now keeps alive every
            :data:`KEEPALIVE_EVERY_S` (TTL/3 when shorter).

        Raises:
            NotElected: another candidate held ``leader`` for all of ``timeout_s``.
            ControlPlaneLost: etcd answered no call within its bound.
        """
        if self.term is not None and not self.lost.is_set():
            raise ControlError(f"candidate {candidate_id} already leads term {self.term.number}")
        deadline = time.monotonic() + timeout_s
        key = self.leader_key
        holder = "?"
        while True:
            # The lease's TTL runs on etcd from the grant: count it from before the request.
            granted_at = time.monotonic()
            lease, ttl = self.conn.lease_grant(self.ttl_s)
            r = self.conn.txn(
                f"campaign of {candidate_id}",
                [cmp_create(key, 0)],
                [op_put(key, candidate_id, lease), op_get(key)],
                [op_get(key)],
            )
            kv = txn_kv(r, 1 if r.succeeded else 0)
            # A repeated try (its first answer lost) finds its own put: that is a win too.
            if kv is not None and kv.value == b(candidate_id) and kv.lease == lease:
                self.term = Term(candidate_id, kv.create_revision, lease, ttl)
                self.lost.clear()
                self.lost_reason = ""
                self.contact_at = time.monotonic()
                self._start_keepalive(self.term, granted_at)
                return self.term
            self.conn.lease_revoke(lease)  # unused: the next try takes a fresh one
            if kv is not None:
                holder = f"{kv.value.decode(errors='replace')} (term {kv.create_revision})"
            left = deadline - time.monotonic()
            if left <= 0:
                raise NotElected(
                    f"candidate {candidate_id} not elected within {timeout_s:.1f} s: "
                    f"{holder} leads"
                )
            # Wait for the leader key's deletion; bounded watches, a linearizable re-read
            # between them (a member without quorum keeps a watch silent, not failed).
            self._wait_deleted(key, r.header.revision + 1, left)

    def _wait_deleted(self, key: bytes, revision: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            events = self.conn.watch_once(key, revision, min(left, self._watch_slice_s))
            if any(e is None or e.type == e.DELETE for e in events):
                return
            kv, _ = self.conn.get(key)
            if kv is None:
                return
            revision = max(revision, kv.mod_revision + 1)

    def _start_keepalive(self, term: Term, granted_at: float) -> None:
        self._stop_keepalive = threading.Event()
        self._keepalive = threading.Thread(
            target=self._keep_alive,
            args=(term, granted_at, self._stop_keepalive),
            name=f"etcd-keepalive-{term.number}",
            daemon=True,
        )
        self._keepalive.start()
        threading.Thread(
            target=self._compact_while_leading,
            args=(term, self._stop_keepalive),
            name=f"etcd-compact-{term.number}",
            daemon=True,
        ).start()

    def _compact_while_leading(self, term: Term, stop: threading.Event) -> None:
        """Every :attr:`compact_every_s` while ``term`` lasts: :meth:`compact_history`. Every
        write (``progress``, ``logged``: one per iteration) leaves a revision, and an
        uncompacted history fills etcd's space quota (NOSPACE) in a long job."""
        while not stop.wait(self.compact_every_s):
            if self.term != term:
                return
            try:
                self.compact_history()
            except Fenced:
                return
            except ControlError:
                continue  # etcd slow or without quorum: the keepalive says so; next period

    def compact_history(self) -> Optional[int]:
        """The leader: drop etcd's history up to the revision its previous call saw (so the
        last period stays). Fenced: a deposed leader compacts nothing. Returns the revision
        compacted to, or None (the first call, or compacted past it already).

        Raises:
            Fenced: this process leads no live term.
        """
        r = self._fenced_txn("check the term before a compaction", [], [], [])
        previous, self._compact_seen = self._compact_seen, int(r.header.revision)
        if previous and self.conn.compact(previous):
            return previous
        return None

    def lease_silent_s(self, lease: int) -> Optional[int]:
        """Whole seconds since ``lease`` was last renewed, as etcd counts (its granted TTL
        less its remaining TTL, less the one second a whole-second count loses); None when
        the lease is gone. The leader renews every :data:`KEEPALIVE_EVERY_S`: this is its
        heartbeat on etcd."""
        remaining, granted = self.conn.lease_ttls(lease)
        if remaining <= 0:
            return None
        return max(0, granted - remaining - 1)

    def _keep_alive(self, term: Term, granted_at: float, stop: threading.Event) -> None:
        """Refresh the lease every :data:`KEEPALIVE_EVERY_S` (TTL/3 when shorter): the
        leader's heartbeat on etcd. Lost when etcd says the lease is gone (TTL <= 0), or
        when no refresh succeeded for a TTL (counted from the last successful one's start:
        the lease may have expired on etcd's side since)."""
        period = min(term.ttl_s / 3.0, KEEPALIVE_EVERY_S)
        valid_from = granted_at
        while not stop.wait(period):
            while True:
                sent = time.monotonic()
                left = valid_from + term.ttl_s - sent
                if left <= 0:
                    self._set_lost(
                        term,
                        f"etcd unreachable for the lease TTL ({term.ttl_s} s): lease expired",
                    )
                    return
                try:
                    ttl = self.conn.lease_keepalive(term.lease, timeout_s=left)
                except ControlPlaneLost:
                    continue  # the loop above ends it when the TTL has passed
                except Exception as e:  # noqa: BLE001 (a gRPC error no member retry helps)
                    self._set_lost(term, f"lease keepalive failed: {type(e).__name__}: {e}")
                    return
                if ttl <= 0:
                    self._set_lost(term, "etcd says the lease expired")
                    return
                valid_from = sent
                heard = time.monotonic()
                if heard - self.contact_at > period + CONTACT_GAP_S:
                    self.contact_regained_at = heard  # before contact_at: read in this order
                self.contact_at = heard
                break
            if stop.is_set():
                return

    def in_contact(self, now: float, heartbeat_timeout_s: float) -> bool:
        """Whether the lease was renewed lately (within half the heartbeat timeout, at most a
        renewal period plus :data:`CONTACT_GAP_S`) before ``now``: the leader reaches etcd, so
        a node's silence is the node's, not the leader's own cut link."""
        within = min(heartbeat_timeout_s / 2, KEEPALIVE_EVERY_S + CONTACT_GAP_S)
        return now - self.contact_at <= within

    def _set_lost(self, term: Term, why: str) -> None:
        if self.term != term or self._stop_keepalive.is_set():
            return
        self.lost_reason = f"leadership of {term.candidate} (term {term.number}) lost: {why}"
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost(self.lost_reason)

    def resign(self) -> None:
        """Give the leadership up now: stop the keepalive and revoke the lease (etcd deletes
        ``leader`` with it, so a waiting candidate is elected at once)."""
        term = self.term
        self._stop_keepalive.set()
        if term is not None:
            self.conn.lease_revoke(term.lease)
            self.term = None

    def end_term_of(self, name: str, value: str, note: str) -> Optional[Term]:
        """End now the term of the leader that wrote ``<prefix>/<name>`` = ``value``: revoke
        its lease (etcd deletes ``leader`` with it, and the waiting campaigns elect the next
        leader at once, not a TTL later). For a leader known dead (its store refuses
        connections); a living leader whose lease is revoked is only fenced (its writes fail,
        its keepalive sees the lease gone and it exits).

        ``note`` is written to ``<prefix>/ended`` first (the next leader says why the term
        ended). Nothing is done when ``name`` no longer holds ``value``, or was written before
        the current term began: a newer leader's term is never ended here.

        Returns:
            The term ended (its lease revoked), or None.

        Raises:
            ControlPlaneLost: etcd answered no call within its bound.
        """
        key, leader = self.key(name), self.leader_key
        r = self.conn.txn(f"read the term of {name}", [], [op_get(key), op_get(leader)], [])
        kv, lead = txn_kv(r, 0), txn_kv(r, 1)
        # Read at one revision: ``leader`` existed from its creation to here (a re-created one
        # has a new create_revision), and only that term's leader writes ``name`` (fenced),
        # so a write after the creation is that leader's.
        if kv is None or lead is None or kv.value != b(value):
            return None
        if kv.mod_revision <= lead.create_revision:
            return None
        # The note, on the same state (else the term ended or moved on meanwhile).
        r = self.conn.txn(
            f"note the end of term {lead.create_revision}",
            [cmp_mod(key, kv.mod_revision), cmp_create(leader, lead.create_revision)],
            [op_put(self.key("ended"), note)],
            [],
        )
        if not r.succeeded:
            return None
        self.conn.lease_revoke(lead.lease)
        return Term(lead.value.decode(errors="replace"), lead.create_revision, lead.lease, 0)

    # ------------------------------------------------------------------ fenced writes
    def _fenced_txn(self, what: str, compare: List[Any], success: List[Any], reads: List[Any]):
        """A transaction of the leader: its fence (``leader`` == id, created at the term) and
        ``compare``. Returns the response (``succeeded`` False: a compare of the caller
        failed; the failure branch read ``leader`` first, then ``reads``).

        Raises:
            Fenced: this process is not the leader of a live term.
        """
        term = self.term
        if term is None:
            raise Fenced(f"fenced: {what}: this process leads no term")
        key = self.leader_key
        fence = [cmp_value(key, term.candidate), cmp_create(key, term.number)]
        r = self.conn.txn(what, fence + compare, success, [op_get(key)] + reads)
        if r.succeeded:
            return r
        kv = txn_kv(r, 0)
        if kv is None or kv.value != b(term.candidate) or kv.create_revision != term.number:
            now = (
                f"{kv.value.decode(errors='replace')} leads term {kv.create_revision}"
                if kv is not None
                else "no leader"
            )
            raise Fenced(
                f"fenced: {what} refused: {term.candidate}'s term {term.number} is over ({now})"
            )
        return r

    def put_fenced(self, name: str, value: str) -> None:
        """Write ``<prefix>/<name>`` as the leader (e.g. the committed iteration)."""
        self._fenced_txn(f"put {name}", [], [op_put(self.key(name), value)], [])

    def create_fenced(self, name: str, value: str) -> str:
        """Create ``<prefix>/<name>`` as the leader if it is absent; returns what stands (the
        first writer's value: a death, the fatal message)."""
        key = self.key(name)
        r = self._fenced_txn(f"create {name}", [cmp_version(key, 0)], [op_put(key, value)],
                             [op_get(key)])  # fmt: skip
        if r.succeeded:
            return value
        kv = txn_kv(r, 1)
        return kv.value.decode() if kv is not None else value

    def published_store(self, name: str) -> Tuple[str, int]:
        """(``<prefix>/<name>``, the term that wrote it), read at one revision: the hot
        store's address and the term a client's durable writes are fenced on. ("", 0) while
        the current term has not written it (no leader, or a takeover under way): an address
        from an earlier term is no one's now, even when a later term reuses it."""
        key, leader = self.key(name), self.leader_key
        r = self.conn.txn(f"read {name} and its term", [], [op_get(key), op_get(leader)], [])
        kv, lead = txn_kv(r, 0), txn_kv(r, 1)
        if kv is None or lead is None or kv.mod_revision <= lead.create_revision:
            return "", 0
        return kv.value.decode(), int(lead.create_revision)

    # ------------------------------------------------------------------ generations
    def publish_generation(self, number: int, text: str) -> None:
        """Publish generation ``number`` (``gen/<number>`` = ``text``, ``gen`` = number) in one
        fenced transaction that also requires ``gen`` == number - 1 (absent for 0), so a
        generation never rolls back or is published twice with different contents.

        Raises:
            Fenced: not the leader of a live term.
            GenerationConflict: the current generation is not ``number - 1``.
        """
        gen, entry = self.key("gen"), self.key(f"gen/{number}")
        expect = cmp_version(gen, 0) if number == 0 else cmp_value(gen, str(number - 1))
        r = self._fenced_txn(
            f"publish generation {number}",
            [expect],
            [op_put(gen, str(number)), op_put(entry, text)],
            [op_get(gen), op_get(entry)],
        )
        if r.succeeded:
            return
        cur, have = txn_kv(r, 1), txn_kv(r, 2)
        if cur is not None and cur.value == b(str(number)) and have and have.value == b(text):
            return  # this call's own earlier try landed (its answer was lost)
        raise GenerationConflict(
            f"generation {number} not published: the current generation is "
            f"{cur.value.decode() if cur is not None else 'none'}, not {number - 1}"
        )

    def generation(self) -> Optional[int]:
        """The current generation number (None before the first)."""
        kv, _ = self.conn.get(self.key("gen"))
        return int(kv.value) if kv is not None else None

    def generation_info(self, number: int) -> Optional[str]:
        """Generation ``number``'s text as published."""
        kv, _ = self.conn.get(self.key(f"gen/{number}"))
        return kv.value.decode() if kv is not None else None

    def watch_generation_after(self, number: int, timeout_s: float) -> Optional[int]:
        """Wait until the current generation is above ``number``; returns it, or None when
        ``timeout_s`` passed first. Bounded watches with a linearizable read between them,
        so a lost quorum raises :class:`ControlPlaneLost` rather than waiting silently."""
        deadline = time.monotonic() + timeout_s
        gen = self.key("gen")
        while True:
            kv, rev = self.conn.get(gen)
            if kv is not None and int(kv.value) > number:
                return int(kv.value)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for e in self.conn.watch_once(gen, rev + 1, min(left, self._watch_slice_s)):
                if e is not None and e.type == e.PUT and int(e.kv.value) > number:
                    return int(e.kv.value)

    # ------------------------------------------------------------------ first claim stands
    def _create_or_read(self, what: str, key: bytes, value: str) -> Tuple[bool, str]:
        """Create ``key`` = ``value`` if absent: (created, the value that stands)."""
        r = self.conn.txn(what, [cmp_version(key, 0)], [op_put(key, value)], [op_get(key)])
        if r.succeeded:
            return True, value
        kv = txn_kv(r, 0)
        assert kv is not None, f"{what}: key present for the compare, absent for the read"
        return False, kv.value.decode()

    def claim_outcome(self, generation: int, iteration: int, outcome: str) -> str:
        """Claim the outcome of ``iteration`` in ``generation`` (e.g. ``commit``/``abort``);
        returns the outcome that stands: the first claim's, for every caller."""
        return self._create_or_read(
            f"claim outcome {generation}/{iteration}",
            self.key(f"outcome/{generation}/{iteration}"),
            outcome,
        )[1]

    def report_dead(self, slot: int, inc: int, info: Dict[str, Any]) -> bool:
        """Record the death of ``slot``'s incarnation ``inc``; False if already recorded."""
        return self._create_or_read(
            f"report death {slot}/{inc}", self.key(f"dead/{slot}/{inc}"), json.dumps(info)
        )[0]

    def dead_info(self, slot: int, inc: int) -> Optional[Dict[str, Any]]:
        kv, _ = self.conn.get(self.key(f"dead/{slot}/{inc}"))
        return json.loads(kv.value) if kv is not None else None

    def deaths(self) -> Dict[Tuple[int, int], Dict[str, Any]]:
        """Every recorded death: (slot, incarnation) -> its info."""
        r = self.conn.range(self.key("dead/"), prefix=True)
        out = {}
        for kv in r.kvs:
            slot, inc = kv.key.decode().rsplit("/", 2)[-2:]
            out[(int(slot), int(inc))] = json.loads(kv.value)
        return out

    def set_fatal(self, message: str) -> str:
        """Record the message that ends the job; returns the one that stands (the first)."""
        return self._create_or_read("set fatal", self.key("fatal"), message)[1]

    def fatal(self) -> Optional[str]:
        kv, _ = self.conn.get(self.key("fatal"))
        return kv.value.decode() if kv is not None else None

    # ------------------------------------------------------------------ incarnations
    def incarnation(self, slot: int) -> int:
        """The incarnation of ``slot`` (0 before the first process held it)."""
        kv, _ = self.conn.get(self.key(f"inc/{slot}"))
        return int(kv.value) if kv is not None else 0

    def next_incarnation(self, slot: int, timeout_s: Optional[float] = None) -> int:
        """Increment ``inc/<slot>`` (compare-and-swap on its revision) and return the new value:
        two processes that start for one slot never share an incarnation. (A try whose answer
        was lost may skip a number.)"""
        key = self.key(f"inc/{slot}")
        deadline = time.monotonic() + (timeout_s or self.conn.call_timeout_s)
        while True:
            kv, _ = self.conn.get(key)
            cur, mod = (int(kv.value), kv.mod_revision) if kv is not None else (0, 0)
            cond = cmp_mod(key, mod) if kv is not None else cmp_version(key, 0)
            r = self.conn.txn(
                f"next incarnation of {slot}", [cond], [op_put(key, str(cur + 1))], []
            )
            if r.succeeded:
                return cur + 1
            if time.monotonic() > deadline:
                raise ControlPlaneLost(
                    f"etcd control plane: the incarnation of slot {slot} kept changing for "
                    f"{timeout_s or self.conn.call_timeout_s:.1f} s"
                )
