"""Which sockets the gloo abort shuts down (``recovery/abort.py``): the world's only.

Real sockets on loopback: 127.0.0.0/8 all answers on Linux, so a listener on 127.0.0.2 with
the store's port number stands for a peer on another host whose port happens to match.
"""

from __future__ import annotations

import socket
from contextlib import ExitStack
from typing import Tuple

import pytest

from megatron_mecefo.recovery.abort import GlooRelease, store_endpoints


def _listener(stack: ExitStack, host: str, port: int = 0) -> Tuple[socket.socket, int]:
    server = stack.enter_context(socket.socket())
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen(4)
    return server, server.getsockname()[1]


def _connect(stack: ExitStack, host: str, port: int) -> socket.socket:
    return stack.enter_context(socket.create_connection((host, port), timeout=5))


def _is_shut(sock: socket.socket) -> bool:
    """A socket shut down here reads end-of-stream at once; an open one with nothing to read
    times out (the peers never send), whatever the load."""
    sock.settimeout(0.2)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def test_abort_shuts_the_world_sockets_only() -> None:
    with ExitStack() as stack:
        store_server, port = _listener(stack, "127.0.0.1")
        try:
            _listener(stack, "127.0.0.2", port)
        except OSError:
            pytest.skip("127.0.0.2 is not routed to loopback here")
        _, metrics_port = _listener(stack, "127.0.0.1")
        aborter = GlooRelease([f"127.0.0.1:{port}"])
        # A client of the rank opened before the world (a metrics logger).
        logger = _connect(stack, "127.0.0.1", metrics_port)
        aborter.open_world()
        store = _connect(stack, "127.0.0.1", port)
        # A world connection to another host whose port number is the store's.
        peer_same_port = _connect(stack, "127.0.0.2", port)
        aborter.seal_world()
        # A client opened while training (an upload).
        upload = _connect(stack, "127.0.0.1", metrics_port)
        shut = aborter.shutdown_world_sockets()
        assert shut == [("127.0.0.2", port)]
        assert _is_shut(peer_same_port)
        assert not _is_shut(store)
        assert not _is_shut(logger)
        assert not _is_shut(upload)
        store_server.settimeout(5)
        accepted, _ = store_server.accept()  # the store still talks to its client
        with accepted:
            accepted.sendall(b"x")
            store.settimeout(5)
            assert store.recv(1) == b"x"


def test_store_endpoints_match_host_and_port() -> None:
    aborter = GlooRelease(["127.0.0.1:29500", "localhost:29501"])
    assert aborter.is_store_peer(("127.0.0.1", 29500))
    assert aborter.is_store_peer(("::ffff:127.0.0.1", 29500, 0, 0))  # AF_INET6's spelling
    assert not aborter.is_store_peer(("127.0.0.2", 29500))  # another address, same port
    assert not aborter.is_store_peer(("127.0.0.1", 29502))
    assert aborter.is_store_peer(("127.0.0.1", 29501))  # localhost's loopback spellings
    # A store on a non-loopback host: loopback connections with its port are not the store's.
    remote = store_endpoints(["192.0.2.7:29500"])
    assert remote == {("192.0.2.7", 29500)}
