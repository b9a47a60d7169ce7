"""``AbftConfig``: what the attention checksums protect, how they decide, and what they do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

# The shared names live in .choices (inject and policy import them from there, not from here);
# re-exported: ``from megatron_mecefo.abft.config import AbftConfigError`` is public.
from megatron_mecefo.abft.choices import MODES, ON_UNCORRECTABLE, OPS, AbftConfigError
from megatron_mecefo.abft.inject import parse_rule
from megatron_mecefo.abft.policy import build_policy

__all__ = ["AbftConfig", "AbftConfigError", "MODES", "ON_UNCORRECTABLE", "OPS"]


@dataclass
class AbftConfig:
    """Attention ABFT (ATTNChecker-style checksums) for one process.

    Defaults follow ATTNChecker's code where it has a value (``near_inf_threshold``,
    ``abs_threshold``); the rest are ours and documented per field.
    """

    ops: Tuple[str, ...] = OPS
    """Which GEMMs are checked (a subset of ``OPS``). Unchecked GEMMs run stock."""

    check: bool = True
    """False: run no checks at all but still inject faults (the unprotected baseline for tests
    and demos: ``--mecefo-abft-inject`` without ``--mecefo-abft``)."""

    mode: str = "correct"
    """``correct``: locate a bad element from the two checksums and repair it in place
    (``checksum − sum of the others``); lines that cannot be repaired fall back to a
    recompute. ``detect``: the cheap option: one checksum vector (all-ones), compare, and
    recompute the GEMM on any mismatch."""

    near_inf_threshold: float = 1e10
    """``|x|`` above this counts as an extreme ("near-INF") value, like INF and NaN
    (ATTNChecker's 1e10). A line with more than one extreme value cannot be corrected from
    its checksums."""

    abs_threshold: float = 1.0
    """Absolute part of the detection threshold on ``|c1 − r1|`` (ATTNChecker's E = 1)."""

    rel_threshold: Optional[float] = None
    """Relative part: a line is flagged when ``|c1 − r1| > abs_threshold + rel_threshold ·
    B``, with ``B ≥ Σ|x|`` over the line, a Cauchy–Schwarz bound from the GEMM operands
    (``Σ_t‖a_t‖ · ‖b_j‖``). Rounding of the checksums stays far below it, so there are no
    false positives. None: 1e-3 for fp32 GEMMs, 5e-2 for bf16/fp16 (outputs rounded to 8 or 11
    mantissa bits). Errors below the threshold are not extreme and are not reported."""

    recompute: bool = True
    """When a line is still bad after correction (or in ``detect`` mode), recompute the GEMM
    once, copy the result over the output and check again."""

    on_uncorrectable: str = "skip"
    """What happens when the recomputed GEMM is still bad. ``skip``: the step is marked
    poisoned; the trainer all-reduces the mark and skips the optimizer update on every rank,
    so no NaN reaches the weights. ``raise``: Megatron's ``rerun_state_machine.
    validate_result`` rejects the result: a RuntimeError with rerun mode ``disabled``, a
    re-run of the iteration with ``validate_results`` (Megatron-LM's own loop)."""

    policy: str = "every"
    """How often steps are protected: ``every`` (each step), ``every:K`` (each K-th step),
    ``adaptive[:KMAX[:HOLD]]`` (period doubles up to KMAX after HOLD clean checked steps,
    drops to 1 after a detection). See :mod:`megatron_mecefo.abft.policy`."""

    inject: Tuple[str, ...] = ()
    """Fault-injection rules (``--mecefo-abft-inject``), for tests and demos; see
    :mod:`megatron_mecefo.abft.inject` for the syntax."""

    seed: int = 1234
    """Seed of the injector's element choice (with iteration, micro-batch, layer and op)."""

    max_events: int = 10_000
    """Detections kept in the per-process event log (counts are always complete)."""

    def validate(self) -> "AbftConfig":
        """Check every field; raises :class:`AbftConfigError`. Returns ``self``."""
        bad = [op for op in self.ops if op not in OPS]
        if bad or not self.ops:
            raise AbftConfigError(f"ops={self.ops!r}: use a non-empty subset of {OPS}")
        if self.mode not in MODES:
            raise AbftConfigError(f"mode={self.mode!r}: use one of {MODES}")
        if self.on_uncorrectable not in ON_UNCORRECTABLE:
            raise AbftConfigError(
                f"on_uncorrectable={self.on_uncorrectable!r}: use one of {ON_UNCORRECTABLE}"
            )
        if not self.near_inf_threshold > 0:
            raise AbftConfigError(f"near_inf_threshold={self.near_inf_threshold}: must be > 0")
        if not self.abs_threshold >= 0:
            raise AbftConfigError(f"abs_threshold={self.abs_threshold}: must be >= 0")
        if self.rel_threshold is not None and not self.rel_threshold >= 0:
            raise AbftConfigError(f"rel_threshold={self.rel_threshold}: must be >= 0")
        build_policy(self.policy)
        for spec in self.inject:
            parse_rule(spec)
        return self

    def rel_for(self, half_precision: bool) -> float:
        """The relative detection threshold for a GEMM in half precision or not."""
        if self.rel_threshold is not None:
            return self.rel_threshold
        return 5e-2 if half_precision else 1e-3
