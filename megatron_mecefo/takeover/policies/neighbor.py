"""MeCeFO's ``neighbor`` policy (the paper): the next alive replica takes over, in takeover mode."""

from __future__ import annotations

from megatron_mecefo.takeover.plan import EXACT, TAKEOVER, MicrobatchWork
from megatron_mecefo.takeover.policies.base import TakeoverPolicy, ring_neighbours


class NeighborPolicy(TakeoverPolicy):
    """MeCeFO's rule: the next alive replica absorbs the failed one and runs all its work,
    own and absorbed, in takeover mode.

    The MHA group is averaged over the normal replicas. Fallback when no normal replica is
    left (e.g. DP = 2 with one failure): the neighbours run their own micro-batches exactly
    and only the absorbed ones in takeover mode, so the MHA group keeps an exact gradient.
    """

    name = "neighbor"
    min_replicas = 2

    def assign(self, failed, alive, microbatches, work):  # noqa: D102 (see the base class)
        neighbours, notes = ring_neighbours(failed, alive, len(work))
        absorbers = set(neighbours.values())
        normal = [r for r in alive if r not in absorbers]
        own_mode = TAKEOVER if normal else EXACT
        if not normal:
            notes.append(
                "no normal replica left (every alive replica absorbs one): neighbours run "
                "their own micro-batches exactly, the absorbed ones in takeover mode"
            )
        for r in alive:
            mode = own_mode if r in absorbers else EXACT
            work[r] += [MicrobatchWork(r, k, mode) for k in range(microbatches)]
        for f, nb in neighbours.items():
            work[nb] += [MicrobatchWork(f, k, TAKEOVER) for k in range(microbatches)]
        return neighbours, [], notes
