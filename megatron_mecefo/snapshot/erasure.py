"""Erasure coding of snapshots across the data-parallel peers of one TP/PP position.

**Group.** The ``n`` data-parallel peers at the same TP/PP coordinates (one per replica, so
on ``n`` different nodes when each replica has its own nodes) each hold a snapshot shard
``S_i`` that no other member has (with the distributed optimizer, its optimizer shard).

**Placement rule (deterministic, RAID-5/6-style rotation).** There are ``n`` stripes. In
stripe ``t`` the members ``t, t+1, ..., t+m-1 (mod n)`` hold its ``m`` parity blocks and the
other ``n - m`` members each contribute one piece of their own shard, in member order. Every
member contributes to ``n - m`` stripes, so ``S_i`` is cut into ``n - m`` equal pieces
(zero-padded), piece ``j`` going to the ``j``-th stripe member ``i`` contributes to. Each
stripe's ``n`` blocks sit on ``n`` different members, so losing any ``m`` members loses at
most ``m`` blocks of every stripe: the code (MDS, ``k = n - m`` data + ``m`` parity) rebuilds
them. Each member stores ``m`` parity blocks of ``|S| / (n - m)`` bytes: ``m / (n - m)`` of
its own snapshot.

**Codes.** ``XorCodec`` (m = 1, torch int64 XOR) and, for m >= 2, ``ZfecCodec`` (zfec's
Reed-Solomon on raw blocks); ``ReedSolomonCodec`` (pyeclib's ``isa_l_rs_vand``) is the
measured alternative. ``benchmarks/snapshot_overhead.py`` measures them side by side (64 MiB,
k = 4, one thread): the libraries alone are close and swap places between runs, and pyeclib
needs the stripe concatenated and its fragment headers kept, zfec takes raw blocks.
Every block carries a CRC-32; a block whose CRC does not
match is treated as lost. More than ``m`` lost blocks in a stripe raise
:class:`SnapshotLost`, whose message says the snapshot cannot be rebuilt and the job falls
back to its disk checkpoint.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

ALIGN = 64  # piece length multiple: ISA-L's fragments then hold the piece bytes verbatim


class SnapshotLost(RuntimeError):
    """Too many members of a group are lost (or corrupt) to rebuild a snapshot shard."""


@dataclass(frozen=True)
class Stripe:
    """One stripe of a group: who holds its parity, who contributes which piece."""

    index: int
    parity_members: Tuple[int, ...]
    data_members: Tuple[int, ...]
    pieces: Tuple[int, ...]
    """``pieces[j]``: which piece of ``data_members[j]``'s shard is in this stripe."""


def placement(n: int, m: int) -> List[Stripe]:
    """The stripes of a group of ``n`` members with ``m`` parity blocks per stripe."""
    if not 0 <= m < n:
        raise ValueError(f"redundancy m={m} must be in [0, {n - 1}] for a group of {n} peers")
    if m == 0:
        return []
    used = [0] * n
    stripes = []
    for t in range(n):
        parity = tuple((t + j) % n for j in range(m))
        data = tuple(x for x in range(n) if x not in parity)
        pieces = tuple(used[x] for x in data)
        for x in data:
            used[x] += 1
        stripes.append(Stripe(t, parity, data, pieces))
    return stripes


def piece_length(shard_bytes: int, n: int, m: int) -> int:
    """Bytes of one piece (and of one parity block) for shards of ``shard_bytes``."""
    raw = -(-shard_bytes // (n - m))
    return max(ALIGN, -(-raw // ALIGN) * ALIGN)


def split(shard: np.ndarray, n: int, m: int, length: Optional[int] = None) -> List[np.ndarray]:
    """``shard`` (uint8) cut into ``n - m`` pieces of ``piece_length`` bytes, zero-padded."""
    length = length or piece_length(shard.size, n, m)
    padded = np.zeros(length * (n - m), dtype=np.uint8)
    padded[: shard.size] = shard
    return [padded[i * length : (i + 1) * length] for i in range(n - m)]


def crc(block: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(block))) & 0xFFFFFFFF


class XorCodec:
    """Single parity (m = 1): the XOR of the k data blocks, in torch over int64 words."""

    name = "xor"

    def __init__(self, k: int, m: int) -> None:
        if m != 1:
            raise ValueError(f"XOR parity protects against one loss only (m=1), not m={m}")
        self.k, self.m = k, m

    def encode(self, data: Sequence[np.ndarray]) -> List[np.ndarray]:
        acc = torch.from_numpy(np.array(data[0])).view(torch.int64).clone()
        for block in data[1:]:
            acc.bitwise_xor_(torch.from_numpy(block).view(torch.int64))
        return [acc.view(torch.uint8).numpy()]

    def decode(self, blocks: Dict[int, np.ndarray]) -> List[np.ndarray]:
        """The k data blocks from any k of the k + 1 blocks (index k is the parity)."""
        missing = [i for i in range(self.k) if i not in blocks]
        if not missing:
            return [blocks[i] for i in range(self.k)]
        (lost,) = missing
        present = [blocks[i] for i in range(self.k + 1) if i != lost]
        out = dict(blocks)
        out[lost] = self.encode(present)[0]
        return [out[i] for i in range(self.k)]


class ReedSolomonCodec:
    """Reed-Solomon through pyeclib (``isa_l_rs_vand`` by default): any k of k + m blocks.

    pyeclib frames every fragment with a small header; the data fragments' payloads are the
    pieces verbatim (piece length a multiple of 64), so only the headers are kept beside the
    parity and data fragments are rebuilt from the members' own pieces.
    """

    def __init__(self, k: int, m: int, ec_type: str = "isa_l_rs_vand") -> None:
        from pyeclib.ec_iface import ECDriver

        self.k, self.m, self.name = k, m, ec_type
        self.driver = ECDriver(k=k, m=m, ec_type=ec_type)
        self.headers: Optional[List[bytes]] = None
        self._offset = 0

    def encode(self, data: Sequence[np.ndarray]) -> List[np.ndarray]:
        length = data[0].size
        fragments = self.driver.encode(np.concatenate(data).tobytes())
        header = len(fragments[0]) - length
        payloads = [np.frombuffer(f, dtype=np.uint8, offset=header) for f in fragments]
        # The layout is checked on the first encode (it depends only on the library).
        for i in range(self.k) if self.headers is None else ():
            if payloads[i].size != length or not np.array_equal(payloads[i], data[i]):
                raise RuntimeError(
                    f"{self.name}: data fragment {i} does not hold its piece verbatim; this "
                    "pyeclib layout is not supported"
                )
        self.headers = [bytes(f[:header]) for f in fragments]
        self._offset = header
        return [payloads[self.k + j].copy() for j in range(self.m)]

    def decode(self, blocks: Dict[int, np.ndarray]) -> List[np.ndarray]:
        if self.headers is None:
            raise RuntimeError("decode before encode: the fragment headers are unknown")
        fragments = [self.headers[i] + blocks[i].tobytes() for i in sorted(blocks)]
        raw = self.driver.decode(fragments)
        length = blocks[next(iter(blocks))].size
        flat = np.frombuffer(raw, dtype=np.uint8)
        return [flat[i * length : (i + 1) * length] for i in range(self.k)]


class ZfecCodec:
    """Reed-Solomon through zfec on raw blocks (no framing): any k of k + m blocks."""

    name = "zfec"

    def __init__(self, k: int, m: int) -> None:
        import zfec

        self.k, self.m = k, m
        self._encoder = zfec.Encoder(k, k + m)
        self._decoder = zfec.Decoder(k, k + m)

    def encode(self, data: Sequence[np.ndarray]) -> List[np.ndarray]:
        checks = self._encoder.encode(
            [d.tobytes() for d in data], list(range(self.k, self.k + self.m))
        )
        return [np.frombuffer(c, dtype=np.uint8).copy() for c in checks]

    def decode(self, blocks: Dict[int, np.ndarray]) -> List[np.ndarray]:
        nums = sorted(blocks)[: self.k]
        # Fresh lists on every call: zfec's decode reorders the lists it is given in place.
        out = self._decoder.decode([blocks[i].tobytes() for i in nums], list(nums))
        return [np.frombuffer(b, dtype=np.uint8) for b in out]


def make_codec(k: int, m: int, prefer: str = "auto"):
    """``auto``: XOR for m = 1, zfec for m >= 2 (the fastest measured here); or by name:
    ``xor``, ``zfec``, ``isa_l`` (pyeclib)."""
    if prefer == "xor" or (prefer == "auto" and m == 1):
        return XorCodec(k, m)
    if prefer in ("auto", "zfec"):
        return ZfecCodec(k, m)
    return ReedSolomonCodec(k, m)


@dataclass
class GroupParity:
    """What a group stores beside its members' own shards: parity blocks and checksums."""

    n: int
    m: int
    shard_bytes: List[int]
    length: int
    parity: Dict[Tuple[int, int], np.ndarray]
    """``(stripe, j)`` -> parity block ``j`` of the stripe (held by ``parity_members[j]``)."""
    crcs: Dict[Tuple[str, int, int], int]
    """``("data", member, piece)`` / ``("parity", stripe, j)`` -> CRC-32."""
    codecs: Dict[int, object]


def encode_group(
    shards: Sequence[np.ndarray], m: int, prefer: str = "auto", factory: Any = None
) -> GroupParity:
    """Parity for the shards of one group (``shards[i]`` is member ``i``'s, uint8).

    ``factory(k, m)`` builds the codec (default :func:`make_codec` with ``prefer``).
    """
    n = len(shards)
    length = piece_length(max(s.size for s in shards), n, m)
    pieces = [split(s, n, m, length) for s in shards]
    parity, crcs, codecs = {}, {}, {}
    for i, member in enumerate(pieces):
        for j, p in enumerate(member):
            crcs[("data", i, j)] = crc(p)
    for stripe in placement(n, m):
        codec = factory(n - m, m) if factory else make_codec(n - m, m, prefer)
        blocks = codec.encode(
            [pieces[x][p] for x, p in zip(stripe.data_members, stripe.pieces, strict=True)]
        )
        for j, block in enumerate(blocks):
            parity[(stripe.index, j)] = block
            crcs[("parity", stripe.index, j)] = crc(block)
        codecs[stripe.index] = codec
    return GroupParity(n, m, [s.size for s in shards], length, parity, crcs, codecs)


def rebuild(
    group: GroupParity, shards: Dict[int, np.ndarray], lost: Sequence[int]
) -> Dict[int, np.ndarray]:
    """The shards of the ``lost`` members, rebuilt from the surviving ``shards`` and parity.

    A surviving piece or parity block whose CRC does not match counts as lost too.

    Raises:
        SnapshotLost: When a stripe has more than ``m`` blocks lost (e.g. m + 1 members gone).
    """
    n, m, length = group.n, group.m, group.length
    lost_set = set(lost)
    pieces = {i: split(s, n, m, length) for i, s in shards.items() if i not in lost_set}
    out = {i: [None] * (n - m) for i in lost_set}
    for stripe in placement(n, m):
        blocks: Dict[int, np.ndarray] = {}
        for col, (x, p) in enumerate(zip(stripe.data_members, stripe.pieces, strict=True)):
            if x in pieces and crc(pieces[x][p]) == group.crcs[("data", x, p)]:
                blocks[col] = pieces[x][p]
        for j, holder in enumerate(stripe.parity_members):
            block = group.parity.get((stripe.index, j))
            if holder in lost_set or block is None:
                continue
            if crc(block) == group.crcs[("parity", stripe.index, j)]:
                blocks[n - m + j] = block
        if len(blocks) < n - m:
            gone = sorted(lost_set | {x for x in range(n) if x not in pieces})
            raise SnapshotLost(
                f"snapshot stripe {stripe.index} of a group of {n} peers has only {len(blocks)} "
                f"of the {n - m} intact blocks it needs (members {gone} lost or corrupt, "
                f"redundancy m={m}): the in-memory snapshot cannot be rebuilt; falling back to "
                "the disk checkpoint (--load)"
            )
        data = group.codecs[stripe.index].decode(blocks)
        for col, (x, p) in enumerate(zip(stripe.data_members, stripe.pieces, strict=True)):
            if x in out:
                out[x][p] = np.asarray(data[col])
    return {i: np.concatenate(ps)[: group.shard_bytes[i]] for i, ps in out.items()}
