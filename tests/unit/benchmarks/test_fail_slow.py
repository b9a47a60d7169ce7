"""benchmarks/fail_slow.py's arithmetic: the whole-micro-batch ideal and the steady-state
throughput of a run's records (the runs themselves are the benchmark's, under the heavy lock)."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import fail_slow  # noqa: E402


@pytest.mark.parametrize("n,m,share", [(2, 4, 4 / 6), (2, 8, 8 / 11), (4, 4, 0.8), (4, 8, 0.8)])
def test_integer_ideal(n: int, m: int, share: float) -> None:
    # DP2, M = 4: 5 + 3 micro-batches, the slow one's 3 at 2x = 6 units for the 4 of a healthy
    # step; the sum-of-speeds ideal (0.75) is out of reach with whole micro-batches.
    assert fail_slow.integer_ideal(n, m, 0.5) == pytest.approx(share)
    assert share <= (n - 0.5) / n


def test_summarise_counts_only_the_steady_iterations() -> None:
    recs = [
        {"iteration": i, "step_time_s": 10.0 if i <= 2 else 0.5,
         "mecefo": {"samples_processed": 16, "microbatches_per_replica": [5, 3]},
         "fail_slow": {"ratio": [1.0, 2.0], "rebalanced": i > 3, "slow": [1] if i > 1 else []}}
        for i in range(1, 7)
    ]  # fmt: skip
    out = fail_slow.summarise(recs, warmup=2)
    assert out["samples_per_s"] == pytest.approx(32.0) and out["steady_iterations"] == 4
    assert out["rebalanced_steps"] == 3 and out["first_iteration_marked_slow"] == 2
