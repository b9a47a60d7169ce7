"""The asynchronous copy into a slot: a thread on CPU, a side stream on GPU.

Both copy the live tensors, so the next ``optimizer.step()`` (which writes them in place) must
not start before the bytes are out: on GPU the compute stream waits on the copy's event (the
host does not block); on CPU :meth:`Copier.fence` joins the copy thread. The checksum and the
header are written by the thread after the bytes are complete, off the training path.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Dict, List, Optional

import torch

from megatron_mecefo.snapshot.slots import Entry, copy_into


class Copier:
    """Runs one copy at a time: ``start`` returns at once, ``fence``/``join`` wait for it.

    The copies run on one long-lived thread (started at the first copy): starting a thread
    per snapshot makes the training thread wait until the new thread is scheduled
    (``Thread.start``), milliseconds on oversubscribed cores.
    """

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._work: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self._done = threading.Event()
        self._busy = False
        self._event = None
        self._error: Optional[BaseException] = None
        self._stream = None

    @property
    def busy(self) -> bool:
        return self._busy

    def start(
        self,
        buffer: torch.Tensor,
        tensors: Dict[str, torch.Tensor],
        entries: List[Entry],
        finish: Callable[[], None],
    ) -> None:
        """Copy ``tensors`` into ``buffer``, then call ``finish`` (checksum, header), in the
        background."""
        on_gpu = any(t.is_cuda for t in tensors.values())
        if on_gpu:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                copy_into(buffer, tensors, entries, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
            event = self._event

            def work() -> None:
                event.synchronize()
                finish()

        else:

            def work() -> None:
                copy_into(buffer, tensors, entries, non_blocking=False)
                finish()

        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mecefo-snapshot", daemon=True)
            self._thread.start()
        self._done.clear()
        self._busy = True
        self._work.put(work)

    def _run(self) -> None:
        while True:
            work = self._work.get()
            try:
                work()
            except BaseException as err:  # noqa: BLE001 (re-raised on the training thread)
                self._error = err
            finally:
                work = None  # the copied tensors are not kept alive by an idle thread
                self._done.set()

    def fence(self) -> None:
        """Before anything writes the copied tensors: GPU: order the compute stream after the
        copy; CPU: wait for the copy."""
        if not self._busy:
            return
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            return
        self.join()

    def join(self) -> None:
        """Wait until the copy, checksum and header are done; re-raise a copy error."""
        if self._busy:
            self._done.wait()
            self._busy, self._event = False, None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"snapshot copy failed: {err}") from err
