"""Our ``spread`` policy: a failed replica's micro-batches are dealt over every alive replica."""

from __future__ import annotations

from megatron_mecefo.takeover.plan import EXACT, TAKEOVER, MicrobatchWork
from megatron_mecefo.takeover.policies.base import TakeoverPolicy


class SpreadPolicy(TakeoverPolicy):
    """Ours: the failed replicas' micro-batches are dealt round-robin over all alive
    replicas; only the absorbed ones run in takeover mode."""

    name = "spread"
    min_replicas = 2
    absorbed_mode = TAKEOVER
    """The mode the absorbed micro-batches run in."""

    def assign(self, failed, alive, microbatches, work):  # noqa: D102
        for r in alive:
            work[r] += [MicrobatchWork(r, k, EXACT) for k in range(microbatches)]
        deal = 0
        for f in failed:
            for k in range(microbatches):
                work[alive[deal % len(alive)]].append(MicrobatchWork(f, k, self.absorbed_mode))
                deal += 1
        return {}, [], []
