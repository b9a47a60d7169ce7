"""Detection and correction rules (ATTNChecker's EEC-ABFT decision tree, in torch).

For one line ``x`` (length ``n``) with carried checksums ``(c1, c2)`` and checksums of the
output ``(r1, r2)``, ``d1 = c1 − r1`` and ``d2 = c2 − r2``:

* the line is flagged when ``d1`` is not finite or ``|d1| > abs + rel · B`` (``B ≥ Σ|x|``);
* **extreme values** (NaN, ±INF or ``|x| > near_inf``): exactly one → that is the bad element;
  more than one → the line cannot be corrected from its checksums;
* **no extreme value** (a finite error): the location is ``round(d2 / d1) − 1``, accepted
  only when ``d2 / d1`` is within 0.1 of an integer in ``1..n`` (one bad element);
* **correction**: ``x[loc] = c1 − Σ_{i≠loc} x_i``, in float64, then the line is checked again.

Everything up to the flag test is vectorised (one ``any()`` per check); only flagged lines
reach the Python loop, which is the rare path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from megatron_mecefo.abft.metrics import classify


@dataclass
class Fix:
    """One detected bad element: where (batch block, position in the line, line index)."""

    block: int
    position: int
    line: int
    kind: str
    corrected: bool


@dataclass
class CheckOutcome:
    """What one check of one GEMM output found."""

    flagged: int = 0
    """Lines whose checksums disagreed."""
    fixes: List[Fix] = field(default_factory=list)
    """Elements located (corrected or not)."""
    uncorrectable: List[Tuple[int, int]] = field(default_factory=list)
    """``(block, line)`` of lines the checksums could not repair."""
    kinds: List[str] = field(default_factory=list)
    """The kind of each uncorrectable line's worst element."""

    @property
    def clean(self) -> bool:
        return self.flagged == 0


def flag_lines(
    expected: torch.Tensor,
    actual: torch.Tensor,
    bound: Optional[torch.Tensor],
    abs_thr: float,
    rel_thr: float,
) -> torch.Tensor:
    """Boolean ``[B, m]``: lines whose first checksums differ beyond the threshold."""
    d1 = expected[:, 0] - actual[:, 0]
    thr = abs_thr if bound is None else abs_thr + rel_thr * bound
    return ~torch.isfinite(d1) | (d1.abs() > thr)


def _threshold(bound: Optional[torch.Tensor], b: int, j: int, abs_thr: float, rel: float) -> float:
    return abs_thr + (0.0 if bound is None else rel * float(bound[b, j]))


def locate(
    line: torch.Tensor, c1: float, c2: Optional[float], near_inf: float
) -> Tuple[Optional[int], str]:
    """The position of the single bad element of ``line``, or None; and its kind."""
    x = line.double()
    extreme = ~torch.isfinite(x) | (x.abs() > near_inf)
    count = int(extreme.sum())
    if count > 1:
        worst = x[extreme][0].item()
        return None, classify(worst, near_inf)
    if count == 1:
        loc = int(extreme.nonzero()[0, 0])
        return loc, classify(x[loc].item(), near_inf)
    if c2 is None:
        return None, "error"
    n = x.numel()
    d1 = c1 - float(x.sum())
    w = torch.arange(1, n + 1, dtype=torch.float64, device=x.device)
    d2 = c2 - float((w * x).sum())
    if d1 == 0.0 or d1 != d1 or d2 != d2:
        return None, "error"
    ratio = d2 / d1
    loc = round(ratio) - 1
    if abs(ratio - (loc + 1)) > 0.1 or not 0 <= loc < n:
        return None, "error"
    return loc, "error"


def correct_lines(
    lines: torch.Tensor,
    expected: torch.Tensor,
    actual: torch.Tensor,
    bound: Optional[torch.Tensor],
    abs_thr: float,
    rel_thr: float,
    near_inf: float,
    correct: bool,
) -> CheckOutcome:
    """Check ``lines`` (a ``[B, n, m]`` view of a GEMM output, lines along dim 1) and repair
    single bad elements in place.

    Args:
        lines: The output, viewed so that ``lines[b, :, j]`` is one line (writes go through).
        expected: ``[B, k, m]`` carried checksums (k = 2, or 1 in detection-only mode).
        actual: ``[B, k, m]`` checksums of ``lines`` itself.
        bound: ``[B, m]`` upper bound of ``Σ|x|`` per line (for the relative threshold).
        correct: Locate and repair (False: only report flagged lines as uncorrectable).
    """
    flags = flag_lines(expected, actual, bound, abs_thr, rel_thr)
    if not bool(flags.any()):
        return CheckOutcome()
    out = CheckOutcome()
    idx = flags.nonzero().tolist()
    out.flagged = len(idx)
    c = expected.double()
    with torch.no_grad():
        for b, j in idx:
            line = lines[b, :, j]
            c1 = float(c[b, 0, j])
            c2 = float(c[b, 1, j]) if c.shape[1] > 1 else None
            loc, kind = locate(line, c1, c2, near_inf) if correct else (None, None)
            if loc is None or c1 != c1 or c1 in (float("inf"), float("-inf")):
                if kind is None:
                    x = line.double()
                    bad = ~torch.isfinite(x) | (x.abs() > near_inf)
                    kind = classify(x[bad][0].item(), near_inf) if bool(bad.any()) else "error"
                out.uncorrectable.append((b, j))
                out.kinds.append(kind)
                continue
            x = line.double()
            x[loc] = 0.0
            line[loc] = c1 - float(x.sum())
            thr = _threshold(bound, b, j, abs_thr, rel_thr)
            ok = abs(c1 - float(line.double().sum())) <= thr
            out.fixes.append(Fix(b, loc, j, kind, ok))
            if not ok:
                out.uncorrectable.append((b, j))
                out.kinds.append(kind)
    return out
