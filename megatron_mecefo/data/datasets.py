"""Megatron-Core GPT datasets and the data iterator the trainer consumes.

Datasets are built by megatron-core's ``BlendedMegatronDatasetBuilder``. With torch.distributed
initialised, the builder constructs each dataset on global rank 0 first (which writes the index
cache), calls ``barrier()``, then constructs it on the other ranks (which read the cache). We
pass ``is_built_on_rank=lambda: True`` so every rank gets its own dataset objects, and every rank
must call :func:`build_gpt_datasets` (the barriers are collective); the cache directory must be
one that all ranks see.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split
from torch.utils.data import Dataset

from megatron_mecefo.data.data_path import check_data_prefix, parse_data_path

__all__ = [
    "build_data_iterator",
    "build_gpt_datasets",
    "check_data_prefix",
    "parse_data_path",
]


class _Builder(BlendedMegatronDatasetBuilder):
    """``BlendedMegatronDatasetBuilder`` that also works for blends without torch.distributed.

    In megatron-core 0.16.1, ``BlendedDataset._build_indices`` calls
    ``torch.distributed.get_rank()`` on a cache miss whenever ``path_to_cache`` is set, which
    raises in a single process. There we hand the ``BlendedDataset`` a config copy without a
    cache: its blending index is then rebuilt on each start (a fast C++ pass), while the
    ``GPTDataset`` indices underneath are still cached.
    """

    @staticmethod
    def build_generic_dataset(  # type: ignore[override]
        cls: Any, is_built_on_rank: Any, synchronize_ranks: bool, *args: Any
    ) -> Any:
        if cls is BlendedDataset and not torch.distributed.is_initialized():
            *head, config = args
            if config.path_to_cache:
                config = copy.copy(config)
                config.path_to_cache = None
            args = (*head, config)
        return BlendedMegatronDatasetBuilder.build_generic_dataset(
            cls, is_built_on_rank, synchronize_ranks, *args
        )


def _split_bounds(fraction: tuple[float, float], num_documents: int) -> tuple[int, int]:
    # The same rounding as BlendedMegatronDatasetBuilder._build_megatron_dataset_splits.
    return int(round(fraction[0] * num_documents)), int(round(fraction[1] * num_documents))


def build_gpt_datasets(
    *,
    data_path: Sequence[str] | str | None,
    mock: bool,
    seq_length: int,
    seed: int,
    split: str,
    num_samples: tuple[int, int, int],
    tokenizer: Any,
    cache_dir: str | None,
    create_attention_mask: bool = False,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Build train/valid/test GPT datasets with megatron-core's dataset builder.

    Collective when torch.distributed is initialised: call it on every rank (see module
    docstring). Works without torch.distributed too.

    Args:
        data_path: Megatron-LM ``--data-path`` list (see :func:`parse_data_path`); ignored when
            ``mock`` is set.
        mock: Use ``MockGPTDataset`` (synthetic ``1, 2, 3, ...`` documents). megatron-core then
            ignores ``split`` and uses ``"1,1,1"``.
        seq_length: Tokens per sample (``tokens``/``labels`` have this length).
        seed: Seed of the document/sample shuffles.
        split: Train/valid/test document split, e.g. ``"969,30,1"``.
        num_samples: Minimum samples per split. A single-prefix ``GPTDataset`` is built in
            whole epochs, so it usually holds more; a blend holds the sum over its datasets of
            ``ceil(n * weight)``, i.e. up to one more per dataset. A split asking for 0 samples
            is not built (``None``).
        tokenizer: Exposes ``vocab_size``, ``eod``, ``pad`` and ``unique_identifiers``, e.g.
            :class:`~megatron_mecefo.data.tokenizer.ByteTokenizer`.
        cache_dir: Where megatron-core caches its index ``.npy`` files; ``None`` means its default,
            ``<prefix>/cache/GPTDataset_indices`` for real data and no cache for mock data.
        create_attention_mask: Also return a ``[1, s, s]`` causal ``attention_mask`` per sample;
            off by default because the models build their causal mask themselves.

    Returns:
        ``(train, valid, test)``; an entry is ``None`` when its split is empty or not requested.

    Raises:
        ValueError: On bad arguments, or a split that gets no documents but is asked for samples
            (megatron-core would loop forever building its index).
        FileNotFoundError: When a prefix's ``.bin``/``.idx`` is missing.
    """
    if seq_length <= 0:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    sizes = [int(n) for n in num_samples]
    if len(sizes) != len(Split) or any(n < 0 for n in sizes):
        raise ValueError(f"num_samples must be 3 non-negative ints, got {num_samples}")
    if tokenizer is None:
        raise ValueError("a tokenizer is required (GPTDatasetConfig asserts one)")

    blend = None
    if not mock:
        if data_path is None:
            raise ValueError("data_path is required unless mock=True")
        blend = parse_data_path(data_path)
        for prefix in blend[0]:
            check_data_prefix(prefix)

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
    )
    # split_matrix is derived in __post_init__; editing it (identically on every rank) is how we
    # skip a split, since megatron-core builds a full epoch even for a 0-sample request.
    matrix = list(config.split_matrix)
    for i, size in enumerate(sizes):
        if size == 0:
            matrix[i] = None
    if blend is not None:
        for prefix in blend[0]:
            num_documents = len(IndexedDataset(prefix).sequence_lengths)
            for i, fraction in enumerate(matrix):
                if fraction is None:
                    continue
                beg, end = _split_bounds(fraction, num_documents)
                if end <= beg:
                    raise ValueError(
                        f"split {split!r} gives the {Split(i).name} split of {prefix!r} "
                        f"({num_documents} documents) no documents, but {sizes[i]} samples "
                        "were requested; change the split or use more data"
                    )
    config.split_matrix = matrix

    dataset_cls = MockGPTDataset if mock else GPTDataset
    builder = _Builder(dataset_cls, sizes, lambda: True, config)
    train, valid, test = builder.build()
    return train, valid, test


def build_data_iterator(dataset: Dataset, sampler: Any) -> Iterator[dict[str, torch.Tensor]]:
    """Iterate batches of ``dataset`` in the order of a batch sampler.

    Args:
        dataset: A map-style dataset, e.g. from :func:`build_gpt_datasets`.
        sampler: A batch sampler yielding lists of indices, e.g.
            :class:`~megatron_mecefo.data.sampler.PretrainingSampler`.

    Returns:
        An iterator of dicts with ``tokens``, ``labels``, ``loss_mask`` and ``position_ids``
        (plus ``attention_mask`` if the dataset makes one and ``dataset_id`` from a blend),
        each batched to ``[micro_batch_size, ...]``.
    """
    # num_workers=0: worker processes would add start-up cost and nondeterminism on CPU; the
    # samples are cheap mmap reads.
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=0, pin_memory=False
    )
    return iter(loader)
