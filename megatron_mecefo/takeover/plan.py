"""The work plan of one iteration: who runs which micro-batch, in which mode, and the weights.

A plan (made by a takeover policy, :mod:`megatron_mecefo.takeover.policies`) says, for each
data-parallel replica, which micro-batches it runs (its own or ones absorbed from a failed
replica) and in which mode, which micro-batches are skipped, and how the gradients are
re-weighted. Every rank computes the same plan from the same arguments.

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
from typing import Dict, List, Tuple

from megatron_mecefo.techniques.state import MicrobatchMode

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
    def remapped(self) -> bool:
        """Whether some replica runs another's micro-batch (read by sample index): a takeover,
        or fail-slow rebalancing."""
        return any(mb.source != r for r, work in enumerate(self.work) for mb in work)

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
