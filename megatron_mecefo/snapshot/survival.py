"""Survival probability of the newest snapshot, to pick the redundancy m and the interval K.

Model (REFT's setting, our formula): each node fails independently within one snapshot
interval with probability ``p = 1 - exp(-K * step_time / node_mtbf)``. A group of ``n`` data
parallel peers (the ``n`` nodes holding one TP/PP position's shards, one per node, plus the
parity of :mod:`megatron_mecefo.snapshot.erasure`) keeps its snapshot while at most ``m`` of
its nodes fail: ``P_group = sum_{i<=m} C(n, i) p^i (1-p)^(n-i)``. A replica that spans
``s`` nodes gives ``s`` node-disjoint groups, so ``P_job = P_group ** s``. Trainer crashes
that leave the node up do not count: the holder process keeps those snapshots.

``python -m megatron_mecefo.snapshot.survival --dp 8 --node-mtbf-hours 2000 --step-time-s 2
--interval 10`` prints the table for every m.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import List, Optional


def node_failure_probability(interval: int, step_time_s: float, node_mtbf_hours: float) -> float:
    """Probability that one node fails within one snapshot interval (exponential lifetimes)."""
    return 1.0 - math.exp(-interval * step_time_s / (node_mtbf_hours * 3600.0))


def group_survival(n: int, m: int, p: float) -> float:
    """Probability that at most ``m`` of ``n`` independent nodes fail (each with prob. ``p``)."""
    if not 0 <= m < n:
        raise ValueError(f"redundancy m={m} must be in [0, {n - 1}] for a group of {n}")
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(m + 1))


def group_loss(n: int, m: int, p: float) -> float:
    """``1 - group_survival``, summed directly so that tiny values keep their precision."""
    if not 0 <= m < n:
        raise ValueError(f"redundancy m={m} must be in [0, {n - 1}] for a group of {n}")
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(m + 1, n + 1))


def job_loss(dp: int, m: int, p: float, nodes_per_replica: int = 1) -> float:
    """Probability that some group of the job loses its newest snapshot in one interval."""
    return -math.expm1(nodes_per_replica * math.log1p(-group_loss(dp, m, p)))


def job_survival(dp: int, m: int, p: float, nodes_per_replica: int = 1) -> float:
    """Probability that every group of the job keeps its newest snapshot."""
    return group_survival(dp, m, p) ** nodes_per_replica


def memory_overhead(dp: int, m: int) -> float:
    """Parity bytes per node, as a fraction of the node's own snapshot: m / (n - m)."""
    return m / (dp - m)


def table(
    dp: int, interval: int, step_time_s: float, node_mtbf_hours: float, nodes_per_replica: int = 1
) -> List[str]:
    p = node_failure_probability(interval, step_time_s, node_mtbf_hours)
    lines = [
        f"DP {dp} x {nodes_per_replica} node(s) per replica, snapshot every {interval} steps "
        f"of {step_time_s:g} s, node MTBF {node_mtbf_hours:g} h: p(node fails in an "
        f"interval) = {p:.3e}",
        f"{'m':>3} {'P(snapshot survives)':>22} {'P(lost) per interval':>22} {'parity memory':>14}",
    ]
    for m in range(dp):
        s = job_survival(dp, m, p, nodes_per_replica)
        lost = job_loss(dp, m, p, nodes_per_replica)
        lines.append(f"{m:>3} {s:>22.12f} {lost:>22.3e} {memory_overhead(dp, m):>13.0%}")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Snapshot survival probability per redundancy m")
    parser.add_argument("--dp", type=int, required=True, help="data-parallel replicas (n)")
    parser.add_argument("--interval", type=int, default=1, help="K, steps between snapshots")
    parser.add_argument("--step-time-s", type=float, default=1.0)
    parser.add_argument("--node-mtbf-hours", type=float, default=1000.0)
    parser.add_argument("--nodes-per-replica", type=int, default=1)
    a = parser.parse_args(argv)
    if a.dp < 2 or a.interval < 1 or a.step_time_s <= 0 or a.node_mtbf_hours <= 0:
        parser.error("need --dp >= 2, --interval >= 1, positive --step-time-s and MTBF")
    print("\n".join(table(a.dp, a.interval, a.step_time_s, a.node_mtbf_hours, a.nodes_per_replica)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
