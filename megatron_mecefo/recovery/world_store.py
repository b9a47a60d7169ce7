"""The world's rendezvous store client, which a newer generation can cut off.

Building a world waits in the store: ``init_process_group`` (gloo's full-mesh connect reads
every member's address) and each ``new_group`` of Megatron's parallel state. A member that
dies before it writes its keys leaves the others in that wait until the store's timeout
(``--init-timeout``, 30 s), although the coordinator has published the next generation at
once. Nothing in torch interrupts a store wait, but the wait ends with an error the moment
its socket is shut down. So each world gets a TCPStore client of its own; this module finds
that client's sockets (the new sockets to the store's port that its construction opened)
and :meth:`WorldStore.abort` shuts them down, which the generation watchdog calls when a
failure generation is announced while the world is being built (or used). The membership
store's own clients (heartbeat, watchdog, votes) are other sockets and stay up.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from typing import Any, Set, Tuple


class WorldBuildAborted(RuntimeError):
    """A newer failure generation was announced before this world's store client existed."""


def _socket_fds() -> Set[Tuple[int, str]]:
    """(fd, inode link) of every socket this process has open (the link tells a reused fd
    number from the same socket)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add((int(fd), link))
    return out


def _peer_port(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    try:
        return sock.getpeername()[1] if sock.family in (socket.AF_INET, socket.AF_INET6) else -1
    except OSError:
        return -1
    finally:
        sock.detach()  # the fd stays the store's


def _shutdown(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


class WorldStore:
    """One world's store client and the switch that cuts it off (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: Set[Tuple[int, str]] = set()
        self.aborted = False

    def connect(self, host: str, port: int, timeout_s: float) -> Any:
        """A new ``TCPStore`` client of ``host:port``; raises :class:`WorldBuildAborted` if
        :meth:`abort` ran before it existed (its rendezvous would wait for a dead member)."""
        import torch.distributed as dist

        before = _socket_fds()
        store = dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        # Sockets another thread opened meanwhile are told apart by their peer: only this
        # client's sockets lead to the store's port among the new ones.
        new = {(fd, link) for fd, link in _socket_fds() - before if _peer_port(fd) == port}
        with self._lock:
            self._fds = new
            if self.aborted:
                self._shutdown_all()
                raise WorldBuildAborted("a newer generation was announced")
        return store

    def abort(self) -> None:
        """Shut this world's store sockets down: a wait in them fails now (thread-safe)."""
        with self._lock:
            self.aborted = True
            self._shutdown_all()

    def _shutdown_all(self) -> None:
        current = _socket_fds()
        for fd, link in self._fds:
            if (fd, link) in current:  # not closed and reused since
                _shutdown(fd)


class BuildAborter:
    """What the generation watchdog calls on a failure generation: the world's usual abort
    (sockets, waits; :mod:`.abort`) and the cut of its store client."""

    def __init__(self, aborter: Any, world_store: WorldStore) -> None:
        self.aborter, self.world_store = aborter, world_store

    def abort(self) -> None:
        self.world_store.abort()
        self.aborter.abort()
