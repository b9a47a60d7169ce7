"""Rebuilding a lost slot moves only what its stripes need (``parity.rebuild_slots``).

Four forked gloo ranks (torch only) each hold a 64 MiB slot of random bytes and a spare slot
of the same size (the manager keeps two or more); after ``exchange_parity`` member 1 is lost
and the three survivors rebuild its slot over a group of their own. Every
``torch.distributed`` call in the survivors goes through a counter installed here (tensor
bytes per call, pickled objects apart), so the test does not take the function's own word for
what moved. Asserted: the rebuilt slot equals the original byte for byte; the rebuilder
receives exactly the blocks the erasure code needs, the senders send exactly theirs and
receive nothing, a survivor whose blocks are not needed (m = 2) moves no tensor bytes; no
message is larger than the bucket; and each survivor's resident memory, sampled by a thread
during the rebuild, stays within 1.15x of its steady state. The old ``rebuild_group`` (an
all-gather of every packed slot to every survivor) fails the last three.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from megatron_mecefo.recovery.state.memory import PeakRss, rss_bytes

N = 4
LOST = 1
MIB = 1 << 20
SLOT_BYTES = 64 * MIB
BUCKET = 4 * MIB


def _slot_bytes(rank: int) -> np.ndarray:
    rng = np.random.default_rng(2000 + rank)
    return rng.integers(0, 256, size=SLOT_BYTES + 333 * rank, dtype=np.uint8)


class _Counter:
    """Tensor bytes each ``torch.distributed`` call of this process moves (a collective's
    share for this rank), and the pickled bytes of the object collectives apart."""

    P2P_SEND = ("isend", "send")
    P2P_RECV = ("irecv", "recv")
    OBJECTS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
    OTHERS = (
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "all_reduce",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "gather",
        "scatter",
        "all_to_all",
        "all_to_all_single",
        "batch_isend_irecv",
    )

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.objects = 0
        self.largest = 0
        self.calls: Dict[str, int] = {}
        self._inside_object = False

    def install(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for name in self.P2P_SEND + self.P2P_RECV + self.OBJECTS + self.OTHERS:
            original = getattr(c10d, name)
            wrapped = self._wrap(name, original)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)

    def _wrap(self, name: str, fn: Any) -> Any:
        def inner(*args: Any, **kwargs: Any) -> Any:
            if self._inside_object:  # the object collectives' own tensor calls
                return fn(*args, **kwargs)
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in self.OBJECTS:
                self.objects += len(pickle.dumps(args[1] if len(args) > 1 else args[0]))
                self._inside_object = True
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._inside_object = False
            self._count(name, args, kwargs)
            return fn(*args, **kwargs)

        return inner

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        import torch.distributed as dist

        tensors = _flatten(list(args) + list(kwargs.values()))
        nbytes = [t.numel() * t.element_size() for t in tensors]
        self.largest = max([self.largest] + nbytes)
        if name in self.P2P_SEND:
            self.sent += sum(nbytes)
        elif name in self.P2P_RECV:
            self.received += sum(nbytes)
        elif name == "broadcast":
            src = kwargs.get("src", args[1] if len(args) > 1 else None)
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            peers = dist.get_world_size(group) - 1
            if src == dist.get_rank():
                self.sent += nbytes[0] * peers
            else:
                self.received += nbytes[0]
        else:  # any other collective: every tensor it touches, both ways (an upper bound)
            self.sent += sum(nbytes)
            self.received += sum(nbytes)


def _flatten(items: List[Any]) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    for item in items:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            out.extend(_flatten(list(item)))
    return out


def _malloc_trim() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _worker(rank: int, port: int, m: int, out: str) -> None:
    import datetime
    import gc
    import zlib

    import torch.distributed as dist

    from megatron_mecefo.snapshot.parity import exchange_parity, rebuild_slots

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=N, timeout=datetime.timedelta(seconds=120)
    )
    result: dict = {}
    try:
        data = _slot_bytes(rank)
        buffer = torch.zeros(data.size + 64, dtype=torch.uint8)
        buffer[: data.size] = torch.from_numpy(data)
        header = {
            "iteration": 5,
            "rank": rank,
            "nbytes": int(data.size),
            "crc32": zlib.crc32(memoryview(data)) & 0xFFFFFFFF,
            "entries": [["optim0.main.0.0", [data.size], "uint8", 0, int(data.size)]],
            "meta": {},
        }
        parity = exchange_parity(buffer, header, m, dist.group.WORLD, my_slot=10 + rank)
        del data
        # A spare slot, written once (resident), as the manager's other slots are: the
        # rebuilder rebuilds into it.
        spare = torch.full((SLOT_BYTES + 333 * N,), 7, dtype=torch.uint8)
        survivors = [r for r in range(N) if r != LOST]
        group = dist.new_group(survivors)  # every rank creates every group
        if rank in survivors:
            counter = _Counter()
            counter.install()
            gc.collect()
            _malloc_trim()
            steady = rss_bytes()
            with PeakRss() as sampler:
                done = rebuild_slots(
                    buffer,
                    parity,
                    group,
                    my_slot=10 + rank,
                    bucket_bytes=BUCKET,
                    allocate=lambda slot, nbytes: spare[:nbytes],
                )
            result.update(
                steady=steady,
                peak=sampler.peak,
                sent=counter.sent,
                received=counter.received,
                objects=counter.objects,
                largest=counter.largest,
                calls=counter.calls,
                lost=done.lost,
                rebuilders={str(k): v for k, v in done.rebuilders.items()},
                senders=done.senders,
                own_traffic=[done.traffic.sent, done.traffic.received, done.traffic.largest],
                length=parity.length,
                rebuilt={
                    str(s): bool(np.array_equal(b, _slot_bytes(s - 10)))
                    for s, (_, b) in done.slots.items()
                },
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _needed_blocks(m: int, rebuilder: int) -> Dict[int, int]:
    """Blocks each member must send to rebuild member ``LOST`` on ``rebuilder`` (the
    rebuilder's own blocks first, then the lowest surviving members'), from the placement."""
    from megatron_mecefo.snapshot.erasure import placement

    sends: Dict[int, int] = {}
    for stripe in placement(N, m):
        if LOST not in stripe.data_members:
            continue
        holders = [x for x in stripe.data_members if x != LOST] + [
            x for x in stripe.parity_members if x != LOST
        ]
        chosen = sorted(holders, key=lambda x: (x != rebuilder, x))[: N - m]
        for x in chosen:
            if x != rebuilder:
                sends[x] = sends.get(x, 0) + 1
    return sends


@pytest.mark.parametrize("m", [1, 2])
def test_rebuild_moves_only_the_stripes_blocks(tmp_path: Path, m: int) -> None:
    if m >= 2:
        pytest.importorskip("zfec")
    import torch.multiprocessing as mp
    from conftest import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(free_port(), m, str(tmp_path)), nprocs=N, start_method="fork")
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)}
    rebuilder = LOST + 1  # the next intact member after the lost one
    sends = _needed_blocks(m, rebuilder)
    length = results[0]["length"]
    for r in (r for r in range(N) if r != LOST):
        res = results[r]
        assert res["lost"] == [10 + LOST] and res["rebuilders"] == {str(10 + LOST): 10 + rebuilder}
        assert res["objects"] < 64 * 1024, res  # only metadata travels pickled
        assert res["largest"] <= BUCKET, res
        assert [res["sent"], res["received"]] == res["own_traffic"][:2], res
        if r == rebuilder:
            assert res["rebuilt"] == {str(10 + LOST): True}, res
            assert res["sent"] == 0, res
            assert res["received"] == sum(sends.values()) * length, res
            assert res["calls"].get("irecv", 0) > sum(sends.values()), res  # in buckets
        else:
            assert res["rebuilt"] == {}, res
            assert res["received"] == 0, res
            assert res["sent"] == sends.get(r, 0) * length, res
        # Resident memory: no copy of the peers' slots, only bucket-sized buffers.
        assert res["peak"] <= 1.15 * res["steady"], (r, res["peak"] / res["steady"], res)
    bystanders = [r for r in range(N) if r not in (LOST, rebuilder) and r not in sends]
    assert sorted(results[rebuilder]["senders"]) == sorted(10 + r for r in sends)
    if m == 2:
        assert bystanders == [3]  # stripes 2 and 3 need one block each, both from member 0
    for r in bystanders:
        assert results[r]["sent"] == 0 and results[r]["received"] == 0, results[r]
