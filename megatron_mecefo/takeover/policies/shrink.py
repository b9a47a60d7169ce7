"""The ``shrink`` choice of the recovery planner: data parallelism shrunk to the survivors."""

from __future__ import annotations

from megatron_mecefo.takeover.plan import EXACT
from megatron_mecefo.takeover.policies.spread import SpreadPolicy


class ShrinkPolicy(SpreadPolicy):
    """The survivors split the global batch evenly and exactly, as a data-parallel group of
    ``n - k`` would: the failed replicas' micro-batches are dealt round-robin over every alive
    replica (``spread``'s deal) in exact mode.

    Not a ``--mecefo-policy`` value: only ``--mecefo-policy auto`` takes it, where a real
    failure's regroup makes it possible (:mod:`megatron_mecefo.planner.recovery_planner`).
    Under a simulated failure its plan is the same gradient (every micro-batch exact, the mean
    over the global batch); the regroup itself is what the planner charges for it.
    """

    name = "shrink"
    absorbed_mode = EXACT
