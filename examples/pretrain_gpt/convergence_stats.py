"""The convergence study's statistics: paired gaps, Student-t and bootstrap 95% intervals.

Standard library only (the study runs without SciPy): the t quantile is the inverse of the
regularized incomplete beta function, evaluated by its continued fraction (Numerical Recipes,
``betacf``) and inverted by bisection.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Dict, Sequence


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(ln + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student's t distribution function with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`, to 1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p}: must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Interval:
    """A mean with its 95% intervals."""

    n: int
    mean: float
    sd: float
    t_low: float
    """Student-t interval, ``mean -/+ t_{0.975, n-1} sd / sqrt(n)``."""
    t_high: float
    p_value: float
    """Two-sided p of the one-sample t test against 0."""
    boot_low: float
    """Percentile bootstrap of the mean (seeded)."""
    boot_high: float

    @property
    def excludes_zero(self) -> bool:
        """Whether the t interval excludes 0 (the mean differs from 0 at 5%)."""
        return self.t_low > 0.0 or self.t_high < 0.0

    def to_json(self) -> Dict[str, Any]:
        """The fields and ``excludes_zero``."""
        return {**asdict(self), "excludes_zero": self.excludes_zero}


def interval(
    values: Sequence[float], level: float = 0.95, resamples: int = 10000, seed: int = 0
) -> Interval:
    """The mean of ``values`` with its Student-t and bootstrap intervals at ``level``.

    Raises ``ValueError`` with fewer than two values (no spread to estimate).
    """
    n = len(values)
    if n < 2:
        raise ValueError(f"an interval needs at least 2 values, got {n}")
    mean = statistics.fmean(values)
    sd = statistics.stdev(values)
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    if sd > 0:
        t = mean / (sd / math.sqrt(n))
        p = 2.0 * (1.0 - t_cdf(abs(t), n - 1))
    else:
        p = 0.0 if mean != 0 else 1.0
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(resamples))
    alpha = (1.0 - level) / 2.0
    lo = means[int(math.floor(alpha * resamples))]
    hi = means[min(resamples - 1, int(math.ceil((1.0 - alpha) * resamples)) - 1)]
    return Interval(n, mean, sd, mean - half, mean + half, p, lo, hi)


def paired_gaps_pct(policy_ppl: Sequence[float], baseline_ppl: Sequence[float]) -> list:
    """Per seed, the perplexity gap to the same seed's baseline, in percent."""
    if len(policy_ppl) != len(baseline_ppl):
        raise ValueError("paired gaps need one baseline per seed")
    return [100.0 * (p / b - 1.0) for p, b in zip(policy_ppl, baseline_ppl, strict=True)]
