"""The survival calculator against brute-force enumeration of node failures."""

from __future__ import annotations

import itertools
import math

import pytest

from megatron_mecefo.snapshot import survival


@pytest.mark.parametrize("n,m", [(2, 1), (4, 0), (4, 1), (4, 2), (6, 3)])
def test_group_survival_matches_enumeration(n: int, m: int) -> None:
    p = 0.13
    brute = sum(
        math.prod(p if f else 1 - p for f in fails)
        for fails in itertools.product([0, 1], repeat=n)
        if sum(fails) <= m
    )
    assert survival.group_survival(n, m, p) == pytest.approx(brute, rel=1e-12)
    assert survival.group_loss(n, m, p) == pytest.approx(1 - brute, rel=1e-9)
    # Two node-disjoint groups survive only together.
    assert survival.job_survival(n, m, p, 2) == pytest.approx(brute**2, rel=1e-12)
