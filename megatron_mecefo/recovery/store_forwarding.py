"""Store clients shared by the store modes: a plain ``TCPStore`` client, the ``Store`` facade
that forwards every call to one method (``store_etcd.EtcdStore`` follows the leader through
it), and the error a caller sees when its store moved to a new leader mid-call.

The single mode's ranks and supervisors talk to node 0's TCPStore through :func:`tcp_client`;
``--store-mode etcd`` wraps the leader's TCPStore in :class:`~.store_etcd.EtcdStore`.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta
from typing import Any, List, Optional

PRIMARY_KEY = "primary"
"""Set on a new leader's store once it has taken over (``--store-mode etcd``; JSON: the node,
the time, the generation it took over at and its term). The commit vote reads it to tell a
vote cut off by the old leader's loss from one of a later generation."""


class StoreFailedOver(RuntimeError):
    """The store this client used was lost and the client now talks to the new leader's: the
    call that failed was not repeated (its outcome on the lost store is unknown)."""


def store_addresses(address: str) -> List[str]:
    """``"H:P"`` -> ``["H:P"]``; an ``etcd://`` address of ``--store-mode etcd``: its etcd
    endpoints."""
    if address.startswith("etcd://"):
        return [a for a in address[len("etcd://") :].split("/", 1)[0].split(",") if a]
    return [a.strip() for a in address.split(",") if a.strip()]


def tcp_client(address: str, timeout_s: float) -> Any:
    """A ``TCPStore`` client of the store at ``HOST:PORT``."""
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def _ipv4_only(host: str) -> bool:
    """Whether every address ``host`` resolves to is IPv4 (an IPv4 literal, or a name with no
    IPv6 address): then an IPv4 listener reaches every client of ``host``."""
    try:
        return ipaddress.ip_address(host).version == 4
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(info[0] == socket.AF_INET for info in infos)


def serve(host: str, port: int, timeout_s: Optional[float] = None) -> Any:
    """A ``TCPStore`` server for clients that reach it at ``host:port`` (``port`` 0: any).

    Torch's server listens on a dual-stack IPv6 socket, so it sees an IPv4 client as
    ``::ffff:a.b.c.d``, and it names every accepted peer with ``getnameinfo`` on its only
    thread: a reverse DNS query that ``/etc/hosts`` cannot answer (it lists IPv4 addresses).
    A burst of connects (every client of every rank following a new leader) then sends a
    burst of such queries; a resolver that drops one leaves the whole store silent for the
    resolver's timeout (5 s, glibc's default), heartbeats and votes included. When ``host`` is
    IPv4, the store gets an IPv4 listening socket instead: the peers are plain IPv4 addresses,
    found in ``/etc/hosts`` when listed there (``benchmarks/store_connect_storm.py``).
    """
    import torch.distributed as dist

    kwargs: dict = {"wait_for_workers": False}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    if not _ipv4_only(host):
        return dist.TCPStore(host, port, None, is_master=True, **kwargs)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own
        listener.bind(("0.0.0.0", port))  # every interface, as torch's "::"
        bound = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    # The store owns the descriptor from here: it listens on it, and closes it (also when
    # its construction fails).
    fd = listener.detach()
    return dist.TCPStore(host, bound, None, is_master=True, master_listen_fd=fd, **kwargs)


class ForwardingStore:
    """The Store methods this package uses, each forwarded to ``self._call(name, *args)``,
    which a subclass defines (``store_etcd.EtcdStore``: it follows the leader's store)."""

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
