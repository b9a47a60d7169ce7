"""The error a bad recovery setting raises.

Its own module so that :mod:`.config` (which checks every setting, ``--replace`` through
:func:`.replacement.build_replacement`) and :mod:`.replacement` (which parses ``--replace``)
import it without importing each other.
"""

from __future__ import annotations

from megatron_mecefo.errors import UserError


class RecoveryConfigError(UserError, ValueError):
    """A bad recovery setting; the message names the flag, the value and the fix (exit 2)."""
