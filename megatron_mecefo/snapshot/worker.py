"""The background worker that exchanges each snapshot's parity off the training thread.

One thread per world, fed in snapshot order by :class:`~.manager.SnapshotManager`: for each
finished snapshot it runs the group's parity exchange (:func:`.parity.exchange_parity`) over
a gloo group of its own (:func:`.parity.clone_group`, same members as the data-parallel
group), stores the parity with the slot and adds the rank's commit to the store. Every member
submits the same snapshots in the same order, so every member runs the same collectives on
that group. While idle it runs the manager's ``on_idle`` (learning which snapshots every rank
has committed, so the training thread does not ask the store). After the first error the
worker skips what is left (the peers then fail in their collective, as on a death);
:meth:`ParityWorker.close` lets it end without waiting for it: a worker blocked in a
collective of a dead world ends when gloo fails it (a peer's socket closes, or the group's
timeout), and its late result is discarded by the manager.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional


class ParityWorker:
    """Runs submitted jobs in order on one daemon thread."""

    def __init__(
        self,
        group: object,
        name: str = "mecefo-parity",
        on_idle: Optional[Callable[[], None]] = None,
        idle_s: float = 0.01,
    ) -> None:
        self.group = group
        """The gloo group the jobs' collectives use (dropped with the worker)."""
        self.on_idle = on_idle
        """Called every ``idle_s`` while no job is queued (e.g. learning peers' commits)."""
        self.idle_s = idle_s
        self.error: Optional[BaseException] = None
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._pending += 1
        self._queue.put(job)

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return self._pending

    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.idle_s if self.on_idle else None)
            except queue.Empty:
                try:
                    if self.error is None:
                        self.on_idle()
                except Exception:  # noqa: BLE001 (best effort: the training thread asks itself)
                    pass
                continue
            if job is None:
                break
            try:
                if self.error is None:
                    job()
            except BaseException as err:  # noqa: BLE001 (reported to the training thread)
                # Without its traceback: the frames would keep the dead world's group alive.
                self.error = err.with_traceback(None)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
            job = None  # an idle worker must not keep the last job's group alive
        self.group = self.on_idle = None  # the thread ends: its references go with it

    def drain(self, timeout: Optional[float] = None) -> None:
        """Wait until every submitted job has finished; re-raise the worker's error."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0 or self.error is not None, timeout)
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"snapshot parity exchange failed: {self.error}") from self.error

    def close(self) -> None:
        """Stop after the job in progress (never waits): queued jobs still run first unless
        the owner discards their results; call :meth:`drain` first to wait for them."""
        self._queue.put(None)

    def join(self, timeout: Optional[float] = None) -> bool:
        """Whether the thread ended within ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
