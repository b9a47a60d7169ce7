"""Data re-mapping: a replica's micro-batches for one iteration, own and absorbed.

A replica's own micro-batches come from its usual data iterator (Megatron's sampler for its
DP rank), which is always advanced by exactly one global batch's share, whether the replica
is up or down: a failed replica's data position stays aligned and it resumes with the right
samples. Absorbed micro-batches are the failed replica's samples, read by index from the
dataset: the indices are those Megatron's sampler gives that replica's DP rank.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterator, List, Optional, Sequence

from megatron_mecefo.data.sampler import samples_of_global_batch
from megatron_mecefo.takeover.plan import MicrobatchWork, StepPlan


class GlobalBatchLayout:
    """Which sample indices make up each replica's micro-batches of a global batch.

    Args:
        global_batch_size: Samples per iteration.
        micro_batch_size: Samples per micro-batch.
        num_replicas: Data-parallel size.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, num_replicas: int) -> None:
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.num_replicas = num_replicas
        self.microbatches = global_batch_size // (micro_batch_size * num_replicas)

    def samples(self, consumed_samples: int, source: int, index: int) -> List[int]:
        """Sample indices of micro-batch ``index`` of replica ``source``'s share."""
        return samples_of_global_batch(
            consumed_samples,
            self.global_batch_size,
            self.micro_batch_size,
            self.num_replicas,
            source,
        )[index]

    def account(self, plan: StepPlan, consumed_samples: int) -> dict:
        """Check that ``plan`` covers the global batch exactly once; return the counts.

        Raises:
            RuntimeError: If a sample is processed twice, or neither processed nor skipped.
        """
        seen: Counter = Counter()
        for work in plan.work:
            for mb in work:
                seen.update(self.samples(consumed_samples, mb.source, mb.index))
        skipped: Counter = Counter()
        for source, index in plan.skipped:
            skipped.update(self.samples(consumed_samples, source, index))
        expected = range(consumed_samples, consumed_samples + self.global_batch_size)
        for s in expected:
            if seen[s] + skipped[s] != 1:
                raise RuntimeError(
                    f"iteration {plan.iteration}: sample {s} is processed {seen[s]} time(s) and "
                    f"skipped {skipped[s]} time(s); the {plan.policy} plan is wrong"
                )
        return {"samples_processed": sum(seen.values()), "samples_skipped": sum(skipped.values())}


class ReplicaMicrobatches:
    """Iterator over one replica's micro-batches of one iteration, in plan order.

    Args:
        work: The replica's entries of the plan.
        own: Its own ``M`` micro-batches, already drawn from its data iterator (``None``
            entries on ranks that read no data, as Megatron-LM's TP ranks > 0).
        fetch: ``fetch(sample_indices)`` -> a collated micro-batch of another replica's
            samples; ``None`` on ranks that read no data.
        samples: ``samples(source, index)`` -> the sample indices of a micro-batch.
    """

    def __init__(
        self,
        work: Sequence[MicrobatchWork],
        own: Sequence[Any],
        fetch: Optional[Callable[[List[int]], Any]],
        samples: Callable[[int, int], List[int]],
        replica: int,
    ) -> None:
        self._work = list(work)
        self._own = list(own)
        self._fetch = fetch
        self._samples = samples
        self._replica = replica
        self._next = 0
        self.processed: List[List[int]] = []
        """Sample indices of every micro-batch handed out, in order."""

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._next >= len(self._work):
            raise StopIteration
        mb = self._work[self._next]
        self._next += 1
        indices = self._samples(mb.source, mb.index)
        self.processed.append(indices)
        if mb.source == self._replica and self._own[mb.index] is not None:
            return self._own[mb.index]
        return None if self._fetch is None else self._fetch(indices)


def index_ranges(indices: Sequence[int]) -> List[List[int]]:
    """``indices`` as runs ``[start, stop)`` of consecutive numbers, in order (the compact form
    of the sample indices a replica processed in an iteration): ``[0, 1, 4, 5, 2]`` ->
    ``[[0, 2], [4, 6], [2, 3]]``."""
    runs: List[List[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def expand_ranges(runs: Sequence[Sequence[int]]) -> List[int]:
    """The inverse of :func:`index_ranges`."""
    return [i for start, stop in runs for i in range(start, stop)]


def draw_own(iterator: Optional[Iterator[Any]], count: int) -> List[Any]:
    """The next ``count`` micro-batches of ``iterator`` (``None`` x count for no iterator)."""
    if iterator is None:
        return [None] * count
    return [next(iterator) for _ in range(count)]
