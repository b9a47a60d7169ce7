"""``FailSlowConfig``: the ``--mecefo-fail-slow*`` settings and their start-up checks.

Torch-free: the checks run before torch is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_mecefo.takeover.config_error import MecefoConfigError

MODES = ("off", "detect", "rebalance")
"""``--mecefo-fail-slow`` values."""

MAX_THRESHOLD = 100.0
"""Largest ``--mecefo-fail-slow-threshold``: a replica 100x slower than its peers is dead in
all but name (the collective timeouts and the takeover are for that)."""

MAX_WINDOW = 1000
"""Largest ``--mecefo-fail-slow-window``: beyond it detection would lag by hours."""


class FailSlowConfigError(MecefoConfigError):
    """A bad ``--mecefo-fail-slow*`` flag; the message names the flag, the value and the fix."""


@dataclass(frozen=True)
class FailSlowConfig:
    """How stragglers are detected and what is done about them."""

    mode: str = "detect"
    """``off``: nothing is measured or exchanged. ``detect``: each replica's compute time per
    micro-batch is exchanged every step; a replica that turns slow (or recovers) gets one log
    line and every step's metrics record carries the measurement; no action. ``rebalance``:
    as ``detect``, and the slow replica hands part of its micro-batches to the others, run
    exactly (needs ``--mecefo``)."""

    threshold: float = 1.3
    """A replica is slow when its time per micro-batch exceeds ``threshold`` times the group's
    median (the lower median at an even replica count, so that at DP2 the reference is the
    faster replica) persistently: in at least ``ceil(0.8 * window)`` of the last ``window``
    steps. Above 1."""

    window: int = 5
    """Steps over which each replica's time per micro-batch is judged (80% of them must be
    slow to mark it) and smoothed (the median, for the planner and recovery). Also the least
    number of steps between two changes of the rebalancing plan (hysteresis). At least 1."""

    replan_gain: float = 0.05
    """A rebalanced plan is replaced by a new one only if the new one's predicted step time is
    at least this fraction shorter (hysteresis against flapping between near-equal plans).
    Below the gain of one micro-batch moved at M = 8 (1/12 = 8%): at 10%, a plan chosen
    from a noisy first window (12 + 4 at DP2) stayed when the measured speeds later said
    11 + 5 was 8% faster."""

    @property
    def recover_threshold(self) -> float:
        """A slow replica counts as recovered once its ratio to the median falls to or below
        this, halfway between 1 and :attr:`threshold` (the hysteresis band)."""
        return 1.0 + (self.threshold - 1.0) / 2.0

    @property
    def enabled(self) -> bool:
        """Whether anything is measured."""
        return self.mode != "off"

    @property
    def rebalance(self) -> bool:
        """Whether slow replicas hand micro-batches away."""
        return self.mode == "rebalance"

    def validate(
        self,
        *,
        data_parallel_size: int,
        mecefo: bool,
        virtual_replicas: bool = False,
        virtual_pipeline: bool = False,
        microbatches: Optional[int] = None,
        train_iters: Optional[int] = None,
        batch_flags: str = "",
    ) -> Optional[str]:
        """Check the flags against the job; raise :class:`FailSlowConfigError` on a problem.

        Args:
            data_parallel_size: Replicas.
            mecefo: Whether ``--mecefo`` is on.
            virtual_replicas: Whether one process simulates every replica.
            virtual_pipeline: Whether the interleaved pipeline schedule runs.
            microbatches: ``M``, micro-batches per replica per step (None: not checked).
            train_iters: Iterations of the run (None: not checked).
            batch_flags: How ``M`` comes about, for the warning (e.g. ``--global-batch-size=4
                / (--micro-batch-size=2 x 2 replicas)``).

        Returns:
            A warning line when the flags are valid but some can never act, else None.
        """
        if self.mode not in MODES:
            raise FailSlowConfigError(
                f"--mecefo-fail-slow={self.mode}: use one of {', '.join(MODES)}"
            )
        t = self.threshold
        if not (math.isfinite(t) and 1.0 < t <= MAX_THRESHOLD):
            raise FailSlowConfigError(
                f"--mecefo-fail-slow-threshold={t}: the ratio to the group's median time per "
                f"micro-batch above which a replica is slow; give a number above 1 and at most "
                f"{MAX_THRESHOLD:g} (e.g. 1.3)"
            )
        if not 1 <= self.window <= MAX_WINDOW:
            raise FailSlowConfigError(
                f"--mecefo-fail-slow-window={self.window}: the steps a replica's time is "
                f"smoothed over; give an integer from 1 to {MAX_WINDOW} (e.g. 5)"
            )
        if not self.rebalance:
            return self._window_warning(train_iters)
        if not mecefo:
            raise FailSlowConfigError(
                "--mecefo-fail-slow=rebalance moves micro-batches through the MeCeFO plan; add "
                "--mecefo, or use --mecefo-fail-slow=detect"
            )
        if virtual_replicas:
            raise FailSlowConfigError(
                "--mecefo-fail-slow=rebalance with --mecefo-virtual-replicas: one process runs "
                "every replica, so none is slower than another; drop one of the two"
            )
        if virtual_pipeline:
            raise FailSlowConfigError(
                "--mecefo-fail-slow=rebalance gives replicas different micro-batch counts, "
                "which the interleaved schedule (--num-layers-per-virtual-pipeline-stage) "
                "cannot run; use --mecefo-fail-slow=detect or no virtual pipeline"
            )
        if data_parallel_size < 2:
            return (
                "--mecefo-fail-slow=rebalance with a data-parallel size of 1: there is no "
                "other replica to hand micro-batches to, so it only detects"
            )
        if microbatches is not None and microbatches < 2:
            # A slow replica keeps at least one micro-batch (its speed stays measured), so with
            # one each nothing can ever move.
            how = f" ({batch_flags})" if batch_flags else ""
            return (
                f"--mecefo-fail-slow=rebalance with {microbatches} micro-batch per replica{how}: "
                "a slow replica always keeps one micro-batch, so rebalancing can never act (it "
                "only detects); give each replica at least 2 micro-batches: raise "
                "--global-batch-size or lower --micro-batch-size"
            )
        return self._window_warning(train_iters)

    def _window_warning(self, train_iters: Optional[int]) -> Optional[str]:
        """The warning for a window the run cannot fill; only when the window or ``rebalance``
        was asked for (the default detection of a short test run says nothing)."""
        if train_iters is None or not self.enabled:
            return None
        if self.window == FailSlowConfig.window and not self.rebalance:
            return None
        # The first verdict comes at the window's last step; a plan acts from the next one.
        need = self.window + 1 if self.rebalance else self.window
        if train_iters >= need:
            return None
        what = "rebalancing" if self.rebalance and self.window <= train_iters else "detection"
        verb = "act" if what == "rebalancing" else "start"
        return (
            f"--mecefo-fail-slow-window={self.window} with --train-iters={train_iters}: a "
            f"replica is first judged after {self.window} measured steps and the run has "
            f"{train_iters}, so {what} can never {verb}; lower --mecefo-fail-slow-window to at "
            f"most {max(1, train_iters - (need - self.window))} or raise --train-iters"
        )
