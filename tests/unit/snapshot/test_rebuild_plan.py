"""The plan of a rebuild by stripe (``parity._plan``), checked without processes: for every
group size, redundancy and set of lost members, carrying out the plan's transfers by hand and
decoding gives back the lost shards; every stripe takes exactly ``n - m`` intact blocks, the
rebuilder's own first; too many losses, or a stripe short of intact parity, give
``SnapshotLost`` on every member alike.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Tuple

import numpy as np
import pytest

from megatron_mecefo.snapshot.erasure import (
    SnapshotLost,
    crc,
    encode_group,
    make_codec,
    split,
)
from megatron_mecefo.snapshot.parity import SlotParity, _plan


def _group(n: int, m: int) -> Tuple[List[np.ndarray], List[SlotParity]]:
    rng = np.random.default_rng(n * 10 + m)
    shards = [rng.integers(0, 256, size=3000 + 77 * i, dtype=np.uint8) for i in range(n)]
    gp = encode_group(shards, m)
    headers = [{"nbytes": int(s.size), "crc32": crc(s)} for s in shards]
    members = [100 + i for i in range(n)]
    out = []
    for i in range(n):
        p = SlotParity(3, m, members, headers, gp.length, crcs=dict(gp.crcs))
        for (t, j), block in gp.parity.items():
            if (t + j) % n == i:  # the placement rule: stripe t's parity j is on member t + j
                p.blocks[(t, j)] = block
        out.append(p)
    return shards, out


def _every(parities: List[SlotParity], present: List[int], intact: List[int]) -> list:
    return [(100 + i, i in intact, sorted(parities[i].blocks)) for i in present]


def _carry_out(shards: List[np.ndarray], parities: List[SlotParity], jobs: list) -> Dict:
    """Each job's blocks taken from their holders, decoded: the rebuilt shards by member."""
    n, m, length = len(shards), parities[0].m, parities[0].length
    pieces = [split(s, n, m, length) for s in shards]
    rebuilt: Dict[int, List[np.ndarray]] = {}
    for job in jobs:
        blocks = {}
        for s in job.sources:
            if s.key[0] == "data":
                blocks[s.col] = pieces[s.key[1]][s.key[2]]
            else:
                blocks[s.col] = parities[s.holder].blocks[(s.key[1], s.key[2])]
        data = make_codec(n - m, m).decode(blocks)
        for x in job.targets:
            col = job.stripe.data_members.index(x)
            rebuilt.setdefault(x, [None] * (n - m))[job.stripe.pieces[col]] = data[col]
    return {x: np.concatenate(ps)[: shards[x].size] for x, ps in rebuilt.items()}


@pytest.mark.parametrize("n,m", [(2, 1), (3, 1), (4, 1), (5, 1), (4, 2), (6, 2), (7, 3)])
def test_plan_rebuilds_every_loss_of_up_to_m_members(n: int, m: int) -> None:
    if m >= 2:
        pytest.importorskip("zfec")
    shards, parities = _group(n, m)
    for count in range(1, m + 1):
        for lost in itertools.combinations(range(n), count):
            present = [i for i in range(n) if i not in lost]
            every = _every(parities, present, present)
            got_lost, who, jobs = _plan(parities[present[0]], every, None)
            assert got_lost == list(lost)
            assert set(who) == set(lost) and all(who[x] in present for x in lost)
            for job in jobs:
                holders = [s.holder for s in job.sources]
                assert len(holders) == n - m and not set(holders) & set(lost), job
                # The rebuilder's own intact blocks are all used before any remote one.
                own = [x for x in job.stripe.data_members if x == job.rebuilder] + [
                    x for x in job.stripe.parity_members if x == job.rebuilder
                ]
                assert holders.count(job.rebuilder) == min(len(own), n - m), job
            rebuilt = _carry_out(shards, parities, jobs)
            assert sorted(rebuilt) == list(lost)
            for x in lost:
                assert np.array_equal(rebuilt[x], shards[x]), (n, m, lost, x)
            # Every member derives the same plan from the same gathered metadata.
            for i in present[1:]:
                assert _plan(parities[i], every, None)[2] == jobs


def test_a_corrupt_member_and_a_named_rebuilder() -> None:
    """A present member whose slot fails its CRC counts as lost and can rebuild its own slot
    (``rebuilders``): its own pieces and parity are then not used."""
    shards, parities = _group(4, 1)
    every = _every(parities, [0, 1, 2, 3], [0, 2, 3])
    lost, who, jobs = _plan(parities[0], every, {101: 101})
    assert lost == [1] and who == {1: 1}
    assert all(s.holder != 1 for job in jobs for s in job.sources)
    assert np.array_equal(_carry_out(shards, parities, jobs)[1], shards[1])


def test_too_many_losses_and_missing_parity_raise_snapshot_lost() -> None:
    _, parities = _group(4, 1)
    with pytest.raises(SnapshotLost, match="more than the redundancy m=1: the in-memory"):
        _plan(parities[0], _every(parities, [0, 3], [0, 3]), None)
    # Member 1 lost and member 0's parity of stripe 0 corrupt (not reported intact): stripe 0
    # keeps two of the three blocks it needs.
    every = _every(parities, [0, 2, 3], [0, 2, 3])
    every[0] = (100, True, [])
    with pytest.raises(SnapshotLost, match="stripe 0 of a group of 4 peers has only 2 of the 3"):
        _plan(parities[2], every, None)
