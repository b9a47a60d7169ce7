"""Failure schedules: which data-parallel replicas are down at each iteration.

Every schedule is a fixed list of :class:`FailureEvent` computed up front from its arguments
and a seed, so every rank derives the same events without communicating. Iterations are
Megatron's logged iteration numbers (1-based): an event ``(replica, fail, recover)`` takes the
replica out of iterations ``fail, fail + 1, ..., recover - 1``.

Four sources, all selected by flags (see :mod:`megatron_mecefo.takeover.arguments`):

* scripted: events given explicitly;
* the paper's three scenarios (MeCeFO Table 1), mapped to iterations through a nominal step
  time;
* Poisson failures per replica, from an MTBF and an MTTR;
* replay of a JSON trace.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

PAPER_SCENARIOS: Dict[str, Tuple[float, float]] = {
    "low": (2.0, 4.0),
    "mid": (1.0, 3.0),
    "high": (0.5, 2.0),
}
"""MeCeFO Table 1: (hours between failures, hours until the failed replica recovers)."""

NEVER = 2**62
"""Recovery iteration of a replica that does not come back within the run."""


class ScheduleError(ValueError):
    """A schedule that cannot be applied to this job; the message names the fix."""


@dataclass(frozen=True, order=True)
class FailureEvent:
    """Replica ``replica`` is down for iterations ``[fail_iteration, recover_iteration)``."""

    fail_iteration: int
    recover_iteration: int
    replica: int

    def covers(self, iteration: int) -> bool:
        """Whether the replica is down at ``iteration``."""
        return self.fail_iteration <= iteration < self.recover_iteration

    def to_json(self) -> dict:
        """The trace-file form of the event (see :meth:`FailureSchedule.replay`)."""
        recover = None if self.recover_iteration >= NEVER else self.recover_iteration
        return {
            "replica": self.replica,
            "fail_iteration": self.fail_iteration,
            "recover_iteration": recover,
        }


class FailureSchedule:
    """An immutable list of failure events over ``num_replicas`` replicas.

    Args:
        events: The events; two events of one replica must not overlap.
        num_replicas: Data-parallel size; every event's replica must be below it.
        description: One line for the run log.
    """

    def __init__(
        self, events: Iterable[FailureEvent], num_replicas: int, description: str = ""
    ) -> None:
        self.num_replicas = int(num_replicas)
        self.events: Tuple[FailureEvent, ...] = tuple(sorted(events))
        self.description = description or f"{len(self.events)} failure event(s)"
        for e in self.events:
            if not 0 <= e.replica < self.num_replicas:
                raise ScheduleError(
                    f"failure event {e.to_json()} names replica {e.replica}, but there are "
                    f"only {self.num_replicas} data-parallel replicas (0..{self.num_replicas - 1})"
                )
            if e.fail_iteration < 1 or e.recover_iteration <= e.fail_iteration:
                raise ScheduleError(
                    f"failure event {e.to_json()}: need 1 <= fail_iteration < recover_iteration"
                )
        by_replica: Dict[int, List[FailureEvent]] = {}
        for e in self.events:
            by_replica.setdefault(e.replica, []).append(e)
        for replica, evs in by_replica.items():
            for a, b in zip(evs, evs[1:], strict=False):
                if b.fail_iteration < a.recover_iteration:
                    raise ScheduleError(
                        f"replica {replica} fails at iteration {b.fail_iteration} while still "
                        f"down from iteration {a.fail_iteration} (until {a.recover_iteration}); "
                        "events of one replica must not overlap"
                    )

    def failed_at(self, iteration: int) -> FrozenSet[int]:
        """The replicas that are down at (1-based) ``iteration``."""
        return frozenset(e.replica for e in self.events if e.covers(iteration))

    def failed_by_iteration(self, train_iters: int) -> List[FrozenSet[int]]:
        """``failed_at`` of every iteration ``1..train_iters`` in one sweep (index 0: none).

        One pass over the events instead of one per iteration: long traces (tens of thousands
        of iterations, hundreds of events) are walked this way.
        """
        down: List[set] = [set() for _ in range(train_iters + 1)]
        for e in self.events:
            for it in range(e.fail_iteration, min(e.recover_iteration, train_iters + 1)):
                down[it].add(e.replica)
        return [frozenset(d) for d in down]

    def degraded_iterations(self, train_iters: int) -> int:
        """How many of iterations ``1..train_iters`` have at least one replica down."""
        return sum(bool(s) for s in self.failed_by_iteration(train_iters))

    def to_json(self) -> dict:
        """A trace that :meth:`replay` reads back into the same schedule."""
        return {"num_replicas": self.num_replicas, "events": [e.to_json() for e in self.events]}

    def __repr__(self) -> str:
        return f"FailureSchedule({self.description}: {[e.to_json() for e in self.events]})"

    # ------------------------------------------------------------------ constructors
    @classmethod
    def none(cls, num_replicas: int) -> FailureSchedule:
        """No failures."""
        return cls((), num_replicas, "no failures")

    @classmethod
    def scripted(cls, specs: Sequence[str], num_replicas: int) -> FailureSchedule:
        """Events written as ``REPLICA:FAIL[:RECOVER]`` (no RECOVER: down until the end)."""
        events = []
        for spec in specs:
            parts = spec.split(":")
            try:
                if len(parts) not in (2, 3):
                    raise ValueError
                numbers = [int(p) for p in parts]
            except ValueError:
                raise ScheduleError(
                    f"failure {spec!r}: expected REPLICA:FAIL_ITERATION[:RECOVER_ITERATION], "
                    "e.g. 1:30:60"
                ) from None
            recover = numbers[2] if len(numbers) == 3 else NEVER
            events.append(FailureEvent(numbers[1], recover, numbers[0]))
        return cls(events, num_replicas, f"scripted: {' '.join(specs)}")

    @classmethod
    def periodic(
        cls,
        num_replicas: int,
        train_iters: int,
        fail_every_iters: float,
        recover_after_iters: float,
        seed: int,
        description: str = "",
    ) -> FailureSchedule:
        """A failure every ``fail_every_iters``, each lasting ``recover_after_iters``.

        The victim is drawn by a seeded RNG, uniformly among the replicas up at that time;
        a failure that would take the last replica down is dropped (the job would stop and
        restart from a checkpoint, which is outside what a policy can serve).
        """
        if not fail_every_iters > 0 or not recover_after_iters >= 0:
            raise ScheduleError(
                f"periodic schedule: failure interval {fail_every_iters} and recovery time "
                f"{recover_after_iters} iterations must be positive"
            )
        rng = random.Random(seed)
        events: List[FailureEvent] = []
        recover_at: Dict[int, int] = {}  # replica -> recovery iteration of its last failure
        # One draw per failure: the loop runs ceil(train_iters / fail_every_iters) times and
        # each pass costs O(num_replicas), never O(events).
        for k in range(1, int(train_iters / fail_every_iters) + 2):
            fail = max(1, _ceil(k * fail_every_iters))
            if fail > train_iters:
                break
            recover = max(fail + 1, _ceil(k * fail_every_iters + recover_after_iters))
            up = [r for r in range(num_replicas) if recover_at.get(r, 0) <= fail]
            if len(up) > 1:
                victim = rng.choice(up)
                events.append(FailureEvent(fail, recover, victim))
                recover_at[victim] = recover
        return cls(events, num_replicas, description)

    @classmethod
    def paper(
        cls,
        scenario: str,
        num_replicas: int,
        train_iters: int,
        step_time_s: float,
        seed: int,
        reference_replicas: Optional[int] = None,
    ) -> FailureSchedule:
        """MeCeFO's low / mid / high scenario, with one iteration taking ``step_time_s``.

        Args:
            reference_replicas: If given, the scenario's failure interval is taken as that of a
                cluster of this many replicas (the paper's 32) and scaled by
                ``reference_replicas / num_replicas``, so each replica fails as often as one
                of the paper's; recovery times are per replica and stay as they are. None:
                the interval is used literally for this cluster.
        """
        if scenario not in PAPER_SCENARIOS:
            raise ScheduleError(f"scenario {scenario!r}: use one of {sorted(PAPER_SCENARIOS)}")
        fail_h, recover_h = PAPER_SCENARIOS[scenario]
        scaled = ""
        if reference_replicas is not None:
            if reference_replicas < 1:
                raise ScheduleError(f"reference_replicas={reference_replicas}: must be >= 1")
            fail_h = fail_h * reference_replicas / num_replicas
            scaled = f" (per-replica rate of a {reference_replicas}-replica cluster)"
        every = fail_h * 3600.0 / step_time_s
        after = recover_h * 3600.0 / step_time_s
        text = (
            f"paper '{scenario}': a failure every {fail_h:g} h{scaled}, recovery after "
            f"{recover_h:g} h; at {step_time_s:g} s/iteration: every {every:.1f} iterations, "
            f"down for {after:.1f}"
        )
        return cls.periodic(num_replicas, train_iters, every, after, seed, text)

    @classmethod
    def poisson(
        cls,
        num_replicas: int,
        train_iters: int,
        step_time_s: float,
        mtbf_hours: float,
        mttr_hours: float,
        seed: int,
    ) -> FailureSchedule:
        """Each replica fails at rate 1/MTBF while up and is repaired after Exp(MTTR).

        Like :meth:`periodic`, a failure that would take the last replica down is dropped.
        """
        if mtbf_hours <= 0 or mttr_hours <= 0:
            raise ScheduleError("Poisson schedule: MTBF and MTTR must be positive")
        if mtbf_hours * 3600.0 < step_time_s:
            # More than one failure per replica and iteration: not a failure model, and the
            # number of events to draw would grow without bound.
            raise ScheduleError(
                f"Poisson schedule: an MTBF of {mtbf_hours:g} h is shorter than one iteration "
                f"({step_time_s:g} s); use an MTBF of at least {step_time_s / 3600.0:g} h"
            )
        rng = random.Random(seed)
        horizon = train_iters * step_time_s
        to_iter = lambda t: max(1, _ceil(t / step_time_s))  # noqa: E731
        # Competing exponential clocks: the next event is either a failure of one of the up
        # replicas or the repair of one of the down ones.
        t, down, events = 0.0, {}, []  # down: replica -> repair time
        last_recover: Dict[int, int] = {}  # replica -> recovery iteration of its last event
        while True:
            up = [r for r in range(num_replicas) if r not in down]
            rate = len(up) / (mtbf_hours * 3600.0)
            next_fail = t + rng.expovariate(rate) if rate > 0 else math.inf
            next_repair = min(down.values(), default=math.inf)
            if min(next_fail, next_repair) > horizon:
                break
            if next_repair <= next_fail:
                t = next_repair
                down = {r: s for r, s in down.items() if s != next_repair}
                continue
            t = next_fail
            victim = rng.choice(up)
            if len(up) > 1:
                repair = t + rng.expovariate(1.0 / (mttr_hours * 3600.0))
                fail_i, rec_i = to_iter(t), to_iter(repair)
                if last_recover.get(victim, 0) > fail_i:
                    continue  # repaired and failed again inside one iteration: keep the first
                rec_i = max(rec_i, fail_i + 1)
                last_recover[victim] = rec_i
                # Down at least through iteration rec_i - 1, which ends at (rec_i - 1) * step:
                # a repair inside its own failure's iteration still costs that iteration.
                down[victim] = max(repair, (rec_i - 1) * step_time_s)
                events.append(FailureEvent(fail_i, rec_i, victim))
        text = (
            f"Poisson: MTBF {mtbf_hours:g} h and MTTR {mttr_hours:g} h per replica at "
            f"{step_time_s:g} s/iteration"
        )
        return cls(events, num_replicas, text)

    @classmethod
    def replay(
        cls, path: str, num_replicas: int, step_time_s: Optional[float] = None
    ) -> FailureSchedule:
        """Events from a JSON trace.

        The file holds ``{"events": [...]}`` or a bare list. Each event has ``replica`` and
        either ``fail_iteration`` / ``recover_iteration`` or ``fail_time_s`` /
        ``recover_time_s`` (mapped through ``step_time_s``); a missing or null recovery means
        the replica stays down.
        """
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ScheduleError(f"failure trace {path}: {err}") from None
        raw = data.get("events") if isinstance(data, dict) else data
        if not isinstance(raw, list):
            raise ScheduleError(f"failure trace {path}: expected a list of events")
        events = []
        for i, ev in enumerate(raw):
            try:
                replica = int(ev["replica"])
                if "fail_iteration" in ev:
                    fail = int(ev["fail_iteration"])
                    rec = ev.get("recover_iteration")
                    recover = NEVER if rec is None else int(rec)
                else:
                    if step_time_s is None:
                        raise ScheduleError(
                            f"failure trace {path}: event {i} is in seconds; pass a nominal "
                            "step time to map it to iterations"
                        )
                    fail = max(1, _ceil(float(ev["fail_time_s"]) / step_time_s))
                    rec = ev.get("recover_time_s")
                    recover = (
                        NEVER if rec is None else max(fail + 1, _ceil(float(rec) / step_time_s))
                    )
            except ScheduleError:
                raise
            except (KeyError, TypeError, ValueError) as err:
                raise ScheduleError(f"failure trace {path}: event {i} ({ev!r}): {err!r}") from None
            events.append(FailureEvent(fail, recover, replica))
        return cls(events, num_replicas, f"replay of {path}")


def _ceil(x: float) -> int:
    """``ceil`` that ignores float noise: 7 * (7200 / 7.0) is iteration 7200, not 7201."""
    return math.ceil(round(x, 6))
