"""The process-group timeout: ``MECEFO_PG_TIMEOUT_MIN``, applied to every group of a run.

A collective whose peer has stopped waits for this long before it raises. The example
trainer passes it to ``init_process_group`` and to ``initialize_model_parallel``'s
``distributed_timeout_minutes``, which megatron-core hands to every group it creates (DP,
TP, PP, CP, embedding, ...); in Megatron-LM it sets ``--distributed-timeout-minutes``,
which Megatron-LM passes to the same two places.
"""

from __future__ import annotations

import os

ENV = "MECEFO_PG_TIMEOUT_MIN"
DEFAULT_MINUTES = 10.0


def timeout_minutes(value: str) -> float:
    """Minutes of a ``MECEFO_PG_TIMEOUT_MIN`` value (fractions allowed, e.g. 0.5).

    Raises:
        ValueError: If it is not a positive number; the message names the variable.
    """
    try:
        minutes = float(value)
    except ValueError:
        minutes = -1.0
    if not minutes > 0:
        raise ValueError(f"{ENV}={value}: expected a positive number of minutes, e.g. 10 or 0.5")
    return minutes


def pg_timeout_minutes() -> float:
    """The timeout of every process group: ``$MECEFO_PG_TIMEOUT_MIN`` or 10 minutes."""
    value = os.environ.get(ENV)
    return DEFAULT_MINUTES if value in (None, "") else timeout_minutes(value)
