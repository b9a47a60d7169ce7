"""Parity of a committed snapshot across its data-parallel group, and rebuilding a lost shard.

**In the training loop** (:func:`exchange_parity`). Once a rank's copy of snapshot ``s`` is
complete (checksummed, header sealed), the members of its data-parallel group (the peers at
one TP/PP position) compute the parity of their ``n`` slots with :mod:`.erasure`'s placement
rule: each member contributes its ``n - m`` pieces and keeps the ``m`` parity blocks it is
assigned, with every member's header (tensor layout, checksum, metadata, the
distributed-optimizer shard map) and every piece's CRC-32. For m = 1 the parity of a stripe
goes to its holder by one ``reduce_scatter`` with ``ReduceOp.BXOR`` for all stripes at once
(the holder of stripe ``t`` is member ``t``; it contributes zeros to its own stripe);
for m >= 2 each holder gathers the stripe's pieces and encodes them with zfec. A snapshot
counts as committed (:class:`~.manager.SnapshotManager`) only once its parity is stored.

**After a real death** (:func:`rebuild_group`). The surviving members of a group gather their
slots and parity blocks and rebuild the lost members' slots (:func:`.erasure.rebuild`); each
rebuilt slot must match the CRC-32 its owner sealed. More than ``m`` lost members raise
:class:`~.erasure.SnapshotLost`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_mecefo.snapshot.erasure import (
    GroupParity,
    SnapshotLost,
    crc,
    make_codec,
    piece_length,
    placement,
    rebuild,
    split,
)


@dataclass
class SlotParity:
    """What one member keeps beside its own slot for a snapshot: its share of the parity."""

    iteration: int
    m: int
    members: List[int]
    """The group's members in member order, by their recovery slot (original global rank)."""
    headers: List[Dict[str, Any]]
    """Every member's slot header (layout, nbytes, crc32, metadata), in member order."""
    length: int
    """Bytes of one piece and of one parity block."""
    blocks: Dict[Tuple[int, int], np.ndarray] = field(default_factory=dict)
    """``(stripe, j)`` -> the parity blocks this member holds."""
    crcs: Dict[Tuple[str, int, int], int] = field(default_factory=dict)
    """``("data", member, piece)`` for every member's pieces, ``("parity", stripe, j)`` for
    the blocks held here."""
    seconds: float = 0.0
    """Time the exchange took on this rank."""

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.blocks.values())


def _slot_bytes(buffer: torch.Tensor, nbytes: int) -> np.ndarray:
    return buffer[:nbytes].numpy()


def exchange_parity(
    buffer: torch.Tensor,
    header: Dict[str, Any],
    m: int,
    group: Any,
    my_slot: int,
) -> SlotParity:
    """Collective over the data-parallel ``group``: store this member's share of the parity
    of the snapshot in ``buffer`` (sealed, described by ``header``).

    Every member of ``group`` calls it for the same snapshot. Returns this member's
    :class:`SlotParity` (the caller keeps it with the slot).
    """
    t0 = time.perf_counter()
    ranks = dist.get_process_group_ranks(group)
    n = len(ranks)
    me = ranks.index(dist.get_rank())
    ids = torch.tensor([my_slot, header["nbytes"]], dtype=torch.int64)
    every = [torch.empty_like(ids) for _ in range(n)]
    dist.all_gather(every, ids, group=group)
    members = [int(e[0]) for e in every]
    length = piece_length(max(int(e[1]) for e in every), n, m)
    mine = split(_slot_bytes(buffer, header["nbytes"]), n, m, length)
    my_crcs = [crc(p) for p in mine]
    gathered: List[Any] = [None] * n
    dist.all_gather_object(gathered, (header, my_crcs), group=group)
    out = SlotParity(int(header["iteration"]), m, members, [g[0] for g in gathered], length)
    for i, (_, crcs) in enumerate(gathered):
        for j, value in enumerate(crcs):
            out.crcs[("data", i, j)] = int(value)
    zeros = np.zeros(length, dtype=np.uint8)
    stripes = placement(n, m)
    if m == 1:
        # XOR parity: stripe t's holder is member t, so one reduce-scatter with BXOR gives
        # every member its stripe's parity (each member contributes zeros to its own stripe).
        chunks = np.zeros((n, length), dtype=np.uint8)
        for stripe in stripes:
            if me in stripe.data_members:
                chunks[stripe.index] = mine[stripe.pieces[stripe.data_members.index(me)]]
        words = torch.from_numpy(chunks.reshape(-1)).view(torch.int64)
        result = torch.empty(length // 8, dtype=torch.int64)
        dist.reduce_scatter_single(result, words, op=dist.ReduceOp.BXOR, group=group)
        (stripe,) = [t for t in stripes if t.parity_members == (me,)]
        out.blocks[(stripe.index, 0)] = result.view(torch.uint8).numpy()
        stripes = []
    for stripe in stripes:
        piece = zeros
        if me in stripe.data_members:
            piece = mine[stripe.pieces[stripe.data_members.index(me)]]
        for j, holder in enumerate(stripe.parity_members):
            src = torch.from_numpy(piece.copy())
            bucket = [torch.empty_like(src) for _ in range(n)] if me == holder else None
            dist.gather(src, bucket, dst=ranks[holder], group=group)
            if me == holder:
                data = [bucket[x].numpy() for x in stripe.data_members]
                out.blocks[(stripe.index, j)] = make_codec(n - m, m).encode(data)[j]
    for (t, j), block in out.blocks.items():
        out.crcs[("parity", t, j)] = crc(block)
    out.seconds = time.perf_counter() - t0
    return out


def rebuild_group(
    buffer: torch.Tensor, parity: SlotParity, group: Any, my_slot: int
) -> Dict[int, Tuple[Dict[str, Any], np.ndarray]]:
    """Collective over the surviving members of a group (``group``, the new world's
    data-parallel group): every member's slot of snapshot ``parity.iteration``, by recovery slot.

    Each survivor passes its own slot (``buffer``) and its :class:`SlotParity`. Survivors'
    slots are checked against their sealed CRC-32; the lost members' are rebuilt from the
    survivors' pieces and parity blocks and checked against the CRC-32 their owners sealed.

    Returns:
        ``{slot: (header, bytes)}`` for every member of the snapshot's group.

    Raises:
        SnapshotLost: More than ``m`` members lost (or corrupt), or a rebuilt slot whose
            checksum does not match.
    """
    n_old, m = len(parity.members), parity.m
    me = parity.members.index(my_slot)
    own = _slot_bytes(buffer, parity.headers[me]["nbytes"])
    size = dist.get_world_size(group)
    # The small part (who holds which parity blocks, the CRCs) as objects; the bytes (each
    # survivor's slot and parity blocks, packed into one buffer of a common size) with one
    # tensor all_gather: pickling them took most of the rebuild's time at 64 MiB.
    held = sorted(parity.blocks)
    every: List[Any] = [None] * size
    dist.all_gather_object(every, (my_slot, held, parity.crcs), group=group)
    length, top = parity.length, max(int(h["nbytes"]) for h in parity.headers)
    most = max(len(keys) for _, keys, _ in every)
    packed = torch.zeros(top + most * length, dtype=torch.uint8)
    view = packed.numpy()
    view[: own.size] = own
    for j, key in enumerate(held):
        view[top + j * length : top + (j + 1) * length] = parity.blocks[key]
    gathered = [torch.empty_like(packed) for _ in range(size)]
    dist.all_gather(gathered, packed, group=group)
    shards: Dict[int, np.ndarray] = {}
    blocks: Dict[Tuple[int, int], np.ndarray] = {}
    crcs: Dict[Tuple[str, int, int], int] = {}
    for (slot, keys, their_crcs), their in zip(every, gathered, strict=True):
        idx = parity.members.index(int(slot))
        raw = their.numpy()
        data = raw[: int(parity.headers[idx]["nbytes"])]
        if crc(data) == parity.headers[idx]["crc32"]:  # a corrupt slot counts as lost
            shards[idx] = data
        for j, key in enumerate(keys):
            blocks[tuple(key)] = raw[top + j * length : top + (j + 1) * length]
        crcs.update(their_crcs)
    lost = [i for i in range(n_old) if i not in shards]
    if len(lost) > m:
        raise SnapshotLost(
            f"snapshot of iteration {parity.iteration}: {len(lost)} members of a group of "
            f"{n_old} peers lost or corrupt (slots {[parity.members[i] for i in lost]}), more "
            f"than the redundancy m={m}: the in-memory snapshot cannot be rebuilt; falling "
            "back to the disk checkpoint (--load)"
        )
    out = {parity.members[i]: (parity.headers[i], shards[i]) for i in shards}
    if lost:
        codecs = {t: make_codec(n_old - m, m) for t in range(n_old)}
        nbytes = [int(h["nbytes"]) for h in parity.headers]
        gp = GroupParity(n_old, m, nbytes, parity.length, blocks, crcs, codecs)
        for i, data in rebuild(gp, shards, lost).items():
            header = parity.headers[i]
            if crc(data) != header["crc32"]:
                raise SnapshotLost(
                    f"snapshot of iteration {parity.iteration}: the rebuilt slot of rank "
                    f"{parity.members[i]} fails its checksum: the in-memory snapshot cannot be "
                    "rebuilt; falling back to the disk checkpoint (--load)"
                )
            out[parity.members[i]] = (header, data)
    return out


def read_tensors(header: Dict[str, Any], data: np.ndarray) -> Dict[str, torch.Tensor]:
    """The named tensors of a slot given as bytes (views into ``data``)."""
    flat = torch.from_numpy(data)
    out = {}
    for name, shape, dtype, offset, nbytes in header["entries"]:
        out[name] = flat[offset : offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
    return out


def optimizer_digest(header: Dict[str, Any], data: np.ndarray) -> str:
    """SHA-256 of a slot's optimizer tensors (names and bytes, in name order): compares a
    rebuilt shard with the one its owner held, independently of the CRC-32."""
    import hashlib

    h = hashlib.sha256()
    for name, _shape, _dtype, offset, nbytes in header["entries"]:
        if name.startswith("optim"):
            h.update(name.encode())
            h.update(memoryview(np.ascontiguousarray(data[offset : offset + nbytes])))
    return h.hexdigest()


def group_timeout(group: Any) -> Any:
    """The collective timeout of a gloo ``group`` (a ``timedelta``), or None if unknown."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def clone_group(group: Any) -> Any:
    """Collective over the whole world (every rank, at the same point): a new gloo group with
    the members of ``group`` (this rank's data-parallel group), for the background parity
    exchange, so that its collectives never interleave with the training thread's on
    ``group``. Every rank creates every clone, in sorted order of the members (``new_group``
    is collective over the world); the clones get ``group``'s timeout.

    Returns:
        The clone this rank belongs to.
    """
    mine = dist.get_process_group_ranks(group)
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    timeout = group_timeout(group)
    own = None
    for ranks in sorted({tuple(int(r) for r in e) for e in every}):
        new = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
        if dist.get_rank() in ranks:
            own = new
    return own
