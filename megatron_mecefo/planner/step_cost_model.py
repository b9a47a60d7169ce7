"""Critical-path step-time model of one data-parallel iteration under a takeover plan.

A step ends when the slowest replica has run its micro-batches and the gradients are synced and
applied. With ``plan`` the real :class:`~megatron_mecefo.takeover.plan.StepPlan` of a policy:

    step_time = max_r sum(cost(mb) for mb in plan.work[r]) + optimizer + sync(n)

``cost`` is ``exact`` for an exact micro-batch and ``takeover`` for a takeover one. The sync is
a ring all-reduce of the whole gradient, whose time grows as ``2(n-1)/n`` from the replica count
it was measured at. A failed replica still takes part in the sync (a simulated failure keeps
its process), so the fixed costs are the same in healthy and degraded steps. Pipeline bubbles
are not modelled (PP = 1).

Throughput is samples of the global batch per second, relative to failure-free:
``(processed / total) * failure_free_time / step_time``. The physical limits the issue names:
an exact method that spreads the lost work perfectly reaches ``(n-k)/n``; a takeover method at
cost ``c = takeover / exact`` reaches ``1 / (1 + c k / (n-k))``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, FrozenSet, Optional

from megatron_mecefo.takeover.plan import TAKEOVER, StepPlan
from megatron_mecefo.takeover.policies import build_policy


def spaced_failures(n: int, k: int) -> FrozenSet[int]:
    """k failed replicas spread evenly over the ring (``i n / k``), the same on every run."""
    return frozenset(i * n // k for i in range(k))


def limit_exact(n: int, k: int) -> float:
    """Throughput bound of an exact method: the survivors' share of the work."""
    return (n - k) / n


def limit_takeover(n: int, k: int, c: float) -> float:
    """Throughput bound of a takeover method whose extra micro-batches cost ``c`` each."""
    return 1.0 / (1.0 + c * k / (n - k)) if k < n else 0.0


@dataclass(frozen=True)
class StepCostModel:
    """Per-micro-batch and per-step costs, all in one unit (ms, or exact micro-batches).

    Attributes:
        exact: One exact micro-batch (the whole model: block, embedding, output, loss).
        takeover: One takeover micro-batch.
        optimizer: The optimizer step, once per step on every replica.
        sync: The gradient all-reduce, as measured with ``sync_replicas`` replicas.
        sync_replicas: Replica count the sync was measured at.
    """

    exact: float
    takeover: float
    optimizer: float
    sync: float
    sync_replicas: int

    @property
    def c(self) -> float:
        """Cost of a takeover micro-batch relative to an exact one."""
        return self.takeover / self.exact

    def sync_time(self, n: int) -> float:
        """Ring all-reduce time at ``n`` replicas (bandwidth term ``2(n-1)/n``)."""
        m = self.sync_replicas
        return self.sync * ((n - 1) / n) / ((m - 1) / m) if m > 1 else self.sync

    def replica_work(self, plan: StepPlan, replica: int) -> float:
        """Micro-batch time of one replica in ``plan``."""
        return sum(
            self.takeover if mb.mode is TAKEOVER else self.exact for mb in plan.work[replica]
        )

    def step_time(self, plan: StepPlan, extra: Optional[Dict[int, float]] = None) -> float:
        """Critical path of ``plan``; ``extra`` adds per-replica costs (e.g. a basis refresh)."""
        extra = extra or {}
        work = max(self.replica_work(plan, r) + extra.get(r, 0.0) for r in range(plan.num_replicas))
        return work + self.optimizer + self.sync_time(plan.num_replicas)

    def failure_free_time(self, n: int, microbatches: int) -> float:
        """Step time with every replica up."""
        return microbatches * self.exact + self.optimizer + self.sync_time(n)

    def limit_with_fixed(self, n: int, k: int, microbatches: int, takeover: bool) -> float:
        """The limits above with this model's fixed costs on both sides of the ratio.

        The survivors split the lost work perfectly: each runs ``M k/(n-k)`` more micro-batches,
        exact (cost 1) or takeover (cost c), and every step still pays optimizer and sync.
        """
        if k >= n:
            return 0.0
        m, fixed = microbatches, self.optimizer + self.sync_time(n)
        extra = m * k / (n - k) * (self.takeover if takeover else self.exact)
        return self.failure_free_time(n, m) / (m * self.exact + extra + fixed)

    def evaluate(self, policy: str, n: int, k: int, microbatches: int) -> Dict[str, Any]:
        """Step time and throughput of ``policy`` with k spaced replicas of n down."""
        plan = build_policy(policy).plan(1, spaced_failures(n, k), n, microbatches)
        healthy = self.failure_free_time(n, microbatches)
        row: Dict[str, Any] = {
            "policy": policy,
            "n": n,
            "k": k,
            "failed": sorted(plan.failed),
            "limit_exact": limit_exact(n, k),
            "limit_takeover": limit_takeover(n, k, self.c),
            "fallback": list(plan.notes),
        }
        if plan.no_update:
            row.update(step_time_rel=None, samples_per_s_rel=0.0, samples_skipped_frac=1.0)
            return row
        step = self.step_time(plan)
        processed = plan.processed / plan.total_microbatches
        critical = max(range(n), key=lambda r: self.replica_work(plan, r))
        row.update(
            step_time_rel=step / healthy,
            samples_per_s_rel=processed * healthy / step,
            samples_skipped_frac=1.0 - processed,
            critical_replica=critical,
            critical_microbatches=len(plan.work[critical]),
        )
        # Takeover policies are held to the takeover limit, exact and drop to the exact one,
        # with the same fixed costs as the policy's own step (the bare formulas leave them out).
        takeover = policy in ("neighbor", "spread")
        row["limit"] = "takeover" if takeover else "exact"
        row["limit_with_fixed_costs"] = self.limit_with_fixed(n, k, microbatches, takeover)
        row["ratio_to_limit"] = row["samples_per_s_rel"] / row["limit_with_fixed_costs"]
        return row

    def to_json(self) -> Dict[str, Any]:
        """The model's inputs, for the result files."""
        return {**asdict(self), "c": self.c}
