"""The failed set from membership: real deaths become failure events of the takeover plan.

``MembershipSchedule`` has the :class:`~megatron_mecefo.takeover.failure_schedule.
FailureSchedule` interface the controller reads (``failed_at``, ``num_replicas``,
``description``, ``events``). Its events are those of the simulated schedule (if any) plus one
per real replica loss: a replica missing from a generation that starts at iteration ``t``
(the in-flight iteration that is redone, or the planned boundary) is down from ``t`` until the
generation that brings it back. Every member applies the same generations to the same event
list (it is part of the state a joiner receives), so every rank plans alike.
"""

from __future__ import annotations

from typing import FrozenSet, List, Sequence, Tuple

from megatron_mecefo.takeover.failure_schedule import NEVER, FailureEvent, FailureSchedule


class MembershipSchedule:
    """A simulated schedule plus the real failures of membership.

    Args:
        base: The simulated schedule (``none`` when only real failures count).
        real: Real events as ``(replica, fail_iteration, recover_iteration)``.
    """

    def __init__(self, base: FailureSchedule, real: Sequence[Tuple[int, int, int]] = ()) -> None:
        self.base = base
        self.num_replicas = base.num_replicas
        self.real: List[List[int]] = [list(e) for e in real]

    @property
    def description(self) -> str:
        real = ", ".join(
            f"replica {r} {f}-{'end' if t >= NEVER else t - 1}" for r, f, t in self.real
        )
        # The base schedule is the simulated one (--mecefo-fail); "no failures" there reads as
        # a contradiction next to the real ones.
        simulated = "none" if not self.base.events else self.base.description
        return f"simulated failures: {simulated}; real failures: {real or 'none'}"

    @property
    def events(self) -> Tuple[FailureEvent, ...]:
        return tuple(
            sorted(self.base.events + tuple(FailureEvent(f, t, r) for r, f, t in self.real))
        )

    def failed_at(self, iteration: int) -> FrozenSet[int]:
        real = {r for r, f, t in self.real if f <= iteration < t}
        return self.base.failed_at(iteration) | frozenset(real)

    def apply_generation(self, replicas: Sequence[int], start_iteration: int) -> List[str]:
        """Replicas ``replicas`` train from ``start_iteration`` on: open an event for each
        replica that just went missing, close the event of each that came back. Returns the
        log lines of the changes."""
        lines = []
        alive = set(replicas)
        down_now = {r for r, f, t in self.real if t >= NEVER}
        for event in self.real:
            if event[2] >= NEVER and event[0] in alive:
                event[2] = start_iteration
                lines.append(f"replica {event[0]} rejoined at iteration {start_iteration}")
        for r in range(self.num_replicas):
            if r not in alive and r not in down_now:
                self.real.append([r, start_iteration, NEVER])
                lines.append(f"replica {r} lost; failed from iteration {start_iteration} on")
        return lines
