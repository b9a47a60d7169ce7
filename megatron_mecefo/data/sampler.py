"""Megatron-LM's pretraining sample order, per data-parallel rank.

Megatron-LM's ``MegatronPretrainingSampler`` lives in ``megatron/training``, which the
megatron-core wheel does not ship, so this is an independent implementation of the same order:
sample indices ``consumed_samples, consumed_samples + 1, ...`` are cut into chunks of
``micro_batch_size * data_parallel_size`` and DP rank ``r`` takes the ``r``-th run of
``micro_batch_size`` indices of every chunk.

The DP rank is an ordinary argument, so a replica can build the sampler of *another* rank: when
a replica fails, its neighbour draws the failed rank's micro-batches from a second sampler
(or from :func:`samples_of_global_batch`) and the global batch stays the same.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

__all__ = ["PretrainingSampler", "samples_of_global_batch"]


def _as_int(name: str, value: object) -> int:
    # operator.index accepts numpy integers (e.g. a consumed-samples count read from a
    # checkpoint) but rejects floats; bools are rejected explicitly.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def _positive(name: str, value: object) -> int:
    number = _as_int(name, value)
    if number <= 0:
        raise ValueError(f"{name} must be positive, got {number}")
    return number


def _rank_and_size(data_parallel_rank: object, data_parallel_size: object) -> tuple[int, int]:
    size = _positive("data_parallel_size", data_parallel_size)
    rank = _as_int("data_parallel_rank", data_parallel_rank)
    if not 0 <= rank < size:
        raise ValueError(f"data_parallel_rank must be in [0, {size}), got {rank}")
    return rank, size


class PretrainingSampler:
    """Batch sampler yielding one DP rank's micro-batches of sample indices.

    Use it as ``batch_sampler`` of a ``torch.utils.data.DataLoader``. Iteration starts at
    ``consumed_samples``, so a run resumed from a checkpoint continues exactly where the
    interrupted run stopped.

    Args:
        total_samples: Number of samples in the dataset (indices ``[0, total_samples)``).
        consumed_samples: Samples already consumed by all DP ranks together.
        micro_batch_size: Samples per micro-batch per DP rank.
        data_parallel_rank: The rank whose share to yield, in ``[0, data_parallel_size)``.
        data_parallel_size: Number of DP replicas.
        drop_last: Drop the final chunk when it has fewer than
            ``micro_batch_size * data_parallel_size`` indices; otherwise each rank yields its
            (possibly shorter) slice of it, and nothing if that slice is empty.

    Raises:
        ValueError: On non-positive sizes, a rank out of range, or
            ``consumed_samples`` outside ``[0, total_samples)``.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        total_samples = _positive("total_samples", total_samples)
        micro_batch_size = _positive("micro_batch_size", micro_batch_size)
        data_parallel_rank, data_parallel_size = _rank_and_size(
            data_parallel_rank, data_parallel_size
        )
        consumed_samples = _as_int("consumed_samples", consumed_samples)
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples must be in [0, total_samples={total_samples}), "
                f"got {consumed_samples}"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    @property
    def samples_per_step(self) -> int:
        """Indices consumed by all ranks for one micro-batch each (``mbs * dp``)."""
        return self.micro_batch_size * self.data_parallel_size

    def _slice(self, chunk_start: int, chunk_end: int) -> list[int]:
        start = chunk_start + self.data_parallel_rank * self.micro_batch_size
        end = min(start + self.micro_batch_size, chunk_end)
        return list(range(start, end))

    def __iter__(self) -> Iterator[list[int]]:
        step = self.samples_per_step
        start = self.consumed_samples
        while start + step <= self.total_samples:
            yield self._slice(start, start + step)
            start += step
        if start < self.total_samples and not self.drop_last:
            tail = self._slice(start, self.total_samples)
            if tail:
                yield tail

    def __len__(self) -> int:
        """Number of micro-batches this rank yields."""
        step = self.samples_per_step
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, step)
        if not self.drop_last and rest > self.data_parallel_rank * self.micro_batch_size:
            full += 1
        return full

    def __repr__(self) -> str:
        return (
            f"PretrainingSampler(total_samples={self.total_samples}, "
            f"consumed_samples={self.consumed_samples}, "
            f"micro_batch_size={self.micro_batch_size}, "
            f"data_parallel_rank={self.data_parallel_rank}, "
            f"data_parallel_size={self.data_parallel_size}, drop_last={self.drop_last})"
        )


def samples_of_global_batch(
    consumed_samples: int,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    data_parallel_rank: int,
) -> list[list[int]]:
    """Micro-batches DP rank ``r`` processes in the global batch starting at ``consumed_samples``.

    Equals the next ``global_batch_size // (micro_batch_size * data_parallel_size)`` items of
    ``PretrainingSampler(..., consumed_samples, micro_batch_size, r, data_parallel_size)``.

    Args:
        consumed_samples: Samples consumed before this global batch (non-negative).
        global_batch_size: Samples per optimizer step over all DP ranks.
        micro_batch_size: Samples per micro-batch per DP rank.
        data_parallel_size: Number of DP replicas.
        data_parallel_rank: The rank whose micro-batches to return.

    Returns:
        One list of ``micro_batch_size`` sample indices per micro-batch, in order.

    Raises:
        ValueError: On bad sizes or rank, or when ``global_batch_size`` is not a multiple of
            ``micro_batch_size * data_parallel_size``.
    """
    global_batch_size = _positive("global_batch_size", global_batch_size)
    micro_batch_size = _positive("micro_batch_size", micro_batch_size)
    data_parallel_rank, data_parallel_size = _rank_and_size(data_parallel_rank, data_parallel_size)
    consumed_samples = _as_int("consumed_samples", consumed_samples)
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be non-negative, got {consumed_samples}")
    step = micro_batch_size * data_parallel_size
    if global_batch_size % step:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of "
            f"micro_batch_size * data_parallel_size = {step}"
        )
    first = consumed_samples + data_parallel_rank * micro_batch_size
    return [
        list(range(first + k * step, first + k * step + micro_batch_size))
        for k in range(global_batch_size // step)
    ]
