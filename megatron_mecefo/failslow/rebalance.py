"""Rebalancing: how many micro-batches each slow replica hands away, to whom, and the plan.

A step ends when the slowest replica has run its micro-batches (the critical path of
:mod:`megatron_mecefo.planner.step_cost_model`; the sync and the optimizer step are the same
for every plan here, so they do not enter the choice). With ``t_r`` replica ``r``'s measured
time per micro-batch and ``L_r`` the micro-batches it runs, the predicted step time is
``max_r L_r t_r``; the global batch fixes ``sum_r L_r = n M``.

:func:`plan_rebalance` chooses the counts: for each target rule,

* ``spread``: a slow replica's micro-batches may go to any healthy replica;
* ``neighbor``: only to its ring neighbour (the next healthy replica),

it moves one micro-batch at a time from the replica on the critical path (if it is slow and
keeps at least one, so that its speed is still measured and its recovery seen) to the allowed
replica that would finish it soonest, while that shortens the step; this greedy fill is
optimal for the min-max of linear costs. The rule with the shorter predicted step wins (ties go
to ``neighbor``: fewer replicas read another's samples).

:class:`RebalancePolicy` wraps the job's takeover policy. On a step with a replica down the
takeover plan wins and rebalancing pauses. Otherwise the plan is every replica's own
micro-batches minus the ones it gave away (the last of its share), and each receiver runs
what it was given after its own, all in ``exact`` mode: the same samples and, with the plan's
weights (``L_r / M`` per replica, :class:`~megatron_mecefo.takeover.plan.StepPlan`), the same
gradient as the unslowed step, up to fp32 summation order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from megatron_mecefo.takeover.plan import EXACT, MicrobatchWork, StepPlan
from megatron_mecefo.takeover.policies.base import TakeoverPolicy

TARGETS = ("neighbor", "spread")
"""Target rules, in tie-break order."""


@dataclass(frozen=True)
class Assignment:
    """Which micro-batches move: ``moves`` are (source, index, target), sorted.

    Attributes:
        counts: Micro-batches each replica runs.
        moves: (source replica, micro-batch index of its share, receiving replica).
        target: ``neighbor`` or ``spread`` (``none`` for the balanced plan).
        predicted_step: ``max_r counts[r] t_r`` under the speeds it was chosen with (s).
        balanced_step: The same for the balanced plan (every replica ``M``).
    """

    counts: Tuple[int, ...]
    moves: Tuple[Tuple[int, int, int], ...] = ()
    target: str = "none"
    predicted_step: float = 0.0
    balanced_step: float = 0.0

    @property
    def active(self) -> bool:
        """Whether any micro-batch moves."""
        return bool(self.moves)

    def given_away(self) -> Dict[int, int]:
        """Source replica -> micro-batches it hands away."""
        out: Dict[int, int] = {}
        for s, _, _ in self.moves:
            out[s] = out.get(s, 0) + 1
        return out

    def summary(self) -> Dict[str, Any]:
        """The metrics-record fields."""
        return {
            "target": self.target,
            "given_away": {str(k): v for k, v in sorted(self.given_away().items())},
            "microbatches_per_replica": list(self.counts),
            "predicted_step_s": round(self.predicted_step, 6),
            "balanced_step_s": round(self.balanced_step, 6),
        }


def balanced(num_replicas: int, microbatches: int) -> Assignment:
    """The plan with nothing moved."""
    return Assignment(tuple([microbatches] * num_replicas))


def step_time(counts: Sequence[int], times: Sequence[float]) -> float:
    """Predicted step time ``max_r counts[r] times[r]``."""
    return max(c * t for c, t in zip(counts, times, strict=True))


def _fill(
    times: Sequence[float], slow: FrozenSet[int], receivers: Dict[int, List[int]], m: int
) -> Tuple[List[int], List[Tuple[int, int]]]:
    """Greedy min-max fill; returns (counts, [(source, receiver)] in move order)."""
    n = len(times)
    counts = [m] * n
    moved: List[Tuple[int, int]] = []
    while True:
        loads = [counts[r] * times[r] for r in range(n)]
        top = max(loads)
        crit = [r for r in range(n) if loads[r] == top]
        # Only a slow replica alone on the critical path can shorten the step by giving.
        if len(crit) != 1 or crit[0] not in slow or counts[crit[0]] <= 1:
            break
        src = crit[0]
        cands = receivers.get(src, [])
        if not cands:
            break
        dst = min(cands, key=lambda j: ((counts[j] + 1) * times[j], j))
        if (counts[dst] + 1) * times[dst] >= top:
            break
        counts[src] -= 1
        counts[dst] += 1
        moved.append((src, dst))
    return counts, moved


def plan_rebalance(
    times: Sequence[Optional[float]], slow: Sequence[int], microbatches: int
) -> Assignment:
    """The counts and moves that minimise the predicted step time (module docstring).

    Args:
        times: Per replica, its smoothed time per micro-batch (s); None where unknown (such a
            replica neither gives nor receives).
        slow: Replicas marked slow (the only ones that give).
        microbatches: ``M``, micro-batches per replica in the balanced plan.
    """
    n = len(times)
    base = balanced(n, microbatches)
    slow_set = frozenset(r for r in slow if times[r] is not None)
    healthy = [r for r in range(n) if r not in slow_set and times[r] is not None]
    if not slow_set or not healthy:
        return base
    # A replica without a measurement is assumed at the median speed for the critical path.
    known = sorted(t for t in times if t is not None)
    t = [known[(len(known) - 1) // 2] if x is None else float(x) for x in times]
    balanced_step = step_time(base.counts, t)
    best: Optional[Assignment] = None
    for rule in TARGETS:
        if rule == "spread":
            receivers = {s: list(healthy) for s in slow_set}
        else:  # the next healthy replica on the ring
            receivers = {
                s: [next((s + d) % n for d in range(1, n) if (s + d) % n in healthy)]
                for s in slow_set
            }
        counts, moved = _fill(t, slow_set, receivers, microbatches)
        # Each source gives the last micro-batches of its share, dealt in move order.
        given: Dict[int, int] = {}
        moves = []
        for src, dst in moved:
            given[src] = given.get(src, 0) + 1
            moves.append((src, microbatches - given[src], dst))
        cand = Assignment(
            tuple(counts), tuple(sorted(moves)), rule, step_time(counts, t), balanced_step
        )
        if best is None or cand.predicted_step < best.predicted_step:
            best = cand
    assert best is not None
    if not best.moves:
        return Assignment(base.counts, balanced_step=balanced_step, predicted_step=balanced_step)
    return best


class RebalancePolicy(TakeoverPolicy):
    """Wraps the job's takeover policy; failure-free steps follow :attr:`assignment`.

    Everything else (``record``, ``decisions``, ``log_line``, ``rescale`` of ``auto``) is the
    wrapped policy's.

    Args:
        inner: The takeover policy of ``--mecefo-policy``.
    """

    PLAN_NAME = "rebalance"
    """The ``policy`` of a rebalanced :class:`StepPlan`."""

    def __init__(self, inner: TakeoverPolicy) -> None:
        super().__init__(skip_attention=inner.skip_attention)
        self.inner = inner
        self.name = inner.name  # what the run reports as the takeover policy
        self.min_replicas = inner.min_replicas
        self.assignment: Optional[Assignment] = None

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this object lacks: the wrapped policy's extras.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self) -> None:
        """Back to the balanced plan; reset the wrapped policy too."""
        self.assignment = None
        reset = getattr(self.inner, "reset", None)
        if reset is not None:
            reset()

    def plan(
        self, iteration: int, failed: FrozenSet[int], num_replicas: int, microbatches: int
    ) -> StepPlan:
        """The wrapped policy's plan when a replica is down or nothing moves; else the
        rebalanced, all-exact plan."""
        a = self.assignment
        if failed or a is None or not a.active:
            return self.inner.plan(iteration, failed, num_replicas, microbatches)
        return rebalanced_plan(iteration, a, num_replicas, microbatches, self.skip_attention)


def rebalanced_plan(
    iteration: int, a: Assignment, num_replicas: int, microbatches: int, skip_attention: bool
) -> StepPlan:
    """The :class:`StepPlan` of assignment ``a``: own micro-batches less the given ones, then
    the received ones in (source, index) order, all exact."""
    gone = {(s, k): dst for s, k, dst in a.moves}
    work: List[List[MicrobatchWork]] = [
        [MicrobatchWork(r, k, EXACT) for k in range(microbatches) if (r, k) not in gone]
        for r in range(num_replicas)
    ]
    for (s, k), dst in sorted(gone.items()):
        work[dst].append(MicrobatchWork(s, k, EXACT))
    return StepPlan(
        iteration,
        RebalancePolicy.PLAN_NAME,
        num_replicas,
        microbatches,
        (),
        tuple(tuple(w) for w in work),
        skip_attention=skip_attention,
    )


@dataclass
class RebalanceController:
    """Decides, after each step's detection, whether the assignment changes (hysteresis).

    The assignment changes when the slow set changes (a replica turned slow: rebalance; every
    slow replica recovered: give everything back), or when the re-optimised assignment under
    the current speeds predicts a step at least ``replan_gain`` shorter than the current one;
    in both cases only if ``window`` steps have passed since the last change.

    Args:
        num_replicas: Data-parallel size.
        microbatches: ``M``.
        window: Least steps between two changes.
        replan_gain: Least relative gain of a re-optimisation.
    """

    num_replicas: int
    microbatches: int
    window: int
    replan_gain: float
    assignment: Assignment = field(init=False)
    last_change: int = field(default=-(10**9), init=False)
    changes: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Back to the balanced assignment, free to change at once."""
        self.assignment = balanced(self.num_replicas, self.microbatches)
        self.last_change = -(10**9)

    def update(
        self, step: int, times: Sequence[Optional[float]], slow: Sequence[int]
    ) -> Optional[Assignment]:
        """The new assignment after ``step``, or None when it stays."""
        if step - self.last_change < self.window:
            return None
        cur = self.assignment
        givers = tuple(sorted(cur.given_away()))
        if not slow:
            if not cur.active:
                return None
            new = balanced(self.num_replicas, self.microbatches)
        else:
            new = plan_rebalance(times, slow, self.microbatches)
            if givers == tuple(sorted(new.given_away())) and cur.active:
                known = [t for t in times if t is not None]
                if len(known) != len(times):
                    return None
                now = step_time(cur.counts, [float(t) for t in times])  # type: ignore[arg-type]
                if new.predicted_step > now * (1.0 - self.replan_gain):
                    return None
            if new.moves == cur.moves:
                return None
        self.assignment = new
        self.last_change = step
        self.changes += 1
        return new
