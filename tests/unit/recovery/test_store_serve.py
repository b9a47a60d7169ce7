"""``store_forwarding.serve``: a TCPStore server whose peers are named without DNS.

Torch's own server listens on a dual-stack IPv6 socket, sees an IPv4 client as
``::ffff:a.b.c.d`` and names it with ``getnameinfo`` on its only thread: a reverse DNS query
per connection that ``/etc/hosts`` cannot answer. A storm of reconnects (every client following
a new leader's store) then stalled the whole store for the resolver's 5 s timeout whenever a
query was dropped (``benchmarks/store_connect_storm.py``). ``serve`` gives an IPv4 host an IPv4
listening socket, so the server's peers are plain IPv4 addresses.
"""

from __future__ import annotations

import socket
from typing import Set

import pytest

from megatron_mecefo.recovery.store_forwarding import serve, tcp_client

LISTEN, ESTABLISHED = "0A", "01"  # /proc/net/tcp states


def _ports(table: str, state: str | None = None) -> Set[int]:
    """Local ports of this process's network namespace's sockets in ``/proc/net/<table>``."""
    ports = set()
    with open(f"/proc/self/net/{table}") as f:
        next(f)
        for line in f:
            fields = line.split()
            if state is None or fields[3] == state:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_an_ipv4_host_gets_an_ipv4_listener_and_ipv4_peers() -> None:
    server = serve("127.0.0.1", 0, timeout_s=10)
    # Torch's own server would be in tcp6 (listening on "::"): its peers ::ffff:127.0.0.1.
    assert server.port in _ports("tcp", LISTEN)
    assert server.port not in _ports("tcp6", LISTEN)
    client = tcp_client(f"127.0.0.1:{server.port}", 10)
    client.set("k", "v")
    assert client.get("k") == b"v"
    assert server.get("k") == b"v"
    # The server's end of the connection is an IPv4 socket (the client's own socket is torch's
    # IPv6 one with a v4-mapped peer, which still reaches an IPv4 listener).
    assert server.port in _ports("tcp", ESTABLISHED)
    assert server.port not in _ports("tcp6", ESTABLISHED)


def test_a_name_of_ipv4_addresses_only_gets_an_ipv4_listener() -> None:
    infos = socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)
    if any(info[0] != socket.AF_INET for info in infos):
        pytest.skip("localhost has an IPv6 address here: serve keeps torch's dual-stack listener")
    server = serve("localhost", 0, timeout_s=10)
    assert server.port in _ports("tcp", LISTEN)
    assert tcp_client(f"localhost:{server.port}", 10).add("n", 2) == 2


def test_an_ipv6_host_keeps_the_dual_stack_listener() -> None:
    try:
        probe = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server = serve("::1", 0, timeout_s=10)
    assert server.port in _ports("tcp6", LISTEN)
    assert tcp_client(f"::1:{server.port}", 10).add("n", 1) == 1


def test_a_port_in_use_is_said_as_such() -> None:
    # store_host.py turns this into its "--store-port ... already in use" line.
    server = serve("127.0.0.1", 0, timeout_s=10)
    with pytest.raises(OSError, match="in use"):
        serve("127.0.0.1", server.port, timeout_s=10)
