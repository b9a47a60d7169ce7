"""The rank side of hang detection: a background thread that bumps a store counter.

A process that hangs without exiting (SIGSTOP, a deadlock in native code that holds the
GIL) stops beating; the coordinator then has its supervisor SIGKILL it, which closes its
sockets, so gloo releases the survivors blocked on it. The thread has its own store client.
"""

from __future__ import annotations

import threading
import time

from megatron_mecefo.recovery.membership import MembershipStore


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
        self._stop = threading.Event()
        self.cpu_s = 0.0
        self.failures = 0
        """Beats that failed (each is retried at the next interval)."""
        """CPU seconds this thread has used (the supervisor's overhead accounting)."""
        self.thread = threading.Thread(target=self._run, name="mecefo-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.ms.heartbeat(self.slot, self.inc)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.ms.heartbeat(self.slot, self.inc)
            except Exception:  # noqa: BLE001
                # Retried at the next beat, never the end of the beats: in etcd mode a
                # takeover makes calls fail for a while (the old store gone, the new one not
                # yet published, etcd electing a member). A thread that ended there left a live
                # rank silent, and the new leader had it SIGKILLed for a heartbeat timeout.
                # At the job's end the rank exits, and this daemon thread with it.
                self.failures += 1
            self.cpu_s = time.thread_time()

    def stop(self) -> None:
        self._stop.set()
