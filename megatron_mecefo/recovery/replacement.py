"""Replacement policies: whether and when a supervisor starts a new process for a dead rank.

Small objects with one method, ``delay_s(slot) -> Optional[float]``: ``None`` means never,
``0`` at once, anything else after that many seconds (a stand-in for the repair time).
"""

from __future__ import annotations

from typing import Optional

from megatron_mecefo.recovery.config_error import RecoveryConfigError


class ReplacementPolicy:
    """Base class: never replace."""

    name = "never"

    def delay_s(self, slot: int) -> Optional[float]:
        """Seconds after the death of ``slot``'s process until its replacement starts."""
        return None

    def describe(self) -> str:
        return self.name


class NeverReplace(ReplacementPolicy):
    """The dead replica stays down; MeCeFO takes it over until the end of the run."""


class ReplaceImmediately(ReplacementPolicy):
    """Start the replacement as soon as the death is reaped."""

    name = "immediately"

    def delay_s(self, slot: int) -> Optional[float]:
        return 0.0


class ReplaceAfterDelay(ReplacementPolicy):
    """Start the replacement after a fixed delay (emulates a node repair)."""

    name = "after"

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)

    def delay_s(self, slot: int) -> Optional[float]:
        return self.seconds

    def describe(self) -> str:
        return f"after {self.seconds:g} s"


def build_replacement(spec: str) -> ReplacementPolicy:
    """``never``, ``immediately`` or ``after:SECONDS``."""
    if spec == "never":
        return NeverReplace()
    if spec == "immediately":
        return ReplaceImmediately()
    if spec.startswith("after:"):
        try:
            seconds = float(spec.split(":", 1)[1])
        except ValueError:
            seconds = -1.0
        if seconds >= 0:
            return ReplaceAfterDelay(seconds)
    raise RecoveryConfigError(
        f"--replace={spec}: use never, immediately or after:SECONDS (e.g. after:5)"
    )
