"""A membership-store client that fails over to the standby store when node 0 is lost.

In the replicated mode (``supervisor --store-mode replicated``) the store address is a list,
``H0:P0,H1:P1``: the primary TCPStore, served by node 0's supervisor, and the standby, served
by node 1's (:mod:`.store_mirror`). A :class:`FailoverStore` talks to the primary. When a call
fails with a network error (the server's socket closed: its process or node died), it
connects to the standby, waits until the standby has taken over (it sets :data:`PRIMARY_KEY`
once it holds the membership state and has declared node 0's ranks dead), and then either
repeats the call there or, for a caller that must know (the commit vote), raises
:class:`StoreFailedOver`. A timeout of ``wait`` (``DistStoreError``) is no failure and is
passed on. One address: a plain client, as before.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, List, Optional

CONNECT_ATTEMPT_S = 5.0
"""How long one attempt to connect may take (to the primary, after its loss and before the
takeover; to the standby, which may be lost). Generous for a loaded node's accept: a client
that takes a live standby for lost has no failover (raised from 2 s after a rank that
probably had none, unconfirmed, died at node 0's loss in one Slurm run)."""

PRIMARY_KEY = "primary"
"""Set on the standby store when it has taken over (JSON: the node and the time)."""


class StoreFailedOver(RuntimeError):
    """The primary store was lost and this client now talks to the standby: the call that
    failed was not repeated (its outcome on the lost store is unknown)."""


def store_addresses(address: str) -> List[str]:
    """``"H0:P0,H1:P1"`` -> ``["H0:P0", "H1:P1"]`` (a single address: a list of one; an
    ``etcd://`` address of ``--store-mode etcd``: its etcd endpoints)."""
    if address.startswith("etcd://"):
        return [a for a in address[len("etcd://") :].split("/", 1)[0].split(",") if a]
    return [a.strip() for a in address.split(",") if a.strip()]


def store_ports(address: str) -> List[int]:
    """The TCP ports of every store in ``address`` (their connections are not a world's)."""
    return [int(a.rsplit(":", 1)[1]) for a in store_addresses(address)]


def tcp_client(address: str, timeout_s: float) -> Any:
    """A ``TCPStore`` client of the store at ``HOST:PORT``."""
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def _try_connect(address: str, timeout_s: float) -> Optional[Any]:
    """A client of ``address`` after one short attempt (``None`` if nothing answers), with the
    timeout ``timeout_s`` for its calls."""
    from torch.distributed import DistNetworkError

    try:
        client = tcp_client(address, CONNECT_ATTEMPT_S)
    except DistNetworkError:
        return None
    client.set_timeout(timedelta(seconds=timeout_s))
    return client


class ForwardingStore:
    """The Store methods this package uses, each forwarded to ``self._call(name, *args)``,
    which a subclass defines (its failover: :class:`FailoverStore`, ``store_etcd.EtcdStore``)."""

    def _call(self, name: str, *args: Any) -> Any:
        raise NotImplementedError

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def check(self, keys: List[str]) -> bool:
        return self._call("check", keys)

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        if timeout is None:
            self._call("wait", keys)
        else:
            self._call("wait", keys, timeout)

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return self._call("multi_get", keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")


class FailoverStore(ForwardingStore):
    """The subset of ``torch.distributed.Store`` this package uses, over a primary and a
    standby address (see the module docstring).

    Args:
        addresses: The primary's and the standby's ``HOST:PORT``.
        timeout_s: The clients' timeout; also how long a failover waits for the standby to
            take over.
        raise_on_failover: Raise :class:`StoreFailedOver` instead of repeating the call.
    """

    def __init__(
        self, addresses: List[str], timeout_s: float, raise_on_failover: bool = False
    ) -> None:
        if len(addresses) != 2:
            raise ValueError(f"expected a primary and a standby address, got {addresses}")
        self.addresses = addresses
        self.timeout_s = timeout_s
        self.raise_on_failover = raise_on_failover
        # The standby first: once it has taken over, the primary is gone, and a client made
        # then (a replacement rank, a rejoining node) must not wait out a connect timeout.
        self._standby: Optional[Any] = _try_connect(addresses[1], timeout_s)
        self.standby_lost = False
        """A write to the standby failed (node 1 was lost): no failover; the primary alone. (A
        first connect that fails is no proof: :meth:`on_standby` tries again, and a failover
        connects with the full timeout.)"""
        primary = None
        if self._standby is None or not self._standby.check([PRIMARY_KEY]):
            primary = self._connect_primary()
        if primary is None:
            self.index, self._client, self._standby = 1, self._standby, None
        else:
            self.index, self._client = 0, primary
        self._lock = threading.Lock()

    def _connect_primary(self) -> Optional[Any]:
        """A client of the primary; ``None`` if the standby took over meanwhile. Tried in short
        attempts: a client made just after node 0's loss, before the takeover, would otherwise
        wait out its whole timeout on a refused connection."""
        if self._standby is None:
            return tcp_client(self.addresses[0], self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while True:
            client = _try_connect(self.addresses[0], self.timeout_s)
            if client is not None:
                return client
            if self._standby.check([PRIMARY_KEY]):
                return None
            if time.monotonic() > deadline:
                return tcp_client(self.addresses[0], CONNECT_ATTEMPT_S)  # raises its error

    @property
    def address(self) -> str:
        """The address of the store this client now talks to."""
        return self.addresses[self.index]

    @property
    def failed_over(self) -> bool:
        return self.index > 0

    def on_standby(self, name: str, *args: Any) -> Any:
        """Call ``name`` on the standby while the primary serves (a write that must outlive
        node 0 goes there first); ``None`` once the standby is the primary, or when it is
        lost (node 1 died: the job goes on with the primary alone, without a failover)."""
        from torch.distributed import DistNetworkError

        if self.failed_over or self.standby_lost:
            return None
        if self._standby is None:
            self._standby = _try_connect(self.addresses[1], self.timeout_s)
        try:
            if self._standby is not None:
                return getattr(self._standby, name)(*args)
        except DistNetworkError:
            pass
        self.standby_lost, self._standby = True, None  # unreachable twice: node 1 is lost
        return None

    def _call(self, name: str, *args: Any) -> Any:
        from torch.distributed import DistNetworkError

        while True:
            client = self._client
            try:
                return getattr(client, name)(*args)
            except DistNetworkError:
                if not self._switch(client):
                    raise
                if self.raise_on_failover:
                    raise StoreFailedOver(
                        f"the membership store at {self.addresses[0]} was lost; now at "
                        f"{self.address}"
                    ) from None

    def _switch(self, failed: Any) -> bool:
        """Point at the standby once it has taken over; False if there is nothing to switch to
        (already there: the standby is lost too)."""
        with self._lock:
            if self._client is not failed:
                return True  # another thread of this process switched already
            if self.failed_over or self.standby_lost:
                return False
            client = self._standby or tcp_client(self.addresses[1], self.timeout_s)
            client.wait([PRIMARY_KEY], timedelta(seconds=self.timeout_s))
            self._client, self._standby, self.index = client, None, 1
        return True
