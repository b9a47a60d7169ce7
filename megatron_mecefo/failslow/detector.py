"""Which replicas are slow: each one's compute time per micro-batch against the group's median.

Every step each replica contributes one number, its compute time per micro-batch (the wall time
from the start of its forward-backward to the start of the gradient sync, divided by the
micro-batches it ran); the numbers reach every rank in one exchange (:mod:`.monitor`). The
detector then, identically on every rank:

1. divides each replica's time by the step's reference, the median of that step's times (the
   lower median at an even count, so at DP2 the faster replica is the reference and a replica
   at half speed shows as 2x, not 1.33x). Per step, so that what slows every replica alike
   (the machine's load, a longer sequence) cancels;
2. keeps each replica's last ``window`` ratios. Their median is the replica's smoothed ratio
   (for the log, the planner and recovery); the times are smoothed the same way;
3. marks a replica slow only when the slowdown is persistent: at least
   ``ceil(0.8 * window)`` of its last ``window`` ratios exceed ``threshold`` (4 of 5 at the
   default window; every one at windows up to 4). A median (3 of 5) marked a replica of a
   loaded, unslowed machine that a neighbour's burst slowed for three steps; the duty-cycled
   half-speed replica is above 1.3x on every step. A replica is healthy again only when its
   smoothed ratio falls to ``recover_threshold`` or below (hysteresis: a ratio in between
   keeps the state it had).

A replica that ran nothing (down, or given nothing) reports 0 and keeps its last smoothed
value. The detector makes no collective call and no random draw: given the same sequence of
exchanged numbers every rank reaches the same states, bit for bit.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Sequence, Tuple

from megatron_mecefo.failslow.config import FailSlowConfig

PERSISTENCE = 0.8
"""Share of the window's steps that must exceed the threshold for a replica to be marked slow."""


def persistent_steps(window: int) -> int:
    """Steps of a full window that must exceed the threshold: ``ceil(0.8 * window)``."""
    return max(1, math.ceil(PERSISTENCE * window - 1e-9))


@dataclass(frozen=True)
class SlowState:
    """The detector's view after one step.

    Attributes:
        step: Measurements seen so far.
        smoothed: Per replica, the median of its last ``window`` times per micro-batch
            (seconds; None before its first measurement).
        reference: The group's (lower) median of ``smoothed`` (None before any).
        ratios: Per replica, the median of its last ``window`` per-step ratios to the step's
            median (None before its first measurement).
        persistent: Per replica, the ratio that ``ceil(0.8 * window)`` of its last ``window``
            ratios reach or exceed (None before a full window): above the threshold, it is
            marked slow.
        slow: The replicas currently marked slow, ascending.
        changed: Replicas whose mark changed at this step, as (replica, now_slow).
    """

    step: int
    smoothed: Tuple[Optional[float], ...]
    reference: Optional[float]
    ratios: Tuple[Optional[float], ...]
    slow: Tuple[int, ...]
    changed: Tuple[Tuple[int, bool], ...]
    persistent: Tuple[Optional[float], ...] = ()

    def plan_times(self) -> Tuple[Optional[float], ...]:
        """Per replica, the time per micro-batch the planner uses: its smoothed ratio times the
        reference (the relative speeds, free of what slowed every replica alike)."""
        ref = self.reference
        return tuple(None if r is None or ref is None else r * ref for r in self.ratios)

    def speeds(self) -> Tuple[Optional[float], ...]:
        """Per replica, its speed relative to the reference (``1 / ratio``)."""
        return tuple(None if r is None or r <= 0 else 1.0 / r for r in self.ratios)

    def summary(self) -> dict:
        """The metrics-record fields."""
        return {
            "time_per_microbatch_s": [None if s is None else round(s, 6) for s in self.smoothed],
            "ratio": [None if r is None else round(r, 4) for r in self.ratios],
            "persistent_ratio": [None if r is None else round(r, 4) for r in self.persistent],
            "slow": list(self.slow),
        }


class FailSlowDetector:
    """Turns each step's per-replica times per micro-batch into slow marks (module docstring).

    Args:
        num_replicas: Data-parallel size.
        config: Threshold and window.
    """

    def __init__(self, num_replicas: int, config: FailSlowConfig) -> None:
        self.num_replicas = num_replicas
        self.config = config
        self.reset()

    def reset(self) -> None:
        """Forget every measurement and mark."""
        self._history: List[Deque[float]] = [
            deque(maxlen=self.config.window) for _ in range(self.num_replicas)
        ]
        self._ratios: List[Deque[float]] = [
            deque(maxlen=self.config.window) for _ in range(self.num_replicas)
        ]
        self._slow: List[bool] = [False] * self.num_replicas
        self.step = 0
        self.state: Optional[SlowState] = None

    def update(self, times_per_microbatch: Sequence[float]) -> SlowState:
        """Add one step's measurements (seconds per micro-batch, 0 for a replica that ran
        nothing) and return the new state."""
        if len(times_per_microbatch) != self.num_replicas:
            raise ValueError(
                f"{len(times_per_microbatch)} measurements for {self.num_replicas} replicas"
            )
        self.step += 1
        now = sorted(float(t) for t in times_per_microbatch if t > 0)
        step_ref = statistics.median_low(now) if now else None
        for r, t in enumerate(times_per_microbatch):
            if t > 0 and step_ref:
                self._history[r].append(float(t))
                self._ratios[r].append(float(t) / step_ref)
        smoothed = tuple(statistics.median(h) if h else None for h in self._history)
        known = sorted(s for s in smoothed if s is not None)
        reference = statistics.median_low(known) if known else None
        ratios = tuple(statistics.median(h) if h else None for h in self._ratios)
        cfg = self.config
        need = persistent_steps(cfg.window)
        persistent = tuple(
            sorted(h)[len(h) - need] if len(h) >= cfg.window else None for h in self._ratios
        )
        changed: List[Tuple[int, bool]] = []
        for r, ratio in enumerate(ratios):
            low = persistent[r]
            if ratio is None or low is None:  # no verdict on a half-empty window
                continue
            if not self._slow[r] and low > cfg.threshold:
                self._slow[r] = True
                changed.append((r, True))
            elif self._slow[r] and ratio <= cfg.recover_threshold:
                self._slow[r] = False
                changed.append((r, False))
        self.state = SlowState(
            self.step,
            smoothed,
            reference,
            ratios,
            tuple(r for r in range(self.num_replicas) if self._slow[r]),
            tuple(changed),
            persistent,
        )
        return self.state
