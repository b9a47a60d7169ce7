"""The per-process watch of ``hot_store`` (recovery/store_etcd.py) against a real 3-member etcd.

Every process of every node runs it, so what it costs etcd is per rank: it must watch, not
poll; and when ``hot_store`` moves it must shut down this process's sockets to the old store,
which is what releases a call blocked on a hung leader.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Iterator, List, Tuple

import pytest
from etcd_cluster import EtcdCluster, running_cluster

from megatron_mecefo.recovery import store_etcd
from megatron_mecefo.recovery.etcd_control import EtcdControl


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    yield from running_cluster(tmp_path_factory.mktemp("etcd"))


class _CountedConn:
    """The control's etcd connection, counting its reads (what every rank would cost etcd)."""

    def __init__(self, conn: Any) -> None:
        self._conn, self.reads = conn, 0

    def get(self, *args: Any, **kwargs: Any) -> Any:
        self.reads += 1
        return self._conn.get(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _connected_pair() -> Tuple[socket.socket, socket.socket, socket.socket, str]:
    """A listener standing in for a leader's store, a client connected to it, the accepted
    end, and the store's ``HOST:PORT``."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    return listener, client, accepted, f"127.0.0.1:{listener.getsockname()[1]}"


def test_watch_reads_rarely_and_releases_sockets_to_a_moved_store(etcd: EtcdCluster) -> None:
    control = EtcdControl(etcd.endpoints, "/watch-test", 3.0)
    counted = _CountedConn(control.conn)
    control.conn = counted
    opened: List[socket.socket] = []
    stop, thread = threading.Event(), None
    try:
        listener, client, accepted, old = _connected_pair()
        opened += [listener, client, accepted]
        control.conn.put(control.key(store_etcd.HOT_STORE), old)
        thread = threading.Thread(target=store_etcd._watch, args=(control, stop), daemon=True)
        thread.start()

        # hot_store stands for 3 s: a watch and one read, not a poll (a 0.25 s poll read 12
        # times). Load can only make the count smaller.
        time.sleep(3.0)
        assert 1 <= counted.reads <= 2, f"{counted.reads} reads of hot_store in 3 s"

        # The store moves: this process's socket to the old one is shut down (its peer, the
        # accepted end, reads EOF), whatever else the process has open stays.
        other_listener, other_client, other_accepted, _ = _connected_pair()
        opened += [other_listener, other_client, other_accepted]
        control.conn.put(control.key(store_etcd.HOT_STORE), "127.0.0.1:1")
        accepted.settimeout(30.0)
        assert accepted.recv(1) == b"", "the socket to the old store was not shut down"
        other_client.sendall(b"x")
        assert other_accepted.recv(1) == b"x", "a socket to another peer was shut down"
    finally:
        stop.set()
        if thread is not None:
            thread.join(store_etcd.WATCH_SLICE_S + 5.0)
        for sock in opened:
            sock.close()
        control.conn = counted._conn
        control.close()
