"""Parity exchange over a real gloo group and rebuilding lost slots (``snapshot.parity``).

Four spawned ranks (torch only, no megatron-core: a few seconds) each hold a slot of random
bytes of a different length. After ``exchange_parity`` the survivors of a group rebuild the
lost members' slots bit for bit; one member too many lost, or a corrupt survivor, gives
``SnapshotLost`` with the documented message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_mecefo.snapshot.erasure import piece_length

N = 4


def _slot_bytes(rank: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    return rng.integers(0, 256, size=5000 + 333 * rank, dtype=np.uint8)


def _header(rank: int, data: np.ndarray) -> dict:
    import zlib

    return {
        "iteration": 7,
        "rank": rank,
        "nbytes": int(data.size),
        "crc32": zlib.crc32(memoryview(data)) & 0xFFFFFFFF,
        "entries": [["optim0.main.0.0", [data.size], "uint8", 0, int(data.size)]],
        "meta": {},
    }


def _worker(rank: int, port: int, m: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    from megatron_mecefo.snapshot.erasure import SnapshotLost
    from megatron_mecefo.snapshot.parity import exchange_parity, rebuild_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=N, timeout=datetime.timedelta(seconds=60))
    result: dict = {}
    try:
        data = _slot_bytes(rank)
        buffer = torch.zeros(data.size + 64, dtype=torch.uint8)
        buffer[: data.size] = torch.from_numpy(data)
        header = _header(rank, data)
        parity = exchange_parity(buffer, header, m, dist.group.WORLD, my_slot=10 + rank)
        result["members"] = parity.members
        result["parity_bytes"] = parity.nbytes
        scenarios = {
            "lose_m": [r for r in range(N) if r not in range(1, 1 + m)],
            "lose_m_plus_1": [r for r in range(N) if r not in range(1, 2 + m)],
        }
        for name, survivors in scenarios.items():
            group = dist.new_group(survivors)  # every rank creates every group
            if rank not in survivors:
                continue
            try:
                slots = rebuild_group(buffer, parity, group, my_slot=10 + rank)
                result[name] = {
                    str(s): bool(np.array_equal(data_s, _slot_bytes(s - 10)))
                    for s, (_, data_s) in slots.items()
                }
            except SnapshotLost as err:
                result[name] = {"lost": str(err)}
        # A corrupt survivor (one flipped byte) counts as lost: with m lost already, too many.
        group = dist.new_group(scenarios["lose_m"])
        if rank in scenarios["lose_m"]:
            if rank == scenarios["lose_m"][-1]:
                buffer[17] ^= 0xFF
            try:
                rebuild_group(buffer, parity, group, my_slot=10 + rank)
                result["corrupt"] = "rebuilt"
            except SnapshotLost as err:
                result["corrupt"] = str(err)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize("m", [1, 2])
def test_parity_rebuilds_lost_members_over_gloo(tmp_path: Path, m: int) -> None:
    if m >= 2:
        pytest.importorskip("zfec")
    import torch.multiprocessing as mp
    from conftest import free_port

    # fork: the children inherit the imported torch (spawn re-imports it: ~25 s on 2 cores).
    mp.start_processes(_worker, args=(free_port(), m, str(tmp_path)), nprocs=N, start_method="fork")
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)}
    for r, res in results.items():
        assert res["members"] == [10, 11, 12, 13]
        # Each member holds m parity blocks of |largest slot| / (N - m) bytes, rounded up to 64.
        assert res["parity_bytes"] == m * piece_length(_slot_bytes(3).size, N, m)
        survivors = [x for x in range(N) if x not in range(1, 1 + m)]
        if r in survivors:
            # Every member's slot, the lost ones rebuilt, equal to the original bytes.
            assert res["lose_m"] == {str(10 + x): True for x in range(N)}, res
            assert "cannot be rebuilt" in res["corrupt"], res["corrupt"]
        if r not in range(1, 2 + m):  # a survivor of m + 1 losses
            lost = res["lose_m_plus_1"]["lost"]
            assert "cannot be rebuilt; falling back to the disk checkpoint" in lost, lost
