"""The ``exact`` baseline: the ring neighbour runs the failed replica's micro-batches exactly."""

from __future__ import annotations

from megatron_mecefo.takeover.plan import EXACT, MicrobatchWork
from megatron_mecefo.takeover.policies.base import TakeoverPolicy, ring_neighbours


class ExactPolicy(TakeoverPolicy):
    """Baseline: the ring neighbour runs the failed replica's micro-batches too, exactly."""

    name = "exact"
    min_replicas = 2

    def assign(self, failed, alive, microbatches, work):  # noqa: D102
        neighbours, notes = ring_neighbours(failed, alive, len(work))
        for r in alive:
            work[r] += [MicrobatchWork(r, k, EXACT) for k in range(microbatches)]
        for f, nb in neighbours.items():
            work[nb] += [MicrobatchWork(f, k, EXACT) for k in range(microbatches)]
        return neighbours, [], notes
