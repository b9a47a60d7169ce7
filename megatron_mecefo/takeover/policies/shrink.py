"""The ``shrink`` choice of the recovery planner: data parallelism shrunk to the survivors."""

from __future__ import annotations

from megatron_mecefo.takeover.plan import EXACT, MicrobatchWork
from megatron_mecefo.takeover.policies.base import TakeoverPolicy


class ShrinkPolicy(TakeoverPolicy):
    """The survivors split the global batch evenly and exactly, as a data-parallel group of
    ``n - k`` would: the failed replicas' micro-batches are dealt round-robin over every alive
    replica in exact mode.

    Not a ``--mecefo-policy`` value: only ``--mecefo-policy auto`` takes it, where a real
    failure's regroup makes it possible (:mod:`megatron_mecefo.planner.recovery_planner`).
    Under a simulated failure its plan is the same gradient (every micro-batch exact, the mean
    over the global batch); the regroup itself is what the planner charges for it.
    """

    name = "shrink"
    min_replicas = 2

    def assign(self, failed, alive, microbatches, work):  # noqa: D102
        for r in alive:
            work[r] += [MicrobatchWork(r, k, EXACT) for k in range(microbatches)]
        deal = 0
        for f in failed:
            for k in range(microbatches):
                work[alive[deal % len(alive)]].append(MicrobatchWork(f, k, EXACT))
                deal += 1
        return {}, [], []
