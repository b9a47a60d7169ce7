"""Erasure coding across data-parallel peers: placement, rebuild, checksums, too many losses."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gf256_oracle import OracleCodec

from megatron_mecefo.snapshot import erasure
from megatron_mecefo.snapshot.erasure import SnapshotLost, encode_group, placement, rebuild


def _shards(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=5000 + 37 * i, dtype=np.uint8) for i in range(n)]


@pytest.mark.parametrize("n,m", [(2, 1), (4, 1), (4, 2), (5, 2), (6, 3)])
def test_placement_rule(n: int, m: int) -> None:
    stripes = placement(n, m)
    assert len(stripes) == n
    for s in stripes:  # n blocks of a stripe on n different members
        assert sorted(s.parity_members + s.data_members) == list(range(n))
    for x in range(n):  # each shard: n - m pieces, each in exactly one stripe
        pieces = sorted(
            p for s in stripes for d, p in zip(s.data_members, s.pieces, strict=True) if d == x
        )
        assert pieces == list(range(n - m))
        assert sum(x in s.parity_members for s in stripes) == m  # equal parity load
    assert placement(4, 2) == placement(4, 2)  # deterministic
    assert placement(4, 2)[1].parity_members == (1, 2)


def test_oracle_agrees_with_pyeclib_and_xor() -> None:
    """Every codec (the oracle, pyeclib ISA-L, zfec, XOR) rebuilds every pattern of m lost
    blocks of one stripe to the original bytes, twice in a row (zfec reorders its inputs)."""
    rng = np.random.default_rng(1)
    k = 4
    data = [rng.integers(0, 256, size=256, dtype=np.uint8) for _ in range(k)]
    for m in (1, 2):
        codecs = [OracleCodec(k, m), erasure.ReedSolomonCodec(k, m), erasure.ZfecCodec(k, m)]
        if m == 1:
            codecs.append(erasure.XorCodec(k, m))
        for codec in codecs:
            parity = codec.encode(data)
            blocks = {**dict(enumerate(data)), **{k + j: p for j, p in enumerate(parity)}}
            for lost in itertools.combinations(range(k + m), m):
                have = {i: b for i, b in blocks.items() if i not in lost}
                for _ in range(2):
                    got = codec.decode(have)
                    assert all(np.array_equal(g, d) for g, d in zip(got, data, strict=True)), (
                        codec.name,
                        lost,
                    )


@pytest.mark.parametrize(
    "n,m,prefer",
    [(4, 1, "auto"), (4, 2, "auto"), (5, 2, "isa_l"), (3, 1, "zfec"), (5, 2, "oracle")],
)
def test_any_m_lost_members_are_rebuilt_bit_exactly(n: int, m: int, prefer: str) -> None:
    shards = _shards(n)
    group = encode_group(shards, m, prefer, factory=OracleCodec if prefer == "oracle" else None)
    assert group.length % erasure.ALIGN == 0
    for lost in itertools.combinations(range(n), m):
        alive = {i: s for i, s in enumerate(shards) if i not in lost}
        out = rebuild(group, alive, lost)
        assert sorted(out) == list(lost)
        assert all(np.array_equal(out[i], shards[i]) for i in lost), lost


def test_flipped_byte_is_detected_and_counted_as_lost() -> None:
    n, m = 4, 1
    shards = _shards(n, seed=2)
    group = encode_group(shards, m)
    corrupt = [s.copy() for s in shards]
    corrupt[2][10] ^= 0x40  # a flipped bit in a survivor's piece 0
    alive = {i: s for i, s in enumerate(corrupt) if i != 0}
    # Member 0 lost + member 2's piece corrupt = 2 blocks of one stripe with m = 1.
    with pytest.raises(SnapshotLost, match="lost or corrupt"):
        rebuild(group, alive, [0])
    # With m = 2 the corrupt piece is just one more erasure: the shard comes back exact.
    group2 = encode_group(shards, 2)
    out = rebuild(group2, alive, [0])
    assert np.array_equal(out[0], shards[0])
    # A corrupt parity block is detected the same way.
    stripe = next(s for s in placement(n, m) if 0 in s.data_members and 3 in s.parity_members)
    group.parity[(stripe.index, 0)][0] ^= 1
    with pytest.raises(SnapshotLost):
        rebuild(group, {i: s for i, s in enumerate(shards) if i != 0}, [0])


def test_losing_m_plus_one_members_falls_back_to_disk_with_a_clear_message() -> None:
    shards = _shards(4, seed=3)
    group = encode_group(shards, 1)
    with pytest.raises(
        SnapshotLost, match=r"cannot be rebuilt; falling back to the disk checkpoint"
    ):
        rebuild(group, {2: shards[2], 3: shards[3]}, [0, 1])
