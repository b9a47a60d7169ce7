"""The values the ABFT settings take, and the error a bad one raises.

Its own module so that :mod:`.config` (which checks every setting) and the modules that parse
one (:mod:`.inject`'s rules, :mod:`.policy`'s specs) import it without importing each other.
Imports nothing (no torch).
"""

from __future__ import annotations

from typing import Tuple

OPS: Tuple[str, ...] = ("qkv", "scores", "context", "proj")
"""The protected GEMMs of one attention block, in execution order: the QKV projection, the
scores ``Q·Kᵀ`` (scaled), the context ``softmax(scores)·V`` and the output projection."""

MODES = ("correct", "detect")
ON_UNCORRECTABLE = ("skip", "raise")


class AbftConfigError(ValueError):
    """A bad ABFT setting; the message names the field or flag, the value and the fix."""
