"""The trainer glue of fail-slow: timing, the piggybacked exchange, the plan, records, summary.

What a trainer does (the example trainer's four hook lines):

1. :meth:`FailSlowMonitor.wrap` once: times each training forward-backward from its start to
   the start of ``finalize_model_grads`` (the gradient sync), i.e. the replica's compute
   without the wait for the slowest replica;
2. :meth:`FailSlowMonitor.piggyback` on the loss all-reduce the trainer already runs on every
   rank each step: ``n`` floats are appended, rank ``i`` of replica ``r`` adds its time per
   micro-batch divided by the ranks per replica into slot ``r`` (so the sum is the mean over
   the replica's ranks); :meth:`FailSlowMonitor.observe` then reads them back. No extra
   collective; every rank reads the same sums, so every rank reaches the same decision;
3. :meth:`FailSlowMonitor.step_fields` for the step's metrics record and log lines;
4. :meth:`FailSlowMonitor.summary_rows` at the end.

With ``rebalance`` the monitor also measures what rebalancing bought: the mean step time of
the steps run slow and not rebalanced (the detection windows that marked a replica slow, and
any step with a replica marked slow that ran the balanced plan) against the mean of the steps
run rebalanced. The prediction counts micro-batch compute only (not the sync, the optimizer
or what else the slowdown stretches), so the summary gives both.

With ``rebalance``, the job's takeover policy is wrapped (:class:`.rebalance.RebalancePolicy`)
and its assignment is set here between steps; the controller plans the next step with it.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import torch

from megatron_mecefo.failslow.compute_clock import ComputeClock
from megatron_mecefo.failslow.config import FailSlowConfig
from megatron_mecefo.failslow.detector import FailSlowDetector, SlowState, persistent_steps
from megatron_mecefo.failslow.rebalance import RebalanceController, RebalancePolicy

PREFIX = "> MeCeFO fail-slow"


class FailSlowMonitor:
    """One rank's fail-slow state (module docstring).

    Args:
        config: The flags.
        replica: This rank's data-parallel index.
        num_replicas: Data-parallel size.
        ranks_per_replica: TP x PP (the ranks that add into one replica's slot).
        microbatches: ``M``.
        controller: The MeCeFO controller (None without ``--mecefo``: detection only).
        print_line: The run log's printer (rank 0 prints).
    """

    def __init__(
        self,
        config: FailSlowConfig,
        replica: int,
        num_replicas: int,
        ranks_per_replica: int,
        microbatches: int,
        controller: Any = None,
        print_line: Callable[[str], None] = print,
    ) -> None:
        self.config = config
        self.replica = replica
        self.num_replicas = num_replicas
        self.ranks_per_replica = ranks_per_replica
        self.microbatches = microbatches
        self.controller = controller
        self.print_line = print_line
        self.detector = FailSlowDetector(num_replicas, config)
        self.policy: Optional[RebalancePolicy] = None
        self.rebalancer: Optional[RebalanceController] = None
        if config.rebalance and controller is not None and num_replicas > 1:
            self.policy = RebalancePolicy(controller.policy)
            controller.policy = self.policy
            self.rebalancer = RebalanceController(
                num_replicas, microbatches, config.window, config.replan_gain
            )
        self.clock = ComputeClock()
        self._iteration = 0
        self._lines: List[str] = []
        self._fields: Dict[str, Any] = {}
        self.rebalanced_steps = 0
        self.rebalanced_time_s = 0.0
        self.predicted_saved_s = 0.0
        self.predicted_balanced_s = 0.0
        self.slow_steps = 0
        self.unbalanced_steps = 0
        self.unbalanced_time_s = 0.0
        """Steps run slow and not rebalanced (see the module docstring) and their seconds."""
        self._step = 0  # steps seen here (iteration numbers repeat after a recovery)
        self._recent: Deque[Tuple[int, float, bool]] = deque(maxlen=config.window)
        self._counted: Set[int] = set()
        self._step_kind: Tuple[bool, bool, bool] = (False, False, False)

    # ------------------------------------------------------------------ 1. timing
    def wrap(self, forward_backward: Callable, config: Any) -> Callable:
        """Time ``forward_backward`` (training calls) up to ``config``'s finalize; returns the
        wrapped function and wraps ``config.finalize_model_grads_func`` in place."""
        finalize = config.finalize_model_grads_func

        @functools.wraps(forward_backward)
        def timed(*a: Any, **kw: Any) -> Any:
            if kw.get("forward_only", False):
                return forward_backward(*a, **kw)
            self.clock.start(tag=self._local_microbatches())
            out = forward_backward(*a, **kw)
            self.clock.stop()  # no finalize ran: the whole call is compute
            return out

        if finalize is not None:

            @functools.wraps(finalize)
            def finalize_timed(*a: Any, **kw: Any) -> Any:
                self.clock.stop()
                return finalize(*a, **kw)

            config.finalize_model_grads_func = finalize_timed
        return timed

    def _local_microbatches(self) -> int:
        ctrl = self.controller
        if ctrl is not None and ctrl.plan is not None:
            return len(ctrl.plan.work[self.replica])
        return self.microbatches

    # ------------------------------------------------------------------ 2. exchange
    def piggyback(self, total: torch.Tensor) -> torch.Tensor:
        """``total`` with this rank's ``n`` slots appended (to be all-reduced with SUM)."""
        slots = torch.zeros(self.num_replicas, dtype=total.dtype, device=total.device)
        # The count is the measured step's own (on CUDA the step before: the clock's module).
        measured = self.clock.take()
        if measured is not None and measured[1] > 0:
            seconds, count = measured
            slots[self.replica] = seconds / count / self.ranks_per_replica
        return torch.cat([total, slots])

    def observe(self, reduced: torch.Tensor, iteration: int) -> torch.Tensor:
        """Read this step's per-replica times from the all-reduced tensor (the last ``n``
        entries), update the detector and the plan; returns the trainer's part."""
        n = self.num_replicas
        times = [float(x) for x in reduced[-n:].tolist()]
        plan = self.controller.plan if self.controller is not None else None
        rebalanced = plan is not None and plan.policy == RebalancePolicy.PLAN_NAME
        state = self.detector.update(times)
        self._iteration = iteration
        self._lines = self._mark_lines(state, iteration)
        fields: Dict[str, Any] = {"mode": self.config.mode, **state.summary()}
        fields["rebalanced"] = rebalanced
        if rebalanced and self.policy is not None and self.policy.assignment is not None:
            a = self.policy.assignment
            fields["assignment"] = a.summary()
            self.rebalanced_steps += 1
            self.predicted_saved_s += a.balanced_step - a.predicted_step
            self.predicted_balanced_s += a.balanced_step
        self.slow_steps += bool(state.slow)
        onset = any(now_slow for _, now_slow in state.changed)
        self._step_kind = (rebalanced, bool(state.slow), onset)
        if self.rebalancer is not None:
            if self.policy is not None and self.policy.assignment is None:
                self.rebalancer.reset()  # the controller was reset (an in-process restart)
            new = self.rebalancer.update(state.step, state.plan_times(), state.slow)
            if new is not None:
                assert self.policy is not None
                self.policy.assignment = new
                self._lines.append(self._plan_line(new, iteration))
        self._fields = fields
        return reduced[:-n]

    def _mark_lines(self, state: SlowState, iteration: int) -> List[str]:
        lines = []
        for r, now_slow in state.changed:
            ratio, t = state.ratios[r], state.smoothed[r]
            what = (
                f"replica {r} is slow: {ratio:.2f}x the median time per micro-batch "
                f"({t * 1e3:.1f} ms; above the threshold {self.config.threshold:g}x in at "
                f"least {persistent_steps(self.config.window)} of the last "
                f"{self.config.window} steps)"
                if now_slow
                else f"replica {r} recovered: {ratio:.2f}x the median time per micro-batch "
                f"(<= {self.config.recover_threshold:g}x)"
            )
            if self.config.mode == "detect" and now_slow:
                what += "; detect only, no action (--mecefo-fail-slow=rebalance acts)"
            lines.append(f"{PREFIX}: iteration {iteration}: {what}")
        return lines

    def _plan_line(self, a: Any, iteration: int) -> str:
        if not a.active:
            return (
                f"{PREFIX}: iteration {iteration}: micro-batches given back, from iteration "
                f"{iteration + 1} every replica runs its own {self.microbatches}"
            )
        given = ", ".join(f"replica {s} gives {k}" for s, k in sorted(a.given_away().items()))
        return (
            f"{PREFIX}: iteration {iteration}: rebalancing from iteration {iteration + 1}: "
            f"{given} ({a.target}), micro-batches per replica {list(a.counts)}, exact; "
            f"predicted step {a.predicted_step * 1e3:.1f} ms instead of "
            f"{a.balanced_step * 1e3:.1f} ms"
        )

    # ------------------------------------------------------------------ 3. records
    def step_fields(self, step_time_s: float) -> Tuple[Dict[str, Any], List[str]]:
        """The step's ``fail_slow`` metrics field and its log lines (after :meth:`observe`).

        With ``rebalance`` the field's ``measured`` holds the run's measured means so far
        (:meth:`measured`)."""
        rebalanced, marked, onset = self._step_kind
        self._step += 1
        self._recent.append((self._step, step_time_s, rebalanced))
        if rebalanced:
            self.rebalanced_time_s += step_time_s
        # A replica just marked slow: the window that marked it ran slow, without a plan.
        slow_unbalanced = list(self._recent) if onset else []
        if marked and not rebalanced:
            slow_unbalanced.append(self._recent[-1])
        for step, seconds, was_rebalanced in slow_unbalanced:
            if not was_rebalanced and step not in self._counted:
                self._counted.add(step)
                self.unbalanced_steps += 1
                self.unbalanced_time_s += seconds
        if self.rebalancer is not None:
            self._fields["measured"] = self.measured()
        return {"fail_slow": self._fields}, self._lines

    def measured(self) -> Dict[str, Any]:
        """The measured mean step time of the steps run slow and not rebalanced, and of the
        steps run rebalanced (seconds; None without such a step), with their counts."""

        def mean(total: float, steps: int) -> Optional[float]:
            return round(total / steps, 6) if steps else None

        return {
            "not_rebalanced_steps": self.unbalanced_steps,
            "not_rebalanced_mean_step_s": mean(self.unbalanced_time_s, self.unbalanced_steps),
            "rebalanced_steps": self.rebalanced_steps,
            "rebalanced_mean_step_s": mean(self.rebalanced_time_s, self.rebalanced_steps),
        }

    # ------------------------------------------------------------------ 4. summary
    def summary_rows(self) -> List[Tuple[str, str]]:
        """Rows of the run's summary table."""
        slow = list(self.detector.state.slow) if self.detector.state else []
        rows = [("fail-slow", f"{self.config.mode}; {self.slow_steps} step(s) with a slow "
                              f"replica; slow at the end: {slow or 'none'}")]  # fmt: skip
        if self.rebalancer is not None:
            gain = (
                self.predicted_balanced_s / (self.predicted_balanced_s - self.predicted_saved_s)
                if self.rebalanced_steps and self.predicted_saved_s < self.predicted_balanced_s
                else 1.0
            )
            rows.append(
                (
                    "fail-slow rebalanced",
                    f"{self.rebalanced_steps} step(s), {self.rebalanced_time_s:.1f} s; "
                    f"{self.rebalancer.changes} plan change(s); predicted x{gain:.2f} over not "
                    "rebalancing (micro-batch compute only, from the measured speeds)",
                )
            )
            rows.append(("fail-slow measured", self._measured_text()))
        return rows

    def _measured_text(self) -> str:
        m = self.measured()
        before, after = m["not_rebalanced_mean_step_s"], m["rebalanced_mean_step_s"]

        def part(mean: Optional[float], steps: int, what: str) -> str:
            if mean is None:
                return f"no step {what}"
            return f"{mean * 1e3:.1f} ms over {steps} step(s) {what}"

        text = (
            "mean step "
            + part(before, m["not_rebalanced_steps"], "slow, not rebalanced")
            + "; "
            + part(after, m["rebalanced_steps"], "rebalanced")
        )
        if before and after:
            text += f": x{before / after:.2f} measured"
        return text


def build_monitor(
    config: FailSlowConfig,
    replica: int,
    num_replicas: int,
    ranks_per_replica: int,
    microbatches: int,
    controller: Any,
    virtual: bool,
    print_line: Callable[[str], None],
) -> Optional[FailSlowMonitor]:
    """The monitor of a run, or None when off (or simulated replicas: one process).

    ``ranks_per_replica`` is TP x PP, not the world size over ``num_replicas``: after a real
    death the regrouped world is smaller than the data-parallel layout it keeps."""
    if not config.enabled or virtual or num_replicas < 2:
        return None
    return FailSlowMonitor(
        config,
        replica,
        num_replicas,
        ranks_per_replica,
        microbatches,
        controller,
        print_line,
    )
