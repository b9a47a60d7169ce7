"""Adaptive protection: which optimizer steps run the checks (our addition; ATTNChecker's
public code checks every call and gives no rule for an adaptive one).

A policy answers ``protect(iteration) -> bool`` at the start of each step and is told the
step's detections (summed over all ranks) at its end, so every rank takes the same decision
and no TP group ever disagrees on a collective (the sequence-parallel QKV check all-reduces).

Cost and coverage. With check cost ``c`` (fraction of a step; see the README's overhead
table) and a transient-fault rate ``λ`` per step, checking a fraction ``p`` of the steps costs
``p·c`` and leaves ``(1 − p)·λ`` unprotected faults per step, each of which can make the
loss NaN and force a checkpoint reload (cost ``R`` steps). Checking pays when ``c <
λ·R``; ``every:K`` is ``p = 1/K``. ``adaptive`` starts at period 1 and doubles the period
after ``hold`` consecutive clean checked steps, up to ``k_max``, and returns to 1 at the first
detection: fault bursts (a flaky device) get full coverage, quiet periods cost ``c/k_max``.
Detection-only mode (``mode="detect"``) is the other cheap option: every step is checked, a
mismatch costs a GEMM recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_mecefo.abft.choices import AbftConfigError


class ProtectionPolicy:
    """Base: protect every step."""

    name = "every"

    def protect(self, iteration: int) -> bool:
        """Whether optimizer step ``iteration`` (1-based) runs the checks."""
        return True

    def observe(self, iteration: int, protected: bool, detections: int) -> None:
        """The step's detections, summed over all ranks (0 when it was not protected)."""

    def describe(self) -> str:
        return self.name


@dataclass
class EveryK(ProtectionPolicy):
    """Protect each K-th step (iterations K, 2K, ...); K = 1 is every step."""

    k: int = 1

    def __post_init__(self) -> None:
        self.name = "every" if self.k == 1 else f"every:{self.k}"

    def protect(self, iteration: int) -> bool:
        return iteration % self.k == 0


@dataclass
class Adaptive(ProtectionPolicy):
    """Period 1 after a detection; doubles after ``hold`` clean checked steps, up to ``k_max``."""

    k_max: int = 8
    hold: int = 10

    def __post_init__(self) -> None:
        self.name = f"adaptive:{self.k_max}:{self.hold}"
        self.period = 1
        self.clean_run = 0
        self.last_checked = 0

    def protect(self, iteration: int) -> bool:
        return iteration - self.last_checked >= self.period

    def observe(self, iteration: int, protected: bool, detections: int) -> None:
        if not protected:
            return
        self.last_checked = iteration
        if detections:
            self.period, self.clean_run = 1, 0
            return
        self.clean_run += 1
        if self.clean_run >= self.hold:
            self.period, self.clean_run = min(2 * self.period, self.k_max), 0

    def describe(self) -> str:
        return f"{self.name} (period now {self.period})"


def build_policy(spec: str) -> ProtectionPolicy:
    """``every``, ``every:K`` or ``adaptive[:KMAX[:HOLD]]``; raises :class:`AbftConfigError`."""
    name, _, rest = spec.partition(":")
    try:
        numbers = [int(x) for x in rest.split(":")] if rest else []
    except ValueError:
        numbers = [-1]
    if name == "every" and len(numbers) <= 1 and all(n >= 1 for n in numbers):
        return EveryK(numbers[0] if numbers else 1)
    if name == "adaptive" and len(numbers) <= 2 and all(n >= 1 for n in numbers):
        return Adaptive(*numbers)
    raise AbftConfigError(
        f"--mecefo-abft-policy {spec!r}: use every, every:K or adaptive[:KMAX[:HOLD]] with "
        "positive integers, e.g. every:4 or adaptive:8:10"
    )
