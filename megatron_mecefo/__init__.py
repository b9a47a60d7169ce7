"""megatron-mecefo: MeCeFO fault-tolerant training for Megatron-Core.

Importing the package is cheap: it does not import torch or megatron-core. The names below are
loaded on first use, from the submodules that define them.
"""

from __future__ import annotations

import importlib
from typing import Any

# Plugs --mecefo-policy auto (the planner) into the takeover's config and flags; torch-free.
import megatron_mecefo.planner  # noqa: F401

__version__ = "0.1.0"

_LAZY = {
    "MecefoConfig": "megatron_mecefo.techniques.config",
    "MecefoState": "megatron_mecefo.techniques.state",
    "MicrobatchMode": "megatron_mecefo.techniques.state",
    "apply_mecefo": "megatron_mecefo.techniques.apply",
    "mha_group_parameters": "megatron_mecefo.techniques.apply",
    "mecefo_layers": "megatron_mecefo.techniques.apply",
    "mecefo_spec": "megatron_mecefo.techniques.specs",
    "get_mecefo_local_spec": "megatron_mecefo.techniques.specs",
    "get_mecefo_te_spec": "megatron_mecefo.techniques.specs",
    "mecefo_layer_spec": "megatron_mecefo.techniques.specs",
    "add_arguments": "megatron_mecefo.takeover.arguments",
    "FaultToleranceConfig": "megatron_mecefo.takeover.config",
    "MecefoConfigError": "megatron_mecefo.takeover.config",
    "FailureSchedule": "megatron_mecefo.takeover.failure_schedule",
    "build_policy": "megatron_mecefo.takeover.policies",
    "MecefoController": "megatron_mecefo.takeover.controller",
    "ReplicaTopology": "megatron_mecefo.takeover.topology",
    "install": "megatron_mecefo.megatron_lm",
    "extra_args_provider": "megatron_mecefo.megatron_lm",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_mecefo' has no attribute {name!r}")
