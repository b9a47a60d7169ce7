"""The clock that times a replica's compute, on the device the compute runs on.

On a CPU a step's forward-backward runs on the calling thread: ``perf_counter`` around it is
its compute time. On a GPU the same calls only *queue* kernels: the host returns long before
the device has finished, and a throttled or shared GPU is just as quick to queue to. Host
timings then show every replica equally fast and a slow GPU goes unseen. On CUDA the clock
therefore records CUDA events on the current stream at the start and at the gradient sync,
and reads their elapsed time one step later, when the events have long completed: no
synchronisation is added to the step, and the detector sees each step's time one step late.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Tuple

import torch


class ComputeClock:
    """Times a forward-backward from :meth:`start` to :meth:`stop` (the first call counts).

    Args:
        use_cuda: Time with CUDA events; ``None``: when CUDA is initialised at the first
            :meth:`start` (the model lives there).
    """

    def __init__(self, use_cuda: Optional[bool] = None) -> None:
        self.use_cuda = use_cuda
        self._t0: Optional[float] = None
        self._tag: Any = None
        self._events: Optional[Tuple[Any, Any]] = None  # CUDA: the measurement under way
        self._stopped: Optional[Tuple[Any, Any, Any]] = None  # CUDA: stopped, not yet read
        self._ready: Optional[Tuple[float, Any]] = None

    def start(self, tag: Any = None) -> None:
        """Begin a measurement; ``tag`` comes back with it from :meth:`take`."""
        if self.use_cuda is None:
            self.use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if not self.use_cuda:
            self._t0, self._tag, self._ready = time.perf_counter(), tag, None
            return
        if self._stopped is not None:  # the step before: its events completed long ago
            begin, end, old_tag = self._stopped
            end.synchronize()  # returns at once unless the host ran a whole step ahead
            self._ready, self._stopped = (begin.elapsed_time(end) / 1e3, old_tag), None
        begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        begin.record()
        self._events, self._tag = (begin, end), tag

    def stop(self) -> None:
        """End the measurement begun last (a second call, or one with none begun, is a no-op)."""
        if not self.use_cuda:
            if self._t0 is not None:
                self._ready, self._t0 = (time.perf_counter() - self._t0, self._tag), None
        elif self._events is not None:
            begin, end = self._events
            end.record()
            self._stopped, self._events = (begin, end, self._tag), None

    def take(self) -> Optional[Tuple[float, Any]]:
        """The newest finished measurement not taken yet, ``(seconds, tag)``, or None.

        On a CPU that is the step just stopped. On CUDA it is the step before (read when the
        current one started; the current one's events are still queued behind its kernels)."""
        out, self._ready = self._ready, None
        return out
