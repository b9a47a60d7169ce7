"""The rank side of hang detection: a background thread that bumps a store counter.

A process that hangs without exiting (SIGSTOP, a deadlock in native code that holds the
GIL) stops beating; the coordinator then has its supervisor SIGKILL it, which closes its
sockets, so gloo releases the survivors blocked on it. The thread has its own store client.

Each supervisor beats too (:meth:`Heartbeat.of_supervisor`), and its ranks name it in their
``ready`` key (:data:`SUPERVISOR_ENV`): a rank silent for the timeout whose supervisor is silent
too (its node died or hangs) has nobody to kill it and confirm the death, so the coordinator
declares it dead at once instead of waiting a second timeout for that confirmation.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from megatron_mecefo.recovery.membership import MembershipStore

SUPERVISOR_ENV = "MECEFO_SUPERVISOR_ID"
"""A rank's environment: the id of the supervisor that started it (its beats' key)."""


class Heartbeat:
    """Beats every ``interval_s`` for ``(slot, inc)`` until :meth:`stop`.

    Args:
        address: ``HOST:PORT`` of the membership store.
        slot: Original global rank.
        inc: Incarnation of the process.
        interval_s: Seconds between beats.
    """

    def __init__(self, address: str, slot: int, inc: int, interval_s: float) -> None:
        self.ms = MembershipStore.connect(address)
        self.slot, self.inc, self.interval_s = slot, inc, interval_s
        self._beat: Callable[[], int] = lambda: self.ms.heartbeat(slot, inc)
        self._stop = threading.Event()
        self.cpu_s = 0.0
        """CPU seconds this thread has used (the supervisor's overhead accounting)."""
        self.failures = 0
        """Beats that failed (each is retried at the next interval)."""
        self.thread = threading.Thread(target=self._run, name="mecefo-heartbeat", daemon=True)

    @classmethod
    def of_supervisor(cls, address: str, supervisor: str, interval_s: float) -> Heartbeat:
        """The beats of the supervisor ``supervisor`` (``hb/supervisor/<id>``)."""
        beat = cls(address, -1, 0, interval_s)
        beat._beat = lambda: beat.ms.supervisor_heartbeat(supervisor)
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
