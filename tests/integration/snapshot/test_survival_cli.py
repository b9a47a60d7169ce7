"""The survival calculator's command line (``python -m megatron_mecefo.snapshot.survival``):
tiny loss probabilities keep their precision, and it prints every m."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from conftest import child_env

from megatron_mecefo.snapshot import survival


def test_small_probabilities_keep_precision_and_cli_prints_every_m() -> None:
    p = survival.node_failure_probability(10, 2.0, 1000.0)
    assert p == pytest.approx(20 / 3.6e6, rel=1e-5)
    assert survival.job_loss(8, 1, p) == pytest.approx(math.comb(8, 2) * p**2, rel=1e-4)
    with pytest.raises(ValueError, match="redundancy m=4"):
        survival.group_survival(4, 4, p)
    out = subprocess.run(
        [sys.executable, "-m", "megatron_mecefo.snapshot.survival", "--dp", "4",
         "--interval", "10", "--step-time-s", "2"],
        env=child_env(), capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["0", "1", "2", "3"]
