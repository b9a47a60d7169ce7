"""An in-memory etcd v3 key-value store: the semantics the recovery control plane relies on.

It is the store of the exhaustive protocol check (:mod:`protocol_check`), and the reference a
real etcd client can be checked against: drive both with the same calls and compare what they
return. Only what the protocol uses is here, with etcd v3's semantics:

* **Revisions.** One store-wide counter, starting at 1. Every request that changes something
  (a put, a delete that finds a key, a transaction with a write, a lease that ends with keys
  attached) raises it by one; every key written by that request gets it as ``mod_revision``.
* **Keys.** ``KV(key, value, create_revision, mod_revision, version, lease)``; ``version`` is 1
  at creation and counts the puts since; a delete removes the key (a later put creates it
  again, with a new ``create_revision``). A put without a lease detaches the key from its
  lease (etcd's default, ``ignore_lease`` false).
* **Transactions.** ``txn(compares, success, failure)``: every :class:`Compare` true -> the
  ``success`` operations, else the ``failure`` ones, atomically, at one revision. A compare
  on ``value`` of a missing key is false (etcd: "always fail if comparing a value on a key
  that doesn't exist"); the other targets compare a missing key as 0 (``version``,
  ``create``, ``mod``, ``lease``).
* **Leases.** ``grant(ttl)`` -> an id (from 1 up); a put attached to a lease that does not
  exist (expired, revoked) fails with :class:`LeaseNotFound` and changes nothing, inside a
  transaction too. A lease ends by :meth:`revoke`, by :meth:`expire` (its TTL passed: the
  checker's abstract clock) or by :meth:`advance` (a clock in seconds); its keys are deleted
  then. ``keepalive`` renews an existing lease (and says False for one that ended).

The object is mutable (as a client would be); :meth:`copy` and :meth:`freeze` (a hashable
value, equal for equal contents) serve an explorer that branches on every request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union


class LeaseNotFound(RuntimeError):
    """etcd's ``requested lease not found``: a put attached to a lease that has ended."""


class KV(NamedTuple):
    """A key as a range request returns it."""

    key: str
    value: str
    create_revision: int
    mod_revision: int
    version: int
    lease: int


class Compare(NamedTuple):
    """``target(key) op operand``; target: value, version, create, mod or lease; op: ==, !=,
    <, >."""

    key: str
    target: str
    op: str
    operand: Union[int, str]


class Put(NamedTuple):
    key: str
    value: str
    lease: int = 0


class Get(NamedTuple):
    key: str


class Range(NamedTuple):
    """Every key that starts with ``prefix``, in key order."""

    prefix: str


class Delete(NamedTuple):
    key: str


Op = Union[Put, Get, Range, Delete]


class TxnResult(NamedTuple):
    succeeded: bool
    responses: Tuple[object, ...]
    """Per operation: a put's or delete's revision, a get's ``KV`` or ``None``, a range's tuple
    of ``KV``."""
    revision: int
    """The store's revision after the transaction."""


_TARGETS = {"version": 4, "create": 2, "mod": 3, "lease": 5, "value": 1}


@dataclass
class Lease:
    ttl: float
    remaining: float


@dataclass
class FakeEtcd:
    """The store (see the module docstring)."""

    revision: int = 1
    kv: Dict[str, KV] = field(default_factory=dict)
    leases: Dict[int, Lease] = field(default_factory=dict)
    next_lease: int = 1

    # ------------------------------------------------------------------ explorer support
    def copy(self) -> FakeEtcd:
        return FakeEtcd(
            self.revision,
            dict(self.kv),
            {i: Lease(le.ttl, le.remaining) for i, le in self.leases.items()},
            self.next_lease,
        )

    def freeze(self) -> tuple:
        """A hashable value of the whole store (equal stores, equal values)."""
        return (
            self.revision,
            tuple(sorted(self.kv.values())),
            tuple(sorted((i, le.ttl, le.remaining) for i, le in self.leases.items())),
            self.next_lease,
        )

    @classmethod
    def thaw(cls, frozen: tuple) -> FakeEtcd:
        revision, kvs, leases, next_lease = frozen
        return cls(
            revision,
            {kv.key: kv for kv in kvs},
            {i: Lease(ttl, rem) for i, ttl, rem in leases},
            next_lease,
        )

    # ------------------------------------------------------------------ leases
    def grant(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        lease = self.next_lease
        self.next_lease += 1
        self.leases[lease] = Lease(ttl, ttl)
        return lease

    def keepalive(self, lease: int) -> bool:
        """Renew ``lease`` to its full TTL; False if it has ended."""
        if lease not in self.leases:
            return False
        self.leases[lease].remaining = self.leases[lease].ttl
        return True

    def alive(self, lease: int) -> bool:
        return lease in self.leases

    def revoke(self, lease: int) -> None:
        """End ``lease`` now and delete its keys (one revision if any key goes)."""
        if self.leases.pop(lease, None) is None:
            return
        doomed = [k for k, kv in self.kv.items() if kv.lease == lease]
        if doomed:
            self.revision += 1
            for k in doomed:
                del self.kv[k]

    def expire(self, lease: int) -> None:
        """``lease``'s TTL passed without a keepalive (the checker's abstract clock)."""
        self.revoke(lease)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass: every lease not renewed for its TTL ends."""
        for lease in sorted(self.leases):
            self.leases[lease].remaining -= seconds
            if self.leases[lease].remaining <= 0:
                self.revoke(lease)

    # ------------------------------------------------------------------ requests
    def get(self, key: str) -> Optional[KV]:
        return self.kv.get(key)

    def range(self, prefix: str) -> Tuple[KV, ...]:
        return tuple(self.kv[k] for k in sorted(self.kv) if k.startswith(prefix))

    def put(self, key: str, value: str, lease: int = 0) -> int:
        return self.txn((), (Put(key, value, lease),)).revision

    def delete(self, key: str) -> int:
        return self.txn((), (Delete(key),)).revision

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op] = (),
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        """The etcd transaction (module docstring); raises :class:`LeaseNotFound` without
        changing anything if a put of the chosen branch names an ended lease."""
        ok = all(self._compare(c) for c in compares)
        ops = success if ok else failure
        for op in ops:
            if isinstance(op, Put) and op.lease and op.lease not in self.leases:
                raise LeaseNotFound(f"requested lease not found: {op.lease}")
        writes = any(isinstance(op, Put) or (isinstance(op, Delete) and op.key in self.kv)
                     for op in ops)  # fmt: skip
        rev = self.revision + 1 if writes else self.revision
        responses: List[object] = []
        for op in ops:
            if isinstance(op, Put):
                old = self.kv.get(op.key)
                create = old.create_revision if old else rev
                version = old.version + 1 if old else 1
                self.kv[op.key] = KV(op.key, op.value, create, rev, version, op.lease)
                responses.append(rev)
            elif isinstance(op, Delete):
                self.kv.pop(op.key, None)
                responses.append(rev)
            elif isinstance(op, Get):
                responses.append(self.kv.get(op.key))
            elif isinstance(op, Range):
                responses.append(self.range(op.prefix))
            else:  # pragma: no cover - a caller's mistake
                raise TypeError(f"not an etcd operation: {op!r}")
        self.revision = rev
        return TxnResult(ok, tuple(responses), rev)

    def _compare(self, c: Compare) -> bool:
        kv = self.kv.get(c.key)
        if kv is None:
            if c.target == "value":
                return False
            actual: Union[int, str] = 0
        else:
            actual = kv[_TARGETS[c.target]]
        if c.op == "==":
            return actual == c.operand
        if c.op == "!=":
            return actual != c.operand
        if c.op == "<":
            return actual < c.operand  # type: ignore[operator]
        if c.op == ">":
            return actual > c.operand  # type: ignore[operator]
        raise ValueError(f"compare op {c.op!r}")


def keys(kvs: Iterable[KV]) -> List[str]:
    return [kv.key for kv in kvs]
