"""Nodes on their own network stacks, on one machine: one Linux network namespace per node,
each joined by a veth pair to a bridge in the root namespace (the recipe of
``docs``/``partition-tests.md``). Cutting a node's link (:meth:`Netns.cut`) partitions it
while every process of it stays alive.

Names carry the test process's PID (``mf<pid>n0``, ``mf<pid>p0``, ``mf<pid>br``), and the
subnet is a ``10.251.<x>.0/24`` that no interface of the machine uses, so that parallel tests
do not collide. The bridge holds ``.254`` (a service every node must reach, an etcd member,
listens there); node ``i`` is ``.<i + 1>``. :meth:`Netns.teardown` kills every process left in
the namespaces by PID, then deletes the namespaces and the bridge; :func:`network` runs it
also when the test fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Callable, Dict, Iterator, List, Optional

import pytest

SUBNET = "10.251"
"""The /16 the tests take their /24s from (nothing else on a test machine uses it)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_missing_reason() -> Optional[str]:
    """Why no namespaces can be made here (not root, no ``ip``, no ``ip netns``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add): run as root"
    if shutil.which("ip") is None:
        return "no 'ip' binary (Debian: apt-get install iproute2)"
    probe = f"mf{os.getpid()}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


def _used_subnets() -> set:
    """The ``x`` of every ``10.251.x.*`` address on the machine's (root namespace) interfaces."""
    out = _ip("-4", "-o", "addr", "show", check=False).stdout
    used = set()
    for word in out.split():
        if word.startswith(f"{SUBNET}."):
            used.add(int(word.split(".")[2]))
    return used


class Netns:
    """``nodes`` namespaces on one bridge.

    Args:
        nodes: how many nodes (namespaces).
        tag: the suffix of every name (default: this process's PID).
    """

    def __init__(self, nodes: int, tag: Optional[str] = None) -> None:
        tag = tag or str(os.getpid())
        self.nodes = nodes
        self.bridge = f"mf{tag}br"
        self.namespaces = [f"mf{tag}n{i}" for i in range(nodes)]
        self.inner = [f"mf{tag}v{i}" for i in range(nodes)]  # in the node's namespace
        self.outer = [f"mf{tag}p{i}" for i in range(nodes)]  # on the bridge
        assert all(len(n) <= 15 for n in [self.bridge, *self.inner, *self.outer]), "IFNAMSIZ"
        self.net = -1

    @property
    def host_address(self) -> str:
        """The bridge's address in the root namespace (reachable from every node)."""
        return f"{SUBNET}.{self.net}.254"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{self.net}.{node + 1}"

    def exec_prefix(self, node: int, **env: str) -> List[str]:
        """The argv prefix that runs a command in node ``node``'s namespace (``ip netns exec``
        and ``env`` both exec: the process keeps the PID that Popen returns)."""
        extra = [f"{k}={v}" for k, v in env.items()]
        return ["ip", "netns", "exec", self.namespaces[node], *(["env", *extra] if extra else [])]

    def setup(self) -> "Netns":
        """Make the bridge (with :attr:`host_address`), the namespaces and their links."""
        used = _used_subnets()
        free = [x for x in range(10, 250) if x not in used]
        assert free, f"every {SUBNET}.x.0/24 is in use"
        self.net = free[os.getpid() % len(free)]
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            _ip("link", "add", self.inner[i], "type", "veth", "peer", "name", self.outer[i])
            _ip("link", "set", self.outer[i], "master", self.bridge)
            _ip("link", "set", self.outer[i], "up")
            _ip("link", "set", self.inner[i], "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", self.inner[i])
            _ip("-n", ns, "link", "set", self.inner[i], "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def cut(self, node: int) -> None:
        """Node ``node``'s link down, on the bridge's side: both directions cut at once."""
        _ip("link", "set", self.outer[node], "down")

    def restore(self, node: int) -> None:
        _ip("link", "set", self.outer[node], "up")

    def pids(self, node: int) -> List[int]:
        """Every live process in node ``node``'s namespace."""
        out = _ip("netns", "pids", self.namespaces[node], check=False).stdout
        return [int(p) for p in out.split()]

    def reachable(self, node: int, host: str, port: int, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connection from node ``node``'s namespace to ``host:port`` opens
        within ``timeout_s``. Tried again until then: just after a link comes back, a connect
        can fail at once ("no route to host": the neighbour entry failed while the link was
        down), as the partition test saw once."""
        probe = (
            "import socket,sys,time\n"
            f"end, address = time.monotonic() + {timeout_s}, ({host!r}, {port})\n"
            "while True:\n"
            "    left = end - time.monotonic()\n"
            "    try:\n"
            "        socket.create_connection(address, timeout=max(left, 0.05)).close()\n"
            "        break\n"
            "    except OSError:\n"
            "        if left <= 0.1: sys.exit(1)\n"
            "        time.sleep(0.1)\n"
        )
        cmd = ["ip", "netns", "exec", self.namespaces[node], "python3", "-c", probe]
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0

    def teardown(self) -> None:
        """Kill every process left in the namespaces (by PID), delete them and the bridge."""
        for node in range(self.nodes):
            for pid in self.pids(node):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        while any(self.pids(n) for n in range(self.nodes)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for ns in self.namespaces:  # takes each veth pair with it
            _ip("netns", "del", ns, check=False)
        for link in [*self.outer, self.bridge]:
            if _ip("link", "show", link, check=False).returncode == 0:
                _ip("link", "del", link, check=False)


def network(nodes: int) -> Iterator[Netns]:
    """For a fixture (``yield from``): namespaces set up, torn down afterwards, also when the
    test fails; skips the test, with the reason, where namespaces cannot be made."""
    missing = netns_missing_reason()
    if missing:
        pytest.skip(missing)
    net = Netns(nodes)
    try:
        yield net.setup()
    finally:
        net.teardown()


def supervisor_launcher(
    net: Netns, node_env: Optional[Dict[int, Dict[str, str]]] = None
) -> Callable[[int, List[str]], List[str]]:
    """For :class:`harness.Job`'s ``launch``: each node's supervisor in its namespace, serving
    on its own address; gloo's sockets on the node's veth (the machine's hostname resolves to
    no address in a namespace). ``node_env``: more environment for some nodes only."""

    def launch(node: int, argv: List[str]) -> List[str]:
        cut = argv.index("--")
        own = ["--store-host", net.address(node)]
        extra = (node_env or {}).get(node, {})
        prefix = net.exec_prefix(node, GLOO_SOCKET_IFNAME=net.inner[node], **extra)
        return prefix + argv[:cut] + own + argv[cut:]

    return launch
