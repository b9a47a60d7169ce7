"""Predicted gradient relative error of a recovery choice, for the planner's quality budget.

The error is the one the trainers log with ``--mecefo-grad-error-interval``:
``||g_hat - g|| / ||g||``, the step's gradient under the plan against the failure-free gradient
of the same batch at the same weights. It is predicted from what the planner knows at a failure
event, per policy:

* ``neighbor``, ``spread``: ``c_p * u**gamma_p * (r / r0)**(-delta_p)``, with ``u`` the share
  of the global batch's micro-batches run in takeover mode (attention backward skipped,
  low-rank FFN weight gradients at rank ``r``) and ``r0`` the rank of the calibration;
* ``drop``: ``c_drop * s**gamma_drop``, with ``s`` the share of the batch skipped;
* ``exact``, ``shrink`` (and no failure): 0, their gradient is the failure-free one.

A power law per policy, because the two policies' errors do not follow one curve of ``u``:
``spread`` keeps each absorber's own micro-batch exact, ``neighbor`` runs both of an absorber's
micro-batches in takeover mode, and the MHA re-weighting differs. The coefficients are fitted
(:func:`fit`, least squares on ``log e``) to probe runs that log the error on every degraded
iteration at several takeover shares and ranks
(``examples/pretrain_gpt/grad_error_calibration.py``, ``results/convergence_n32/``).
The error also grows as training goes on (the failure-free gradient shrinks against the
per-sample noise), which the model does not see: it is calibrated mid-run, after warm-up.

Torch-free and deterministic: every rank predicts the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

EXACT_CHOICES = ("exact", "shrink", "none")
"""Choices whose gradient equals the failure-free one (error 0)."""


@dataclass(frozen=True)
class PolicyFit:
    """One policy's power law ``c * x**gamma * (r / r0)**(-delta)``."""

    c: float
    """The error at share 1 and rank r0."""
    gamma: float
    """The exponent of the share (takeover share, or skipped share for ``drop``)."""
    delta: float = 0.0
    """The exponent of ``r0 / r`` (0: no rank dependence, as for ``drop``)."""


@dataclass(frozen=True)
class GradErrorModel:
    """Predicts ``||g_hat - g|| / ||g||`` of a choice (see the module docstring)."""

    fits: Mapping[str, PolicyFit]
    """Per policy (``neighbor``, ``spread``, ``drop``)."""
    reference_rank: int = 32
    """r0: the low-rank r the shares were calibrated at."""
    source: str = ""
    """Where the coefficients come from."""

    def predict(
        self,
        policy: str,
        takeover_share: float,
        samples_lost_share: float = 0.0,
        rank: Optional[int] = None,
    ) -> float:
        """The predicted relative error; 0 for an exact choice or a share of 0.

        Raises ``KeyError`` naming the policy when the model has no fit for it.
        """
        if policy in EXACT_CHOICES:
            return 0.0
        if policy not in self.fits:
            raise KeyError(
                f"no gradient-error fit for policy {policy!r} (have {sorted(self.fits)})"
            )
        f = self.fits[policy]
        share = samples_lost_share if policy == "drop" else takeover_share
        if share <= 0.0:
            return 0.0
        r = rank if rank is not None else self.reference_rank
        return f.c * share**f.gamma * (r / self.reference_rank) ** (-f.delta)

    def to_json(self) -> Dict[str, Any]:
        """The model, for result files."""
        return {
            "fits": {p: asdict(f) for p, f in sorted(self.fits.items())},
            "reference_rank": self.reference_rank,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GradErrorModel:
        """The model of :meth:`to_json`'s output."""
        return cls(
            {p: PolicyFit(**f) for p, f in data["fits"].items()},
            int(data["reference_rank"]),
            str(data.get("source", "")),
        )


@dataclass(frozen=True)
class Observation:
    """One logged error with the plan it was measured under."""

    policy: str
    takeover_share: float
    samples_lost_share: float
    rank: int
    error: float
    tags: Dict[str, Any] = field(default_factory=dict, compare=False)
    """Where it came from (run, iteration), for the result files."""


def _solve(a: List[List[float]], b: List[float]) -> List[float]:
    """``a x = b`` by Gaussian elimination with partial pivoting (small, dense)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(m[i][col]))
        if abs(m[piv][col]) < 1e-12:
            raise ValueError("singular least-squares system: too few distinct shares or ranks")
        m[col], m[piv] = m[piv], m[col]
        for i in range(col + 1, n):
            f = m[i][col] / m[col][col]
            for j in range(col, n + 1):
                m[i][j] -= f * m[col][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


def least_squares(rows: Sequence[Sequence[float]], y: Sequence[float]) -> List[float]:
    """Ordinary least squares ``argmin ||X beta - y||`` through the normal equations."""
    k = len(rows[0])
    xtx = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    xty = [sum(r[i] * v for r, v in zip(rows, y, strict=True)) for i in range(k)]
    return _solve(xtx, xty)


def fit(
    observations: Iterable[Observation], reference_rank: int = 32, source: str = ""
) -> GradErrorModel:
    """Fit each policy's power law to ``observations`` (least squares on ``log error``).

    The rank exponent is fitted only for a policy observed at two or more ranks (else 0).
    Observations with a zero share or a non-positive error carry no information on the power
    law and are left out.
    """
    by_policy: Dict[str, List[Observation]] = {}
    for o in observations:
        if o.policy in EXACT_CHOICES or o.error <= 0.0:
            continue
        share = o.samples_lost_share if o.policy == "drop" else o.takeover_share
        if share > 0.0:
            by_policy.setdefault(o.policy, []).append(o)
    fits: Dict[str, PolicyFit] = {}
    for policy, obs in sorted(by_policy.items()):
        shares = [o.samples_lost_share if policy == "drop" else o.takeover_share for o in obs]
        y = [math.log(o.error) for o in obs]
        ranked = policy != "drop" and len({o.rank for o in obs}) > 1
        if ranked:
            rows = [
                [1.0, math.log(s), -math.log(o.rank / reference_rank)]
                for s, o in zip(shares, obs, strict=True)
            ]
            b0, gamma, delta = least_squares(rows, y)
        else:
            b0, gamma = least_squares([[1.0, math.log(s)] for s in shares], y)
            delta = 0.0
        fits[policy] = PolicyFit(math.exp(b0), gamma, delta)
    return GradErrorModel(fits, reference_rank, source)


def accuracy(model: GradErrorModel, observations: Iterable[Observation]) -> Dict[str, Any]:
    """Per policy: the observations' count, mean measured and predicted error, and the median
    and largest ``|predicted / measured - 1|``."""
    rows: Dict[str, List[Tuple[float, float]]] = {}
    for o in observations:
        if o.policy in EXACT_CHOICES or o.error <= 0.0:
            continue
        p = model.predict(o.policy, o.takeover_share, o.samples_lost_share, o.rank)
        rows.setdefault(o.policy, []).append((p, o.error))
    out: Dict[str, Any] = {}
    for policy, pairs in sorted(rows.items()):
        rel = sorted(abs(p / m - 1.0) for p, m in pairs)
        out[policy] = {
            "n": len(pairs),
            "measured_mean": sum(m for _, m in pairs) / len(pairs),
            "predicted_mean": sum(p for p, _ in pairs) / len(pairs),
            "median_abs_rel_error": rel[len(rel) // 2],
            "max_abs_rel_error": rel[-1],
        }
    return out


DEFAULT_MODEL = GradErrorModel(
    {
        "neighbor": PolicyFit(0.978712, 0.659857, 0.0133103),
        "spread": PolicyFit(0.860535, 0.596263, 0.0146229),
        "drop": PolicyFit(0.968163, 0.590878, 0),
    },
    reference_rank=32,
    source="results/convergence_n32/grad_error_calibration.json",
)
"""The calibrated model (``results/convergence_n32/grad_error_calibration.json``; a test keeps
the two equal). ``neighbor`` and ``spread`` were probed at r = 16, 32 and 64: their rank
exponents are small (about 0.013-0.015: halving r raises the error by about 1%), since most of
a takeover micro-batch's error comes from the skipped attention backward, not the low rank."""
