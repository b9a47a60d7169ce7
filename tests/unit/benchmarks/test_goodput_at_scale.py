"""``benchmarks/goodput_at_scale.py``: the closed-form ETTR model with published inputs."""

from __future__ import annotations

import math
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import goodput_at_scale as gas  # noqa: E402


def test_rates_are_the_published_figures() -> None:
    """Llama 3: 419 interruptions in 54 days at 16,384 GPUs; Meta: MTTF 1.8 h at 16,384."""
    assert 1 / gas.rate_per_s("llama3_rate", 16384) / 3600 == pytest.approx(54 * 24 / 419)
    assert 1 / gas.rate_per_s("meta_rsc_16k_rate", 16384) / 3600 == pytest.approx(1.8)


def test_shrink_follows_the_measured_table_then_extrapolates() -> None:
    assert gas.shrink_s(32) == 1.53 and gas.shrink_s(1024) == 2.02
    assert gas.shrink_s(16384) == pytest.approx(2.02 + 0.3 * 4)


def test_checkpoint_restart_is_young_daly() -> None:
    lam, save, restart = 1 / 3600, 30.0, 600.0
    tau = math.sqrt(2 * save / lam)
    assert gas.checkpoint_restart(lam, save, restart) == pytest.approx(
        1 - save / tau - lam * (tau / 2 + restart)
    )


def test_mecefo_and_torchft_differ_by_takeover_cost_against_dropped_share() -> None:
    """With the same regroup, torchft drops k of n shares and MeCeFO spread pays c k/(n-k):
    with c < 1 MeCeFO is ahead, and the regroup time moves both alike."""
    inp = dict(gas.INPUTS)
    lam = gas.rate_per_s("llama3_rate", 16384)
    me = gas.mecefo(lam, 16384, 5.0, inp, "spread")
    tft = gas.torchft(lam, 16384, 5.0, 0.0, inp)["ettr"]
    assert me > tft and me - tft < 1e-3
    assert gas.mecefo(lam, 16384, 60.0, inp) < gas.mecefo(lam, 16384, 5.0, inp)


def test_longest_regroup_for_the_goal_is_where_auto_crosses_it() -> None:
    inp = dict(gas.INPUTS)
    lam = gas.rate_per_s("llama3_rate", 16384)
    r = gas.max_regroup_for(0.99, lam, 16384, inp)
    assert gas.mecefo(lam, 16384, r, inp) >= 0.99 > gas.mecefo(lam, 16384, r + 0.1, inp)
