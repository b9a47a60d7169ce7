"""Data pipeline: byte tokenizer, stdlib-docstring corpus, Megatron-Core GPT datasets, sampler.

Names are imported lazily (PEP 562): importing megatron-core takes seconds, and a caller that
only needs, say, :func:`prepared_dataset_stats` or the sampler should not pay for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_mecefo.data.data_path import check_data_prefix, parse_data_path
    from megatron_mecefo.data.datasets import build_data_iterator, build_gpt_datasets
    from megatron_mecefo.data.sampler import PretrainingSampler, samples_of_global_batch
    from megatron_mecefo.data.stdlib_corpus import (
        DEFAULT_MAX_BYTES,
        iter_stdlib_docstrings,
        prepare_stdlib_dataset,
        prepared_dataset_stats,
    )
    from megatron_mecefo.data.tokenizer import ByteTokenizer

_EXPORTS = {
    "build_data_iterator": "datasets",
    "build_gpt_datasets": "datasets",
    "check_data_prefix": "data_path",
    "parse_data_path": "data_path",
    "PretrainingSampler": "sampler",
    "samples_of_global_batch": "sampler",
    "DEFAULT_MAX_BYTES": "stdlib_corpus",
    "iter_stdlib_docstrings": "stdlib_corpus",
    "prepare_stdlib_dataset": "stdlib_corpus",
    "prepared_dataset_stats": "stdlib_corpus",
    "ByteTokenizer": "tokenizer",
}

__all__ = [
    "DEFAULT_MAX_BYTES",
    "ByteTokenizer",
    "PretrainingSampler",
    "build_data_iterator",
    "build_gpt_datasets",
    "check_data_prefix",
    "iter_stdlib_docstrings",
    "parse_data_path",
    "prepare_stdlib_dataset",
    "prepared_dataset_stats",
    "samples_of_global_batch",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # cache: later lookups bypass __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
