"""A private 3-member etcd cluster on 127.0.0.1 (``scripts/etcd_cluster.sh``), stopped by PID.

Its members serve clients on another address of this machine with ``client_host`` (a
bridge's, for nodes in network namespaces: tests/helpers/netns.py).

Used by ``benchmarks/etcd_client.py`` and by the etcd control plane's tests, whose fixtures
``yield from running_cluster(directory)`` (in the test module: a conftest.py beside the tests
would shadow tests/conftest.py, which the tests import by name). Every member is its own
process (started with ``setsid``), so a test can SIGKILL or SIGSTOP one by its PID.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "etcd_cluster.sh"
MEMBERS = 3


def etcd_missing_reason() -> Optional[str]:
    """Why no cluster can start here (no ``etcd`` binary), or None."""
    if shutil.which("etcd") is None:
        return "no etcd binary (Debian: apt-get install etcd-server, or make etcd)"
    return None


def _ports_free(base: int, count: int) -> bool:
    for port in range(base, base + count):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port_block(count: int = 2 * MEMBERS) -> int:
    """A base port whose ``count`` ports are free, below Linux's ephemeral range (32768+), so
    that no client connection takes one between this check and etcd's bind."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        base = rng.randrange(20000, 32000, 2)
        if _ports_free(base, count):
            return base
    raise RuntimeError("no block of free ports in 20000-32000")


class EtcdCluster:
    """Three etcd members; client port of member i: ``base + 2 i``, peer port ``base + 2 i + 1``.

    Args:
        directory: data, PID files and logs (``scripts/etcd_cluster.sh``'s DIR).
        client_host: the address the members serve clients on (the peers use 127.0.0.1).
    """

    def __init__(self, directory: Path, client_host: str = "127.0.0.1") -> None:
        self.directory = Path(directory)
        self.client_host = client_host
        self.base = 0

    @property
    def endpoints(self) -> List[str]:
        """``HOST:PORT`` of every member's client URL, member 0 first."""
        return [f"{self.client_host}:{self.base + 2 * i}" for i in range(MEMBERS)]

    def start(self, timeout_s: float = 90.0) -> "EtcdCluster":
        """Start the members on a free block of ports; retries once on a port taken meanwhile."""
        last = ""
        for _ in range(3):
            self.base = free_port_block()
            proc = subprocess.run(
                [str(SCRIPT), "start", str(self.directory), str(self.base)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={
                    **os.environ,
                    "ETCD_READY_TIMEOUT": str(int(timeout_s) - 10),
                    "ETCD_CLIENT_HOST": self.client_host,
                },
            )
            if proc.returncode == 0:
                return self
            last = proc.stderr.strip()
        raise RuntimeError(f"etcd cluster did not start: {last}")

    def pid(self, member: int) -> Optional[int]:
        """The PID of ``member`` while its PID file exists."""
        path = self.directory / f"member{member}.pid"
        try:
            return int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def alive(self, member: int) -> bool:
        pid = self.pid(member)
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        # A killed member stays a zombie until init reaps it (setsid detached it from us).
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return False
        return state != "Z"

    def signal(self, member: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to ``member`` (SIGKILL: waits until it is gone)."""
        pid = self.pid(member)
        assert pid is not None, f"member {member} has no PID file"
        os.kill(pid, sig)
        if sig == signal.SIGKILL:
            deadline = time.monotonic() + 10
            while self.alive(member) and time.monotonic() < deadline:
                time.sleep(0.02)

    def leader(self, timeout_s: float = 10.0) -> int:
        """The index of the raft leader among the live members (etcdctl endpoint status)."""
        live = [i for i in range(MEMBERS) if self.alive(i)]
        deadline = time.monotonic() + timeout_s
        while True:
            proc = subprocess.run(
                ["etcdctl", "--endpoints", ",".join(self.endpoints[i] for i in live)]
                + ["--command-timeout=2s", "endpoint", "status", "-w", "json"],
                capture_output=True,
                text=True,
                env={**os.environ, "ETCDCTL_API": "3"},
                timeout=30,
            )
            try:
                rows = json.loads(proc.stdout)
                for row in rows:
                    if row["Status"]["leader"] == row["Status"]["header"]["member_id"]:
                        return self.endpoints.index(row["Endpoint"])
            except (ValueError, KeyError, TypeError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no etcd leader: {proc.stdout} {proc.stderr}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop every member by its PID (the script: SIGCONT + SIGTERM, SIGKILL after 3 s)."""
        subprocess.run([str(SCRIPT), "stop", str(self.directory)], timeout=60, check=False)


def running_cluster(directory: Path, client_host: str = "127.0.0.1") -> Iterator[EtcdCluster]:
    """For a fixture (``yield from``): a started cluster, stopped by its PIDs afterwards, also
    when the test fails; skips the test, with the reason, where no ``etcd`` binary exists."""
    missing = etcd_missing_reason()
    if missing:
        pytest.skip(missing)
    cluster = EtcdCluster(directory, client_host)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(name="etcd")
def etcd_fixture(tmp_path: Path) -> Iterator[EtcdCluster]:
    """``etcd``: a private 3-member cluster for one test (a test module imports this)."""
    yield from running_cluster(tmp_path / "etcd")


def mecefo_layout(iters: int, gbs: int, *extra: str) -> List[str]:
    """The example trainer's small model with MeCeFO on ``MECEFO_TEST_DATA`` (set by the
    test module's fixture from ``text_data``)."""
    from harness import SMALL_MODEL

    return SMALL_MODEL + [
        "--global-batch-size", str(gbs), "--train-iters", str(iters), "--mecefo",
        "--data-path", os.environ["MECEFO_TEST_DATA"], *extra,
    ]  # fmt: skip
