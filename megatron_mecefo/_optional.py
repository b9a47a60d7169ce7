"""Import guards for optional GPU-only dependencies (Transformer Engine, NVIDIA apex).

Neither can be installed on a CPU machine; a broken Transformer Engine install even raises
RuntimeError rather than ImportError at import, so every guard catches both.
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


def have_apex() -> bool:
    """Whether NVIDIA apex (not PyPI's unrelated ``apex``) is importable."""
    return _probe("apex.normalization") and _probe("apex.optimizers")
