"""Where the ``--mecefo`` flags used to live, kept so that existing imports work.

The flags are :mod:`megatron_mecefo.takeover.arguments`' (the planner's in
:mod:`megatron_mecefo.planner.arguments`), the config :mod:`megatron_mecefo.takeover.config`'s
and the command-line helpers :mod:`megatron_mecefo.cli`'s. Torch-free.
"""

from __future__ import annotations

from megatron_mecefo.cli import (
    VALUE_FLAGS,
    exit_with_config_error,
    mecefo_flags_given,
    normalize_argv,
)
from megatron_mecefo.takeover.arguments import add_arguments
from megatron_mecefo.takeover.config import (
    MAX_NOMINAL_STEP_TIME_S,
    POLICY_NAMES,
    SCHEDULES,
    FaultToleranceConfig,
    MecefoConfigError,
)

__all__ = [
    "MAX_NOMINAL_STEP_TIME_S",
    "POLICY_NAMES",
    "SCHEDULES",
    "VALUE_FLAGS",
    "FaultToleranceConfig",
    "MecefoConfigError",
    "add_arguments",
    "exit_with_config_error",
    "mecefo_flags_given",
    "normalize_argv",
]
