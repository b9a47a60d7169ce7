"""Attention ABFT: ATTNChecker-style checksums on the attention GEMMs, as a layer-spec rewrite.

:func:`abft_spec` swaps checked modules into a stock or MeCeFO layer spec: the QKV and output
projections (:mod:`.linear`) and the unfused core attention (:mod:`.attention`, ``Q·Kᵀ`` and
``softmax·V``). Each checks its GEMM output with the two-vector code of :mod:`.checksum` and
repairs INF, NaN and near-INF values by the rules of :mod:`.correction`, following the
protocol of :mod:`.guard` (correct, second direction, recompute, escalate).
:func:`apply_abft` binds a built model to the per-process :class:`AbftState` (:mod:`.state`),
which holds the :class:`AbftConfig` (:mod:`.config`), the protection policy (:mod:`.policy`),
the seeded fault injector (:mod:`.inject`) and the counters (:mod:`.metrics`).

Uses: megatron-core's attention and tensor-parallel linears. Used by: the example trainer
and the Megatron-LM integration (``--mecefo-abft``, flags in :mod:`.arguments`), the tests and
``benchmarks/abft_overhead.py``. Importing this package imports torch and megatron-core;
:mod:`.arguments` and :mod:`.config` do not.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "AbftConfig": "megatron_mecefo.abft.config",
    "AbftConfigError": "megatron_mecefo.abft.config",
    "AbftState": "megatron_mecefo.abft.state",
    "AbftUncorrectableError": "megatron_mecefo.abft.state",
    "abft_spec": "megatron_mecefo.abft.spec",
    "AbftSpecError": "megatron_mecefo.abft.spec",
    "apply_abft": "megatron_mecefo.abft.apply",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_mecefo.abft' has no attribute {name!r}")
