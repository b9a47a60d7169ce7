"""The exactly-once checker of the recovery tests (``harness.check_every_sample_once``): it
compares the sample indices the replicas processed against Megatron's sampler order, so a
duplicated or a missing index fails it even where the counts agree."""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
from harness import check_every_sample_once

from megatron_mecefo.takeover.data_remap import expand_ranges, index_ranges

GBS, REPLICAS, MBS = 8, 2, 2


def _records() -> List[Dict[str, Any]]:
    """Two iterations of DP2, 2 micro-batches of 2 per replica. Megatron's order: replica 0
    reads 0-1 and 4-5 of the batch, replica 1 reads 2-3 and 6-7. In iteration 2 replica 1
    is down and replica 0 takes its micro-batches over."""
    counts = {"samples_processed": GBS, "samples_skipped": 0}
    return [
        {"iteration": 1, "consumed_samples": 8, "mecefo": dict(counts),
         "samples": {"0": [[0, 2], [4, 6]], "1": [[2, 4], [6, 8]]}},
        {"iteration": 2, "consumed_samples": 16, "mecefo": dict(counts),
         "samples": {"0": [[8, 10], [12, 14], [10, 12], [14, 16]], "1": []}},
    ]  # fmt: skip


def _check(records: List[Dict[str, Any]]) -> None:
    check_every_sample_once(records, 2, GBS, REPLICAS, MBS)


def test_the_sampler_order_passes() -> None:
    _check(_records())


def _edited(iteration: int, replica: str, runs: List[List[int]]) -> List[Dict[str, Any]]:
    records = copy.deepcopy(_records())
    records[iteration - 1]["samples"][replica] = runs
    return records


@pytest.mark.parametrize(
    "iteration, replica, runs, message",
    [
        # Replica 1 reads replica 0's first micro-batch instead of its own last one: 0-1
        # twice, 6-7 never; the counts are unchanged (what the count check saw).
        (1, "1", [[2, 4], [0, 2]], r"more than once \[0, 1\], never \[6, 7\]"),
        # A duplicate alone: replica 0 also runs the micro-batch replica 1 ran.
        (1, "0", [[0, 2], [4, 6], [2, 4]], r"more than once \[2, 3\], never \[\]"),
        # A missing micro-batch alone: the takeover forgot replica 1's last one.
        (2, "0", [[8, 10], [12, 14], [10, 12]], r"more than once \[\], never \[14, 15\]"),
        # Indices that are no micro-batch of the sampler (an offset off by one).
        (1, "1", [[3, 5], [6, 8]], "not the sampler's"),
        # Its own micro-batches out of the sampler's order.
        (1, "0", [[4, 6], [0, 2]], "order"),
    ],
)
def test_a_wrong_index_fails(iteration: int, replica: str, runs: List, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        _check(_edited(iteration, replica, runs))


def test_records_without_indices_fail() -> None:
    records = _records()
    del records[0]["samples"]
    with pytest.raises(AssertionError, match="no sample indices"):
        _check(records)


def test_index_ranges_round_trip() -> None:
    indices = [0, 1, 4, 5, 2, 3, 3, 9]
    assert index_ranges(indices) == [[0, 2], [4, 6], [2, 4], [3, 4], [9, 10]]
    assert expand_ranges(index_ranges(indices)) == indices
    assert index_ranges([]) == []
