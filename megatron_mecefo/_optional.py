"""Import guard for Transformer Engine, an optional GPU-only dependency.

It cannot be installed on a CPU machine, and a broken install raises RuntimeError rather
than ImportError at import, so the guard catches both. (NVIDIA apex is only ever imported by
megatron-core itself, behind its own guards.)
"""

from __future__ import annotations

import importlib


def _probe(module: str) -> bool:
    try:
        importlib.import_module(module)
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def have_transformer_engine() -> bool:
    """Whether Transformer Engine's PyTorch layer imports (and megatron-core accepted it)."""
    if not _probe("transformer_engine.pytorch"):
        return False
    from megatron.core.extensions import transformer_engine as te_ext

    return bool(getattr(te_ext, "HAVE_TE", False))
