"""The takeover-policy base class and the ring rule that ``neighbor`` and ``exact`` share."""

from __future__ import annotations

from typing import Dict, FrozenSet, List, Sequence, Tuple

from megatron_mecefo.takeover.plan import EXACT, MicrobatchWork, StepPlan


class TakeoverPolicy:
    """Base class: subclasses implement :meth:`assign`.

    Args:
        skip_attention: ``MecefoConfig.skip_attention``; decides whether takeover
            micro-batches count as MHA-exact.
    """

    name = "base"
    min_replicas = 1
    """Smallest data-parallel size the policy can serve a failure with."""

    def __init__(self, skip_attention: bool = True) -> None:
        self.skip_attention = skip_attention

    def plan(
        self, iteration: int, failed: FrozenSet[int], num_replicas: int, microbatches: int
    ) -> StepPlan:
        """The plan of ``iteration`` with ``failed`` replicas down."""
        failed_t = tuple(sorted(failed))
        alive = [r for r in range(num_replicas) if r not in failed]
        work: Dict[int, List[MicrobatchWork]] = {r: [] for r in range(num_replicas)}
        neighbours: Dict[int, int] = {}
        skipped: List[Tuple[int, int]] = []
        notes: List[str] = []
        if not alive:
            skipped = [(r, k) for r in range(num_replicas) for k in range(microbatches)]
            notes = ["every replica is down: no update this iteration, its samples skipped"]
        elif not failed:
            for r in range(num_replicas):
                work[r] = [MicrobatchWork(r, k, EXACT) for k in range(microbatches)]
        else:
            neighbours, skipped, notes = self.assign(failed_t, alive, microbatches, work)
        return StepPlan(
            iteration,
            self.name,
            num_replicas,
            microbatches,
            failed_t,
            tuple(tuple(work[r]) for r in range(num_replicas)),
            neighbours=neighbours,
            skipped=tuple(skipped),
            skip_attention=self.skip_attention,
            notes=tuple(notes),
        )

    def assign(
        self,
        failed: Tuple[int, ...],
        alive: List[int],
        microbatches: int,
        work: Dict[int, List[MicrobatchWork]],
    ) -> Tuple[Dict[int, int], List[Tuple[int, int]], List[str]]:
        """Fill ``work`` (empty lists) for a step with some but not all replicas down.

        Returns:
            (failed -> absorbing replica, skipped (source, index) pairs, fallback notes).
        """
        raise NotImplementedError


def ring_neighbours(
    failed: Sequence[int], alive: Sequence[int], num_replicas: int
) -> Tuple[Dict[int, int], List[str]]:
    """Each failed replica's absorber: the next alive replica on the ring ``0..n-1``.

    A replica absorbs at most one failed replica while an alive replica that absorbs nothing
    is left: a failed replica whose ring neighbour is taken goes to the next free one. Only
    when more replicas are down than up does a neighbour absorb two or more (noted).
    """
    taken: Dict[int, int] = {}
    notes: List[str] = []
    alive_set = set(alive)
    for f in failed:
        ring = [(f + d) % num_replicas for d in range(1, num_replicas)]
        candidates = [r for r in ring if r in alive_set]
        free = [r for r in candidates if r not in taken.values()]
        nb = free[0] if free else candidates[0]
        if nb != candidates[0]:
            notes.append(
                f"replica {f}'s ring neighbour {candidates[0]} already absorbs replica "
                f"{[k for k, v in taken.items() if v == candidates[0]][0]}; replica {nb} "
                f"absorbs {f}"
            )
        elif not free:
            notes.append(f"more replicas down than up: replica {nb} absorbs replica {f} as well")
        taken[f] = nb
    return taken, notes
