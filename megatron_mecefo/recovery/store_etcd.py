"""The membership store in ``--store-mode etcd``: a TCPStore on the leader's node for the hot
path, the state that must outlive the leader on etcd first, and a client that follows the
leader to the next node.

The store address the ranks and supervisors get is
``etcd://H:P,H:P,H:P/<prefix>?ttl=<s>&run=<token>``. :class:`EtcdStore` reads
``<prefix>/hot_store`` (the ``HOST:PORT`` of the TCPStore the leader serves) from etcd and
talks to it; it follows a new address only while ``<prefix>/run`` still holds its run's token
(:data:`RUN_KEY`), so a client never reads the store, and the ``done``, of another job that
took the prefix over. Writes of the durable keys (:data:`DURABLE_KEYS`,
:data:`DURABLE_PREFIXES`: deaths, incarnations, the layout, the committed and logged
iteration, records, the fatal message, ...) go to ``<prefix>/kv/<key>`` on etcd first, in a
transaction that requires the term whose leader published this client's store to still stand
(``leader``'s create revision: a later term that reuses the address is another term), and, in
a rank, its own incarnation not to be declared dead: a client of a deposed leader's store, or
a rank declared dead that still runs (cut off, hung), changes nothing on etcd. A death and the
fatal message are created, never overwritten: the first writer's stands. A generation goes
to etcd through :meth:`~.etcd_control.EtcdControl.publish_generation` (fenced on the
leader's term, ``gen`` == n - 1). The commit vote counts on the hot store, and its outcome is
claimed on etcd (``outcome/<g>/<i>``, created once, through :meth:`EtcdStore.claim`):
the voter that completes a count claims the commit before anyone applies the step, so a world
formed after a takeover that lost the hot store finds what was decided (:mod:`.commit`,
:mod:`.prepared`).

A store call that fails (the server's sockets closed) or gets no answer within the lease TTL
(a hung node) looks ``hot_store`` up again and waits until a new leader has published
another address; it then repeats the call there, or raises
:class:`~.store_forwarding.StoreFailedOver` to a caller that must know (the commit vote).
The new leader (:mod:`.store_host`) fences ``hot_store`` first, restores the state from etcd
into its own TCPStore (:func:`restore`), declares the old leader's ranks dead, and then
publishes its address.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import parse_qs

from megatron_mecefo.recovery.store_forwarding import ForwardingStore, StoreFailedOver, tcp_client

SCHEME = "etcd://"
HOT_STORE = "hot_store"
"""etcd key: the ``HOST:PORT`` of the leader's TCPStore ("" while a takeover restores)."""
LEADER_NODE = "leader_node"
"""etcd key: the node whose supervisor leads (its ranks are declared dead at a takeover)."""
RUN_KEY = "run"
"""etcd key: the token of the run under the prefix, written by node 0 when the job starts.
An address that names it (``&run=``) never follows a store of another run under the prefix."""

DURABLE_KEYS = (
    "layout", "world_size", "progress", "logged", "done", "fatal", "stopping", "rdzv",
)  # fmt: skip
DURABLE_PREFIXES = (
    "dead/", "inc/", "ready/", "node/", "record/", "outcome/", "groupstore/",
)  # fmt: skip

FAILOVER_WAIT_MIN_S = 10.0
"""At least this long a client waits for a new leader's address after its store failed."""


class Fenced(RuntimeError):
    """A write of a client whose store is no longer the hot one, or of a deposed leader."""


def is_etcd_address(address: str) -> bool:
    return address.startswith(SCHEME)


def etcd_address(endpoints: List[str], prefix: str, ttl_s: float, run: str = "") -> str:
    """``etcd://H:P,H:P/<prefix>?ttl=<s>[&run=<token>]``: what the ranks and the other
    supervisors get (``run``: the run's token, :data:`RUN_KEY`)."""
    tail = f"&run={run}" if run else ""
    return f"{SCHEME}{','.join(endpoints)}/{prefix.strip('/')}?ttl={ttl_s:g}{tail}"


def run_of(address: str) -> str:
    """The run token an ``etcd://`` address names ("" for none)."""
    return parse_qs(address.partition("?")[2]).get("run", [""])[0]


def run_token(control: Any) -> str:
    """The token of the run that holds the prefix now ("" before node 0 wrote one)."""
    kv, _ = control.conn.get(control.key(RUN_KEY))
    return kv.value.decode() if kv is not None else ""


class RunReplaced(StoreFailedOver):
    """The prefix holds another run now: this run's store is gone, and never followed there."""


def parse_etcd_address(address: str) -> Tuple[List[str], str, float]:
    """(endpoints, prefix, lease TTL in s) of an ``etcd://`` address."""
    rest = address[len(SCHEME) :]
    rest, _, query = rest.partition("?")
    endpoints, _, prefix = rest.partition("/")
    ttl = float(parse_qs(query).get("ttl", ["10"])[0])
    return [e for e in endpoints.split(",") if e], "/" + prefix.strip("/"), ttl


def durable(key: str) -> bool:
    return key in DURABLE_KEYS or key.startswith(DURABLE_PREFIXES)


def first_stands(key: str) -> bool:
    """Keys whose first write stands (created, never overwritten): a death and the fatal
    message; a later writer (a zombie's report, a second error) reads the first instead."""
    return key == "fatal" or key.startswith("dead/")


def own_incarnation() -> Optional[Tuple[int, int]]:
    """(slot, incarnation) of this process when it is a rank (a warm standby once assigned),
    else None: its durable writes are refused once that incarnation is declared dead."""
    slot = os.environ.get("MECEFO_RECOVERY_SLOT")
    if slot is None or not slot.lstrip("-").isdigit() or int(slot) < 0:
        return None
    return int(slot), int(os.environ.get("MECEFO_RECOVERY_INC", "0") or 0)


_CONTROLS: Dict[str, Any] = {}
_CONTROLS_LOCK = threading.Lock()


def control_for(address: str) -> Any:
    """This process's :class:`~.etcd_control.EtcdControl` for ``address`` (one connection per
    process; the leader's supervisor registers its own, which holds the term)."""
    from megatron_mecefo.recovery.etcd_control import EtcdControl

    with _CONTROLS_LOCK:
        if address not in _CONTROLS:
            endpoints, prefix, ttl = parse_etcd_address(address)
            _CONTROLS[address] = EtcdControl(endpoints, prefix, ttl)
        return _CONTROLS[address]


def register_control(address: str, control: Any) -> None:
    with _CONTROLS_LOCK:
        _CONTROLS[address] = control


WATCH_SLICE_S = 5.0
"""How long one etcd watch of ``hot_store`` runs before a linearizable re-read (a member that
lost its quorum keeps a watch open and silent, so the watch alone could miss a move)."""

RETRY_S = 0.25
"""Pause before the next read when etcd did not answer (without quorum the supervisors end the
job; until then the thread keeps trying)."""

_WATCHES: Dict[str, threading.Thread] = {}


def _watch_hot_store(address: str, control: Any) -> None:
    """Once per process and etcd address: a thread that, when ``hot_store`` moves away from
    an address, shuts down this process's sockets to it, so that a call blocked on a hung
    leader's store fails now (and its client follows the new leader)."""
    with _CONTROLS_LOCK:
        if address in _WATCHES:
            return
        thread = threading.Thread(
            target=_watch, args=(control,), name="mecefo-hot-store-watch", daemon=True
        )
        _WATCHES[address] = thread
    thread.start()


def _watch(control: Any, stop: Optional[threading.Event] = None) -> None:
    """Follow ``hot_store`` until ``stop`` is set (never, for the process's own thread)."""
    # An etcd watch, not a poll: every process of every node runs this thread, and a poll of
    # 4 reads a second per process was etcd's largest per-rank load (16,384 ranks: 65,536
    # reads/s). A watch costs etcd nothing while ``hot_store`` stands, wakes at its change,
    # and is re-read every WATCH_SLICE_S in case the member it streams from lost quorum.
    stop = stop or threading.Event()
    last: Optional[str] = None
    while not stop.is_set():
        try:
            kv, revision = control.conn.get(control.key(HOT_STORE))
            now = kv.value.decode() if kv is not None else ""
            if last and now != last:
                shutdown_store_sockets(last)
            last = now or None
            control.conn.watch_once(control.key(HOT_STORE), revision + 1, WATCH_SLICE_S)
        except Exception:  # noqa: BLE001 (etcd without quorum: the supervisors end the job)
            stop.wait(RETRY_S)


def shutdown_store_sockets(address: str) -> int:
    """Shut down this process's TCP sockets whose peer is the store at ``address``; returns
    how many (their calls fail with a network error; the descriptors stay their owners')."""
    import socket

    from megatron_mecefo.recovery.abort import _normalized_ip, _socket_inodes, store_endpoints

    endpoints = store_endpoints([address])
    shut = 0
    for _, fd in _socket_inodes().items():
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                peer = sock.getpeername()
                if (_normalized_ip(str(peer[0])), int(peer[1])) in endpoints:
                    sock.shutdown(socket.SHUT_RDWR)
                    shut += 1
        except OSError:
            pass  # a listener, or closed meanwhile
        finally:
            sock.detach()
    return shut


def hot_store(control: Any) -> str:
    kv, _ = control.conn.get(control.key(HOT_STORE))
    return kv.value.decode() if kv is not None else ""


def hot_store_term(control: Any) -> Tuple[str, int]:
    """(the hot store's address, the term that published it); ("", 0) while none stands."""
    return control.published_store(HOT_STORE)


class EtcdStore(ForwardingStore):
    """The subset of ``torch.distributed.Store`` this package uses, over the leader's
    TCPStore found through etcd (see the module docstring).

    Args:
        address: The ``etcd://`` address.
        timeout_s: How long the first connect (and a failover) may wait for a leader.
        raise_on_failover: Raise :class:`StoreFailedOver` instead of repeating the call.
        pinned: The leader's own client (its coordinator): talk to this ``HOST:PORT``, fence
            durable writes on the leader's term, and never follow another leader (a deposed
            coordinator's calls fail).
    """

    def __init__(
        self,
        address: str,
        timeout_s: float,
        raise_on_failover: bool = False,
        pinned: Optional[str] = None,
    ) -> None:
        self.etcd_address = address
        self.control = control_for(address)
        self.ttl_s = parse_etcd_address(address)[2]
        self.timeout_s = timeout_s
        # The hot path is bounded by the lease TTL: a hung leader's store answers nothing,
        # and a new leader is elected after the TTL.
        self.call_timeout_s = min(timeout_s, max(self.ttl_s, 2.0))
        self.raise_on_failover = raise_on_failover
        self.pinned = pinned
        self.run = run_of(address)
        self._lock = threading.Lock()
        self.address = ""
        self.term = 0
        """The term whose leader published :attr:`address` (durable writes are fenced on it)."""
        self._client: Any = None
        if pinned is not None:
            self.address, self._client = pinned, self._connect(pinned, timeout_s)
        else:
            self.address, self._client = self._follow(-1, time.monotonic() + timeout_s)
            _watch_hot_store(address, self.control)

    claims_outcomes = True
    """The commit vote claims its outcomes here (:func:`.commit.claim`): the hot store is lost
    with the leader, etcd is not."""

    @property
    def failed_over(self) -> bool:
        return False

    def _connect(self, address: str, timeout_s: float) -> Any:
        client = tcp_client(address, min(timeout_s, 5.0))
        client.set_timeout(timedelta(seconds=self.call_timeout_s))
        return client

    def _follow(self, old_term: int, deadline: float) -> Tuple[str, Any]:
        """The hot store of a term other than ``old_term`` and a client of it, once one
        answers (a later term's store may have the same address: a reused port)."""
        from torch.distributed import DistError

        error = "no leader has published its store"
        while True:
            address, term = hot_store_term(self.control)
            if address and term != old_term and self.run and run_token(self.control) != self.run:
                # Another job took the prefix over: its store, and its "done", are not ours.
                raise RunReplaced(
                    f"etcd mode: the key prefix {self.control.prefix} holds another run now (not "
                    f"run {self.run}); this run's membership store is gone"
                )
            if address and term != old_term:
                try:
                    client = self._connect(address, self.call_timeout_s)
                    self.term = term
                    return address, client
                except DistError as err:
                    error = f"{address}: {str(err).splitlines()[0][:200]}"
            if time.monotonic() > deadline:
                raise StoreFailedOver(
                    f"etcd mode: no membership store to fail over to ({error}); "
                    f"hot_store={address!r}"
                )
            time.sleep(0.05)

    def _switch(self, failed: Any) -> None:
        """Follow the leader to its new store (or raise the fence for a pinned client)."""
        with self._lock:
            if self._client is not failed:
                return  # another thread of this process switched already
            if self.pinned is not None:
                raise Fenced(f"etcd mode: the leader's store at {self.pinned} is no longer used")
            wait = max(FAILOVER_WAIT_MIN_S, 3 * self.ttl_s)
            self.address, self._client = self._follow(self.term, time.monotonic() + wait)

    def _call(self, name: str, *args: Any) -> Any:
        from torch.distributed import DistError, DistNetworkError, DistStoreError

        while True:
            client, address = self._client, self.address
            try:
                return getattr(client, name)(*args)
            except DistError as err:
                timed_out = isinstance(err, DistStoreError) and not isinstance(
                    err, DistNetworkError
                )
                if name == "wait" and timed_out:
                    raise  # a wait's own timeout: no failure
                try:
                    self._switch(client)
                except StoreFailedOver:
                    raise err from None  # nobody took over: the store's own error
                if self.raise_on_failover:
                    raise StoreFailedOver(
                        f"the membership store at {address} was lost; now at {self.address}"
                    ) from None

    # ------------------------------------------------------------------ etcd first
    def _etcd_write(
        self, key: str, value: str, create: bool = False, delete: Optional[str] = None
    ) -> Optional[str]:
        """Write ``<prefix>/kv/<key>`` (``create``: only if absent; returns what stands; and
        with the write, in the same transaction, delete ``kv/<delete>``), fenced on the term
        that published this client's store (pinned: the leader's own term) and, in a rank, on
        its incarnation not being declared dead."""
        from megatron_mecefo.recovery.etcd_control import Fenced as TermFenced
        from megatron_mecefo.recovery.etcd_transport import (
            cmp_create,
            cmp_version,
            op_delete,
            op_get,
            op_put,
            txn_kv,
        )

        c = self.control
        k = c.key(f"kv/{key}")
        writes = [op_put(k, value)] + ([op_delete(c.key(f"kv/{delete}"))] if delete else [])
        own = [cmp_version(k, 0)] if create else []
        me = own_incarnation()
        dead = c.key(f"kv/dead/{me[0]}/{me[1]}") if me is not None else None
        alive = [cmp_version(dead, 0)] if dead is not None else []
        while True:
            client = self._client
            if self.pinned is not None:
                try:
                    r = c._fenced_txn(f"write {key}", own, writes, [op_get(k)])
                except TermFenced as err:
                    raise Fenced(str(err)) from None
                if r.succeeded:
                    return value
                kv = txn_kv(r, 1)
                return kv.value.decode() if kv is not None else None
            lead = c.leader_key
            reads = [op_get(lead), op_get(k)] + ([op_get(dead)] if dead is not None else [])
            r = c.conn.txn(
                f"write {key}",
                [cmp_create(lead, self.term)] + alive + own,
                writes,
                reads,
            )
            if r.succeeded:
                return value
            if dead is not None and txn_kv(r, 2) is not None:
                assert me is not None
                raise Fenced(
                    f"etcd mode: rank {me[0]} (incarnation {me[1]}) was declared dead: its "
                    f"write of {key} is refused (a later process or the survivors took over)"
                )
            now = txn_kv(r, 0)
            if now is not None and now.create_revision == self.term:
                kv = txn_kv(r, 1)  # the term stands: the key existed (create)
                return kv.value.decode() if kv is not None else None
            self._switch(client)  # the term that published our store is over
            if self.raise_on_failover:
                raise StoreFailedOver(f"the membership store moved to {self.address}")

    def _publish_generation(self, key: str, value: Any) -> None:
        number = int(key.split("/", 1)[1])
        text = value.decode() if isinstance(value, bytes) else str(value)
        from megatron_mecefo.recovery.etcd_control import ControlError

        try:
            self.control.publish_generation(number, text)
        except ControlError as err:
            raise Fenced(str(err)) from None

    # ------------------------------------------------------------------ Store methods
    def set(self, key: str, value: Any) -> None:
        text = value.decode() if isinstance(value, bytes) else str(value)
        if key.startswith("gen/"):
            if self.pinned is not None:
                self._publish_generation(key, text)
        elif first_stands(key):
            won = self._etcd_write(key, text, create=True)
            if won is not None and won != text:
                value = won  # an earlier writer's stands, on the hot store too
        elif durable(key):
            self._etcd_write(key, text)
        self._call("set", key, value)

    def claim(self, key: str, outcome: str, forget: Optional[str] = None) -> str:
        """Create ``key`` (an ``outcome/`` claim, :func:`.commit.claim`) on etcd if absent, and
        with it delete the claim ``forget`` (every member applied that step); returns the
        outcome that stands. Fenced as every durable write; on etcd only (no reader looks for
        it on the hot store: a new leader's store is restored from etcd)."""
        return self._etcd_write(key, outcome, create=True, delete=forget) or outcome


def restore(control: Any, store: Any) -> int:
    """Copy the durable state from etcd into a new leader's TCPStore ``store``: every
    ``kv/`` key and every generation. Returns the current generation (-1: none)."""
    base = control.key("kv/")
    r = control.conn.range(base, prefix=True)
    for kv in r.kvs:
        store.set(kv.key[len(base) :].decode(), kv.value)
    number = control.generation()
    if number is None:
        return -1
    for n in range(number + 1):
        text = control.generation_info(n)
        if text is not None:
            store.set(f"gen/{n}", text)
    store.set("gen", str(number))
    return number
