"""Sampling the resident memory of a job's rank processes from outside, with the iteration
the job had logged at each sample (``/proc/<pid>/status`` VmRSS; the metrics file)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

Key = Tuple[int, int]
"""(slot, incarnation) of a rank process."""


def rss_of(pid: int) -> Optional[Tuple[int, int]]:
    """(VmRSS, RssAnon) of ``pid`` in bytes; None once it is gone. RssAnon is the process's
    own data (heap, tensors); the rest of VmRSS is mapped files, mostly library code paged in
    as new code paths first run (shared with the other ranks, and reclaimable)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssAnon:")):
                    out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if "VmRSS" not in out:
        return None
    return out["VmRSS"], out.get("RssAnon", out["VmRSS"])


class RssSampler:
    """A thread that samples every rank process's RSS every ``interval_s``.

    Args:
        pids: Returns the (slot, incarnation) -> pid of the job's rank processes so far.
        metrics: The job's metrics file (train records carry ``iteration``).
    """

    def __init__(self, pids: Callable[[], Dict[Key, int]], metrics: Path, interval_s: float = 0.05):
        self.pids, self.metrics, self.interval_s = pids, metrics, interval_s
        self.samples: Dict[Key, List[Tuple[float, int, int, int]]] = {}
        """Per process: (time, iteration logged, VmRSS bytes, RssAnon bytes)."""
        self.last_seen: Dict[Key, float] = {}
        self.iteration = 0
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _read_iteration(self) -> None:
        if not self.metrics.exists():
            return
        with open(self.metrics) as f:
            f.seek(self._offset)
            chunk = f.read()
        lines = chunk.split("\n")
        self._offset += len(chunk) - len(lines[-1])  # keep a partly written line for later
        for line in lines[:-1]:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("type") == "train":
                self.iteration = max(self.iteration, int(rec["iteration"]))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read_iteration()
            now = time.time()
            for key, pid in self.pids().items():
                rss = rss_of(pid)
                if rss is not None:
                    self.samples.setdefault(key, []).append((now, self.iteration, *rss))
                    self.last_seen[key] = now
            self._stop.wait(self.interval_s)

    # ------------------------------------------------------------------ summaries
    def window(
        self, key: Key, first_iteration: int, last_iteration: int,
        after: float = 0.0, before: float = float("inf"), anon: bool = False,
    ) -> List[int]:  # fmt: skip
        """RSS samples of ``key`` (RssAnon with ``anon``) while the logged iteration was in the
        range (inclusive) and the time in ``[after, before)``."""
        return [
            anon_rss if anon else rss
            for t, it, rss, anon_rss in self.samples.get(key, [])
            if first_iteration <= it <= last_iteration and after <= t < before
        ]

    def median(self, values: List[int]) -> float:
        if not values:
            raise AssertionError("no RSS sample in that window")
        return float(statistics.median(values))
