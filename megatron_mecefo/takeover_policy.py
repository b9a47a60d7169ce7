"""Takeover policies: turn (iteration, failed replicas) into a work plan for every replica.

A plan says, for each data-parallel replica, which micro-batches it runs (its own or ones
absorbed from a failed replica) and in which mode, which micro-batches are skipped, and how
the gradients are re-weighted. Every rank computes the same plan from the same arguments.

Re-weighting, with ``n`` replicas of ``M`` micro-batches each (Megatron's mean loss):

* every processed micro-batch's loss is multiplied by ``L_i / M`` on a replica running
  ``L_i`` micro-batches (the schedule divides by ``L_i``) and by ``n M / P`` when only ``P``
  of the ``n M`` micro-batches are processed (``drop``); after DDP's ``1/n`` average every
  non-MHA gradient is the mean over the processed micro-batches;
* the MHA-group gradient is zero on takeover micro-batches (skip-connection), so after the
  sync it is multiplied by ``P / E``, ``E`` being the micro-batches whose MHA gradient is
  exact; it becomes the mean over those. Under ``neighbor`` that is the paper's ``n/|N|``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Sequence, Tuple

from megatron_mecefo.state import MicrobatchMode

EXACT, TAKEOVER = MicrobatchMode.EXACT, MicrobatchMode.TAKEOVER


@dataclass(frozen=True)
class MicrobatchWork:
    """One micro-batch a replica runs: ``index`` of replica ``source``'s share, in ``mode``."""

    source: int
    index: int
    mode: MicrobatchMode


@dataclass(frozen=True)
class StepPlan:
    """The work plan of one iteration (see the module docstring for the weights)."""

    iteration: int
    policy: str
    num_replicas: int
    microbatches_per_replica: int
    failed: Tuple[int, ...]
    work: Tuple[Tuple[MicrobatchWork, ...], ...]
    """Per replica, the micro-batches it runs, in order; empty for a failed replica."""
    neighbours: Dict[int, int] = field(default_factory=dict)
    """Failed replica -> the replica that absorbed it (``neighbor`` and ``exact``)."""
    skipped: Tuple[Tuple[int, int], ...] = ()
    """(source, index) of the micro-batches nobody runs (``drop``, or every replica down)."""
    skip_attention: bool = True
    """Whether takeover micro-batches leave the MHA group at zero (MecefoConfig)."""
    notes: Tuple[str, ...] = ()
    """Fallbacks taken this iteration, one line each, for the run log."""

    @property
    def degraded(self) -> bool:
        """Whether any replica is down."""
        return bool(self.failed)

    @property
    def total_microbatches(self) -> int:
        """Micro-batches in the global batch (``n M``)."""
        return self.num_replicas * self.microbatches_per_replica

    @property
    def processed(self) -> int:
        """Micro-batches run by some replica."""
        return sum(len(w) for w in self.work)

    @property
    def no_update(self) -> bool:
        """Every replica is down: nothing is computed and the optimizer does not step."""
        return self.processed == 0

    @property
    def mha_exact(self) -> int:
        """Micro-batches whose MHA-group gradient is computed exactly."""
        return sum(1 for w in self.work for mb in w if mb.mode is EXACT or not self.skip_attention)

    @property
    def num_takeover(self) -> int:
        """Micro-batches run in takeover mode."""
        return sum(mb.mode is TAKEOVER for w in self.work for mb in w)

    def loss_weight(self, replica: int) -> float:
        """Factor on the loss of each of ``replica``'s micro-batches (mean-loss mode)."""
        local = len(self.work[replica])
        if local == 0:
            return 0.0
        return local / self.microbatches_per_replica * self.total_microbatches / self.processed

    @property
    def loss_weight_per_token(self) -> float:
        """Factor in per-token-loss mode: 1, the global token count already normalises."""
        return 1.0

    @property
    def mha_scale(self) -> float:
        """Post-sync factor on the MHA-group gradients (``P / E``; 1 when nothing is run)."""
        return self.processed / self.mha_exact if self.mha_exact else 1.0

    @property
    def mha_exact_fraction(self) -> float:
        """Share of the global batch whose MHA gradient is exact (``|N|/n`` for neighbor)."""
        return self.mha_exact / self.total_microbatches

    def modes(self, replica: int) -> List[MicrobatchMode]:
        """The modes of ``replica``'s micro-batches, in order."""
        return [mb.mode for mb in self.work[replica]]

    def summary(self) -> Dict[str, object]:
        """The metrics-record fields of this plan."""
        mbs = [len(w) for w in self.work]
        return {
            "failed_replicas": list(self.failed),
            "policy": self.policy,
            "neighbours": {str(k): v for k, v in sorted(self.neighbours.items())},
            "microbatches_per_replica": mbs,
            "takeover_microbatches": self.num_takeover,
            "mha_exact_fraction": self.mha_exact_fraction,
            "mha_scale": self.mha_scale,
            "microbatches_skipped": len(self.skipped),
            "fallback": list(self.notes),
        }


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


class SpreadPolicy(TakeoverPolicy):
    """Ours: the failed replicas' micro-batches are dealt round-robin over all alive
    replicas; only the absorbed ones run in takeover mode."""

    name = "spread"
    min_replicas = 2

    def assign(self, failed, alive, microbatches, work):  # noqa: D102
        for r in alive:
            work[r] += [MicrobatchWork(r, k, EXACT) for k in range(microbatches)]
        deal = 0
        for f in failed:
            for k in range(microbatches):
                work[alive[deal % len(alive)]].append(MicrobatchWork(f, k, TAKEOVER))
                deal += 1
        return {}, [], []


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


POLICIES = {p.name: p for p in (NeighborPolicy, SpreadPolicy, ExactPolicy, DropPolicy)}
"""Policy name (the ``--mecefo-policy`` value) -> class."""


def build_policy(name: str, skip_attention: bool = True) -> TakeoverPolicy:
    """The policy called ``name``."""
    if name not in POLICIES:
        raise ValueError(f"unknown takeover policy {name!r}: use one of {sorted(POLICIES)}")
    return POLICIES[name](skip_attention=skip_attention)
