"""The convergence study's interval statistics (examples/pretrain_gpt/convergence_stats.py)
against reference values: Student-t table quantiles and the textbook paired-t interval."""

from __future__ import annotations

import math
import statistics
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "examples" / "pretrain_gpt"))
from convergence_stats import interval, paired_gaps_pct, t_cdf, t_quantile  # noqa: E402

# Two-sided 95% (0.975 quantile) and one-sided 95% critical values of Student's t, from the
# standard table (e.g. NIST/SEMATECH e-Handbook, section 1.3.6.7.2).
TABLE_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 30: 2.042}
TABLE_95 = {1: 6.314, 4: 2.132, 10: 1.812}


@pytest.mark.parametrize("df, value", sorted(TABLE_975.items()))
def test_t_quantile_matches_the_table(df: int, value: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(value, abs=5e-4)
    assert t_quantile(0.025, df) == pytest.approx(-value, abs=5e-4)


def test_t_quantile_one_sided_and_normal_limit() -> None:
    for df, value in TABLE_95.items():
        assert t_quantile(0.95, df) == pytest.approx(value, abs=5e-4)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)
    # df = 1 is the Cauchy distribution: F(t) = 1/2 + atan(t) / pi.
    for t in (-3.0, -0.5, 0.0, 0.7, 4.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)


def test_interval_is_the_paired_t_formula() -> None:
    policy = [14.2, 17.9, 14.3, 15.1, 13.9]
    baseline = [13.8, 17.1, 13.5, 14.9, 13.6]
    gaps = paired_gaps_pct(policy, baseline)
    assert gaps[0] == pytest.approx(100 * (14.2 / 13.8 - 1))
    iv = interval(gaps, seed=1)
    mean, sd = statistics.fmean(gaps), statistics.stdev(gaps)
    half = 2.7764451 * sd / math.sqrt(5)  # t_{0.975, 4}
    assert (iv.t_low, iv.t_high) == pytest.approx((mean - half, mean + half), rel=1e-6)
    # p of the one-sample t test: the t interval excludes 0 exactly when p < 0.05.
    assert iv.excludes_zero == (iv.p_value < 0.05)
    assert iv.boot_low <= mean <= iv.boot_high
    assert interval(gaps, seed=1) == iv  # seeded: the same interval every time


def test_p_value_at_the_critical_t_is_five_percent() -> None:
    # Values whose t statistic is exactly t_{0.975, 4}: mean / (sd / sqrt(5)) = 2.776445.
    base = [-2.0, -1.0, 0.0, 1.0, 2.0]
    sd = statistics.stdev(base)
    shift = 2.7764451 * sd / math.sqrt(5)
    iv = interval([b + shift for b in base])
    assert iv.p_value == pytest.approx(0.05, abs=1e-6)
    assert iv.t_low == pytest.approx(0.0, abs=1e-6)


def test_interval_refuses_one_value() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        interval([1.0])
