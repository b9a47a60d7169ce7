"""The error a bad ``--mecefo-*`` flag raises.

Its own module so that the takeover config (:mod:`.config`) and the planner's
(:mod:`megatron_mecefo.planner.config`), which the takeover config holds, both raise it
without importing each other. Imports nothing.
"""

from __future__ import annotations


class MecefoConfigError(ValueError):
    """A bad ``--mecefo-*`` flag (combination); the message names the flag and the fix."""
