"""Waits a failure can cut short: the training thread's ``torch.distributed`` waits on gloo.

gloo cannot wake a rank blocked in a send whose peer left its world: the send of an unbound
buffer stays queued and ``Pair::signalException`` wakes bound buffers only
(``gloo/transport/tcp/pair.cc``; ``docs/real-failures.md``). The rank then slept until the
collective timeout (30 s), and nothing outside gloo can wake it: ``Work`` has no ``abort`` in
Python, a ``wait(timeout)`` on a send closes the pair ("Application timeout caused pair
closure"), and a send's ``is_completed()`` stays False until someone waits on it (all three
measured with torch 2.13.0).

So the waiting moves off the training thread. While a world is armed, every ``Work.wait`` the
main thread calls (Megatron's pipeline ``req.wait()``, the synchronous collectives of
``torch.distributed``, DDP's grad sync) hands the work to a waiter thread and sleeps on an
event that the waiter *or* :func:`abort` sets. When the generation watchdog sees a failure it
calls :func:`abort`: the training thread raises :class:`WorldAborted` at once (a
``RuntimeError``, so it takes the recovery path of a gloo error), and the waiter thread is
left in gloo until the backstop releases it. The old world's groups are then kept alive for
that long (:func:`retain`): their destructor joins gloo's worker threads, which would block
on the same stuck operation.

Cost, measured on this machine (2 ranks, 1,000 floats, 500 calls): an all-reduce went from
116-154 us to 163-264 us, a blocking send/recv pair from 1.9-3.3 ms to 0.20 ms.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from typing import Any, List, Optional, Tuple


class WorldAborted(RuntimeError):
    """The training thread's wait was cut short: a failure ended this world."""


class _Job:
    __slots__ = ("work", "timeout", "done", "finished", "result", "error")

    def __init__(self, work: Any, timeout: datetime.timedelta) -> None:
        self.work, self.timeout = work, timeout
        self.done = threading.Event()
        self.finished = False
        self.result: Any = None
        self.error: Optional[BaseException] = None


class _Waiter:
    """One thread that waits on the works the training thread hands it, one at a time."""

    def __init__(self, wait: Any) -> None:
        self.jobs: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()
        self._wait = wait
        self.thread = threading.Thread(target=self._run, name="mecefo-wait", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                job.result = self._wait(job.work, job.timeout)
            except BaseException as err:  # noqa: BLE001 (re-raised on the training thread)
                job.error = err
            job.finished = True
            job.done.set()
            # Not kept while this thread waits for the next job: a failed wait's error, through
            # its traceback, holds the training thread's frames (the failed world's trainer).
            del job


class AbortableWaits:
    """This process's abortable waits (one per process: :data:`STATE`; :meth:`reset`)."""

    def __init__(self) -> None:
        self._original: Any = None
        self._waiter: Optional[_Waiter] = None
        self._pending: Optional[_Job] = None
        self._lock = threading.Lock()
        self.armed = False
        self.aborted = threading.Event()
        self.abandoned = 0
        """Waits left in gloo by an abort (each one held a waiter thread until the backstop)."""
        self.retained: List[Tuple[float, List[Any]]] = []
        """(time, groups) of left worlds kept alive until their stuck operations time out."""

    def install(self) -> None:
        """Route ``Work.wait`` through :meth:`wait` (idempotent; no effect until armed)."""
        if self._original is not None:
            return
        from torch.distributed.distributed_c10d import Work

        self._original = Work.wait
        state = self

        def wait(work: Any, timeout: datetime.timedelta = datetime.timedelta(0)) -> Any:
            return state.wait(work, timeout)

        Work.wait = wait

    def uninstall(self) -> None:
        if self._original is None:
            return
        from torch.distributed.distributed_c10d import Work

        Work.wait = self._original
        self._original = None

    def arm(self) -> None:
        """A new world: its waits are abortable and nothing is aborted yet."""
        self.install()
        self.aborted.clear()
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def abort(self) -> None:
        """Release the training thread from its wait, now and for the rest of this world
        (thread-safe: the generation watchdog calls it)."""
        with self._lock:
            self.aborted.set()
            if self._pending is not None:
                self._pending.done.set()

    def wait(self, work: Any, timeout: datetime.timedelta) -> Any:
        if not self.armed or threading.current_thread() is not threading.main_thread():
            return self._original(work, timeout)
        job = _Job(work, timeout)
        with self._lock:
            if self.aborted.is_set():
                raise WorldAborted("a failure ended this world (wait not started)")
            self._pending = job
        if self._waiter is None:
            self._waiter = _Waiter(self._original)
        self._waiter.jobs.put(job)
        job.done.wait()
        with self._lock:
            self._pending = None
        if job.finished:  # done before (or as) the abort came: its outcome stands
            if job.error is not None:
                raise job.error
            return job.result
        # The waiter stays in gloo until the backstop; the next world gets a new one, and
        # this one ends when its wait returns.
        self._waiter.jobs.put(None)
        self._waiter = None
        self.abandoned += 1
        raise WorldAborted("a failure ended this world while it waited in a collective")

    def retain(self, groups: List[Any], hold_s: float) -> None:
        """Keep a left world's groups for ``hold_s`` (a destructor would join gloo threads
        still stuck in an abandoned operation); drops those held longer than that."""
        now = time.monotonic()
        self.retained = [(t, g) for t, g in self.retained if now - t < hold_s]
        if groups:
            self.retained.append((now, list(groups)))

    def reset(self) -> None:
        """Back to an unpatched, unarmed process (tests)."""
        self.uninstall()
        self.armed = False
        self.aborted.clear()
        self.retained.clear()
        self.abandoned = 0
        if self._waiter is not None:
            self._waiter.jobs.put(None)
            self._waiter = None


STATE = AbortableWaits()
"""This process's abortable waits."""
