"""The rank side of hang detection: a background thread that bumps a store counter.

A process that hangs without exiting (SIGSTOP, a deadlock in native code that holds the
GIL) stops beating; the coordinator then has its supervisor SIGKILL it, which closes its
sockets, so gloo releases the survivors blocked on it. The thread has its own store client.

Each supervisor beats too (:meth:`Heartbeat.of_supervisor`), and its ranks name it in their
``ready`` key (:data:`SUPERVISOR_ENV`): a rank silent for the timeout whose supervisor is silent
too (its node died or hangs) has nobody to kill it and confirm the death, so the coordinator
declares it dead at once instead of waiting a second timeout for that confirmation.

Under a supervisor the ranks beat locally (:data:`BEAT_DIR_ENV`: a counter in a file of the
node), and the supervisor's beat writes one key per node, ``hb/node/<id>``, with its own count
and its ranks' (:meth:`Heartbeat.of_supervisor`): the hot store then takes one write per node
and interval, not one per rank, and the coordinator reads one key per node.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Dict, Optional

from megatron_mecefo.recovery.membership import MembershipStore

SUPERVISOR_ENV = "MECEFO_SUPERVISOR_ID"
"""A rank's environment: the id of the supervisor that started it (its beats' key)."""

BEAT_DIR_ENV = "MECEFO_BEAT_DIR"
"""A rank's environment: the folder of its supervisor where it beats (``<slot>.<inc>``, a
counter), which the supervisor reads and writes to the store with its own beat."""

_WIDTH = 20  # a counter's digits: every write the same length, in place


def read_local_beats(folder: str) -> Dict[str, int]:
    """The counts of the ranks that beat in ``folder``: ``"<slot>/<inc>"`` -> count."""
    counts: Dict[str, int] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return counts
    for name in names:
        slot, dot, inc = name.partition(".")
        if not dot or not (slot.isdigit() and inc.isdigit()):
            continue
        try:
            with open(os.path.join(folder, name), "rb") as f:
                counts[f"{slot}/{inc}"] = int(f.read(_WIDTH) or b"0")
        except (OSError, ValueError):
            continue  # gone (a reaped rank) or being created: the next beat reads it
    return counts


class _LocalBeat:
    """A rank's beats in its supervisor's folder: a counter rewritten in place."""

    def __init__(self, folder: str, slot: int, inc: int) -> None:
        self.count = 0
        self.fd = os.open(os.path.join(folder, f"{slot}.{inc}"), os.O_RDWR | os.O_CREAT, 0o600)

    def __call__(self) -> int:
        self.count += 1
        os.pwrite(self.fd, b"%0*d" % (_WIDTH, self.count), 0)
        return self.count


class Heartbeat:
    """Beats every ``interval_s`` for ``(slot, inc)`` until :meth:`stop`.

    Args:
        address: ``HOST:PORT`` of the membership store.
        slot: Original global rank.
        inc: Incarnation of the process.
        interval_s: Seconds between beats.
    """

    def __init__(
        self, address: str, slot: int, inc: int, interval_s: float, folder: Optional[str] = None
    ) -> None:
        """``folder``: beat there, for the supervisor to collect (default: the folder
        :data:`BEAT_DIR_ENV` names; none: beat to the store at ``address``)."""
        folder = os.environ.get(BEAT_DIR_ENV) if folder is None else folder
        self.slot, self.inc, self.interval_s = slot, inc, interval_s
        self.ms: Optional[MembershipStore] = None
        if folder and slot >= 0:
            self._beat: Callable[[], int] = _LocalBeat(folder, slot, inc)
        else:
            self.ms = ms = MembershipStore.connect(address)
            self._beat = lambda: ms.heartbeat(slot, inc)
        self._stop = threading.Event()
        self.cpu_s = 0.0
        """CPU seconds this thread has used (the supervisor's overhead accounting)."""
        self.failures = 0
        """Beats that failed (each is retried at the next interval)."""
        self.thread = threading.Thread(target=self._run, name="mecefo-heartbeat", daemon=True)

    @classmethod
    def of_supervisor(
        cls, address: str, supervisor: str, interval_s: float, folder: str = ""
    ) -> Heartbeat:
        """The beats of the supervisor ``supervisor``: with ``folder`` (where its ranks beat),
        one key for the node, ``hb/node/<id>`` (its count and its ranks'); without,
        ``hb/supervisor/<id>``."""
        beat = cls(address, -1, 0, interval_s, folder="")
        ms = beat.ms
        assert ms is not None
        if not folder:
            beat._beat = lambda: ms.supervisor_heartbeat(supervisor)
            return beat
        count = [0]

        def node_beat() -> int:
            count[0] += 1
            ms.node_heartbeat(supervisor, count[0], read_local_beats(folder))
            return count[0]

        beat._beat = node_beat
        return beat

    def start(self) -> Heartbeat:
        self._beat()
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001
                # Retried at the next beat, never the end of the beats: in etcd mode a
                # takeover makes calls fail for a while (the old store gone, the new one not
                # yet published, etcd electing a member). A thread that ended there left a live
                # rank silent, and the new leader had it SIGKILLed for a heartbeat timeout.
                # At the job's end the rank exits, and this daemon thread with it.
                self.failures += 1
            self.cpu_s = time.thread_time()

    def stop(self, join: bool = False) -> None:
        """End the beats; ``join``: also wait (at most one beat's call) for the thread to end,
        e.g. before this process's stores are torn down under it."""
        self._stop.set()
        if join and self.thread.is_alive():
            self.thread.join(self.interval_s + 1.0)
