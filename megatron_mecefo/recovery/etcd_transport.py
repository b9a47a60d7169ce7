"""etcd v3 over gRPC with a bound on every call, failing over between the cluster's members.

The client library is ``etcd-sdk-python`` (module ``pyetcd``), chosen by measurement
(``benchmarks/etcd_client.py``, ``results/etcd_client.json``: a 3-member etcd 3.4.23 on
localhost, 2 shared cores) against ``etcd3gw`` (HTTP + JSON through etcd's v3 gateway). p50 in
ms, etcd-sdk-python vs etcd3gw: put 1.14 vs 1.68, linearizable get 0.58 vs 1.30, txn (compare +
put) 1.35 vs 1.95, lease grant 1.31 vs 2.21, a watch's wake-up 1.39 vs 1.87; only a lease
keepalive was slower (2.54 vs 1.12: a gRPC stream per refresh, made every TTL/3, off any hot
path). A failover cost the same with both: 1.0-2.0 s after killing the member the client used
when it was the raft leader (etcd's election), under 10 ms when it was a follower. It also adds
no heavy dependency: grpcio and protobuf already come with tensorboard (the ``test`` extra).
etcd3gw, besides, talks to one member per client object, and runs a watch as an HTTP stream
without a read timeout on a thread-pool worker, which the interpreter joins at exit (a hung
member could keep a process from exiting).

Only its generated gRPC stubs and messages (``pyetcd.etcdrpc``, etcd's own API) are used, not
its client class: that class marks an endpoint failed for 300 s after one error (so an
election that times out one request on each member leaves it with none), and its watches
are long-lived streams on a background thread. Here every call carries its own deadline; a call
that gets no answer from any member within ``call_timeout_s`` raises :class:`ControlPlaneLost`
with one line, which is what a lost etcd quorum looks like from a client (the members still
up accept connections but cannot commit or serve a linearizable read).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

# A supervisor forks its ranks while its etcd channels' threads run: grpc's fork handlers
# then abort a child at random (seen: a rank died of SIGABRT, "epoll_wait error: Bad file
# descriptor"). The children exec at once and never use the parent's channels.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402
from pyetcd import etcdrpc as rpc

# Codes after which another member (or the same one, later) may answer: the member is down
# (UNAVAILABLE: refused, reset, "etcdserver: no leader", "request timed out", "leader
# changed"), slow (DEADLINE_EXCEEDED), or overloaded (RESOURCE_EXHAUSTED: "too many requests").
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}

# A restarted member is tried again within a second (gRPC's default backoff grows to 120 s).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ControlError(RuntimeError):
    """An error of the etcd control plane; its message is one line."""


class ControlPlaneLost(ControlError):
    """No etcd member answered this process with a quorum within the call's bound: this node
    lost etcd (whether etcd itself lost its quorum, or only this node's links to it, cannot be
    told from here)."""


class EtcdNoSpace(ControlError):
    """etcd refuses writes: its database reached its space quota (the NOSPACE alarm). Not
    transient: no retry helps until an operator frees the space."""


NOSPACE_FIX = (
    "free it and disarm the alarm: etcdctl compact <current revision>; etcdctl defrag "
    "--cluster; etcdctl alarm disarm (or restart etcd with a larger --quota-backend-bytes)"
)


def _nospace(details: str) -> bool:
    """etcd's NOSPACE answer (``etcdserver: mvcc: database space exceeded``)."""
    return "database space exceeded" in details or "NOSPACE" in details


def parse_endpoints(endpoints: str | Sequence[str]) -> List[str]:
    """``"h1:p1,h2:p2"`` or a list of ``HOST:PORT`` -> a list of ``HOST:PORT``."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = [e.strip().removeprefix("http://") for e in items if e.strip()]
    for e in out:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint '{e}' is not HOST:PORT")
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


def b(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


# Transaction building blocks (etcd's Compare and RequestOp messages).
def cmp_value(key: bytes, value: str | bytes, equal: bool = True) -> Any:
    result = rpc.Compare.EQUAL if equal else rpc.Compare.NOT_EQUAL
    return rpc.Compare(result=result, target=rpc.Compare.VALUE, key=key, value=b(value))


def cmp_create(key: bytes, revision: int) -> Any:
    return rpc.Compare(
        result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, key=key, create_revision=revision
    )


def cmp_version(key: bytes, version: int) -> Any:
    return rpc.Compare(
        result=rpc.Compare.EQUAL, target=rpc.Compare.VERSION, key=key, version=version
    )


def cmp_mod(key: bytes, revision: int) -> Any:
    return rpc.Compare(
        result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, key=key, mod_revision=revision
    )


def op_put(key: bytes, value: str | bytes, lease: int = 0) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=b(value), lease=lease))


def op_get(key: bytes) -> Any:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))


def op_delete(key: bytes) -> Any:
    """Delete ``key`` (in a txn; nothing if it is absent)."""
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def op_delete_prefix(prefix: bytes) -> Any:
    """Delete every key that starts with ``prefix`` (in a txn)."""
    req = rpc.DeleteRangeRequest(key=prefix, range_end=prefix_end(prefix))
    return rpc.RequestOp(request_delete_range=req)


def txn_kv(response: Any, index: int) -> Optional[Any]:
    """The key-value of the ``index``-th (range) operation of a txn response, or None."""
    kvs = response.responses[index].response_range.kvs
    return kvs[0] if kvs else None


class EtcdConnection:
    """gRPC channels to every member; each call tries them in turn until its deadline.

    Args:
        endpoints: ``HOST:PORT`` of the members' client URLs (all of them: any may be down).
        call_timeout_s: the bound of one call over all its tries.
        request_timeout_s: the deadline of one try on one member.
    """

    def __init__(
        self, endpoints: str | Sequence[str], call_timeout_s: float, request_timeout_s: float
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.call_timeout_s = float(call_timeout_s)
        self.request_timeout_s = float(request_timeout_s)
        self._channels = [
            grpc.insecure_channel(e, options=_CHANNEL_OPTIONS) for e in self.endpoints
        ]
        self._kv = [rpc.KVStub(c) for c in self._channels]
        self._lease = [rpc.LeaseStub(c) for c in self._channels]
        self._watch = [rpc.WatchStub(c) for c in self._channels]
        self._current = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        for c in self._channels:
            c.close()

    # ------------------------------------------------------------------ the retry loop
    def _rotate(self, index: int) -> None:
        with self._lock:
            if self._current == index:
                self._current = (index + 1) % len(self.endpoints)

    def call(
        self,
        what: str,
        fn: Callable[[int, float], Any],
        timeout_s: Optional[float] = None,
    ) -> Any:
        """``fn(member, deadline_s)`` on one member after another until one answers.

        Raises:
            ControlPlaneLost: no answer within ``timeout_s`` (default ``call_timeout_s``).
            grpc.RpcError: an answer that another member would give too (not retried).
        """
        bound = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        last = "no try"
        tries = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ControlPlaneLost(
                    f"etcd control plane lost: this node lost etcd: {what} got no answer with "
                    f"a quorum from {','.join(self.endpoints)} within {bound:.1f} s ({tries} "
                    f"tries; last: {last})"
                )
            index = self._current
            try:
                return fn(index, min(self.request_timeout_s, left))
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                details = (e.details() if hasattr(e, "details") else "") or ""
                details = " ".join(details.split())  # one line
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _nospace(details):
                    # Every member gives this answer until an operator acts: said at once,
                    # as what it is, never as a lost quorum after the call's bound.
                    raise EtcdNoSpace(
                        f"etcd NOSPACE: {what} refused by {self.endpoints[index]} ({details}): "
                        f"etcd's database is over its space quota; {NOSPACE_FIX}"
                    ) from None
                if code not in RETRYABLE:
                    raise
                last = f"{self.endpoints[index]}: {code.name if code else '?'} {details}".strip()
                tries += 1
                self._rotate(index)
                if tries % len(self.endpoints) == 0:
                    # Every member refused or timed out: give an election time to finish.
                    time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------------ KV
    def range(
        self,
        key: bytes,
        prefix: bool = False,
        timeout_s: Optional[float] = None,
        serializable: bool = False,
    ) -> Any:
        """A linearizable range read (every member answers from the committed log), or with
        ``serializable`` one the member answers from its own copy (no consensus round: for a
        periodic look that may be a moment stale)."""
        req = rpc.RangeRequest(
            key=key, range_end=prefix_end(key) if prefix else b"", serializable=serializable
        )
        return self.call(
            f"get {key.decode(errors='replace')}",
            lambda i, t: self._kv[i].Range(req, timeout=t),
            timeout_s,
        )

    def get(self, key: bytes, timeout_s: Optional[float] = None) -> Tuple[Optional[Any], int]:
        """(the key's KeyValue or None, the store's revision at the read)."""
        r = self.range(key, timeout_s=timeout_s)
        return (r.kvs[0] if r.kvs else None), r.header.revision

    def put(self, key: bytes, value: str | bytes, lease: int = 0) -> Any:
        req = rpc.PutRequest(key=key, value=b(value), lease=lease)
        return self.call(
            f"put {key.decode(errors='replace')}", lambda i, t: self._kv[i].Put(req, timeout=t)
        )

    def delete(self, key: bytes, prefix: bool = False) -> Any:
        req = rpc.DeleteRangeRequest(key=key, range_end=prefix_end(key) if prefix else b"")
        return self.call(
            f"delete {key.decode(errors='replace')}",
            lambda i, t: self._kv[i].DeleteRange(req, timeout=t),
        )

    def compact(self, revision: int) -> bool:
        """Drop the history before ``revision`` (etcd's Compact); False when it was already
        compacted past it (by an earlier call of this leader or of another)."""
        req = rpc.CompactionRequest(revision=revision, physical=False)
        try:
            self.call(f"compact to {revision}", lambda i, t: self._kv[i].Compact(req, timeout=t))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.OUT_OF_RANGE:  # "required revision has been compacted"
                return False
            raise
        return True

    def txn(self, what: str, compare: List[Any], success: List[Any], failure: List[Any]) -> Any:
        """One transaction. A try whose answer was lost may have been applied: callers make
        their transactions safe to repeat (their compares fail on a repeat, and they read
        back what stands)."""
        req = rpc.TxnRequest(compare=compare, success=success, failure=failure)
        return self.call(what, lambda i, t: self._kv[i].Txn(req, timeout=t))

    # ------------------------------------------------------------------ leases
    def lease_grant(self, ttl_s: int) -> Tuple[int, int]:
        """(lease id, granted TTL in s; etcd raises a TTL below its minimum to it)."""
        req = rpc.LeaseGrantRequest(TTL=int(ttl_s), ID=0)
        r = self.call("lease grant", lambda i, t: self._lease[i].LeaseGrant(req, timeout=t))
        if r.error:
            raise ControlError(f"etcd lease grant failed: {r.error}")
        return r.ID, r.TTL

    def lease_revoke(self, lease: int, timeout_s: Optional[float] = None) -> None:
        req = rpc.LeaseRevokeRequest(ID=lease)
        try:
            self.call(
                "lease revoke",
                lambda i, t: self._lease[i].LeaseRevoke(req, timeout=t),
                timeout_s,
            )
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:  # already expired: what revoke wants
                raise

    def lease_keepalive(self, lease: int, timeout_s: float) -> int:
        """One keepalive: the lease's TTL after it (<= 0: the lease is gone)."""

        def once(i: int, t: float) -> int:
            call = self._lease[i].LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=lease)]), timeout=t
            )
            try:
                for r in call:
                    return int(r.TTL)
                return 0
            finally:
                call.cancel()

        return self.call("lease keepalive", once, timeout_s)

    def lease_ttl(self, lease: int) -> int:
        """The lease's remaining TTL (s; -1: expired or unknown)."""
        return self.lease_ttls(lease)[0]

    def lease_ttls(self, lease: int) -> Tuple[int, int]:
        """(the lease's remaining TTL, its granted TTL), in whole seconds (-1: expired)."""
        req = rpc.LeaseTimeToLiveRequest(ID=lease)
        r = self.call(
            "lease time-to-live", lambda i, t: self._lease[i].LeaseTimeToLive(req, timeout=t)
        )
        return int(r.TTL), int(r.grantedTTL)

    # ------------------------------------------------------------------ watches
    def watch_once(
        self, key: bytes, start_revision: int, timeout_s: float, prefix: bool = False
    ) -> List[Any]:
        """The events on ``key`` (or the prefix) at ``start_revision`` or later; waits up to
        ``timeout_s`` for the first, returns [] when none came.

        A member that lost its quorum keeps a watch open and silent: callers that wait longer
        re-read (a linearizable read, bounded) between bounded watches.
        """
        deadline = time.monotonic() + timeout_s
        create = rpc.WatchRequest(
            create_request=rpc.WatchCreateRequest(
                key=key,
                range_end=prefix_end(key) if prefix else b"",
                start_revision=start_revision,
            )
        )

        def requests(done: threading.Event) -> Iterator[Any]:
            yield create
            done.wait(timeout_s + 1.0)  # keeps the stream open until the watch ends

        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            index = self._current
            done = threading.Event()
            call = self._watch[index].Watch(requests(done), timeout=left)
            try:
                for r in call:
                    if r.compact_revision:
                        return [None]  # history compacted: the caller re-reads
                    if r.canceled:
                        raise ControlError(f"etcd watch canceled: {r.cancel_reason}")
                    if r.events:
                        return list(r.events)
                return []
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return []
                if e.code() not in RETRYABLE:
                    raise
                self._rotate(index)
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            finally:
                call.cancel()
                done.set()
