"""The ``drop`` baseline (torchft-like): a failed replica's samples are skipped."""

from __future__ import annotations

from megatron_mecefo.takeover.plan import EXACT, MicrobatchWork
from megatron_mecefo.takeover.policies.base import TakeoverPolicy


class DropPolicy(TakeoverPolicy):
    """Baseline (torchft-like): the failed replicas' samples are skipped this iteration and
    the gradient is the mean over the survivors' micro-batches."""

    name = "drop"
    min_replicas = 1

    def assign(self, failed, alive, microbatches, work):  # noqa: D102
        for r in alive:
            work[r] += [MicrobatchWork(r, k, EXACT) for k in range(microbatches)]
        skipped = [(f, k) for f in failed for k in range(microbatches)]
        return {}, skipped, []
