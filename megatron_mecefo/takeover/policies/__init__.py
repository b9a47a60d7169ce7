"""Takeover policies: turn (iteration, failed replicas) into a work plan for every replica.

One small policy object per module, all with the :class:`~.base.TakeoverPolicy` interface
(``plan(iteration, failed, num_replicas, microbatches) -> StepPlan``):

* :mod:`.neighbor`: MeCeFO's rule, the next alive replica absorbs the failed one;
* :mod:`.spread`: ours, the failed replica's micro-batches are dealt over every alive one;
* :mod:`.exact`: baseline, the ring neighbour runs them exactly;
* :mod:`.drop`: baseline, they are skipped.
"""

from __future__ import annotations

from megatron_mecefo.takeover.policies.base import TakeoverPolicy, ring_neighbours
from megatron_mecefo.takeover.policies.drop import DropPolicy
from megatron_mecefo.takeover.policies.exact import ExactPolicy
from megatron_mecefo.takeover.policies.neighbor import NeighborPolicy
from megatron_mecefo.takeover.policies.spread import SpreadPolicy

POLICIES = {p.name: p for p in (NeighborPolicy, SpreadPolicy, ExactPolicy, DropPolicy)}
"""Policy name (the ``--mecefo-policy`` value) -> class."""


def build_policy(name: str, skip_attention: bool = True) -> TakeoverPolicy:
    """The policy called ``name``."""
    if name not in POLICIES:
        raise ValueError(f"unknown takeover policy {name!r}: use one of {sorted(POLICIES)}")
    return POLICIES[name](skip_attention=skip_attention)


__all__ = [
    "POLICIES",
    "DropPolicy",
    "ExactPolicy",
    "NeighborPolicy",
    "SpreadPolicy",
    "TakeoverPolicy",
    "build_policy",
    "ring_neighbours",
]
