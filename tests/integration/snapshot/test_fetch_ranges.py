"""``parity.fetch_ranges`` (the takeover's re-sharding reads only what overlaps its new shard)
over four forked gloo ranks: each range arrives intact from its holder, in messages no larger
than the bucket; a rank that holds nothing wanted and wants nothing remote moves no bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

N = 4
BUCKET = 1000
# (requester) -> ranges (slot, offset, nbytes); slot s is held by rank s % 3 (rank 3 holds
# none). Rank 3 wants nothing; rank 0 wants one of its own ranges (a view) and remote ones.
WANTS = {
    0: [(10, 5, 300), (11, 0, 4500), (12, 4000, 1001)],
    1: [(10, 100, 2500), (12, 7, 1)],
    2: [(11, 3333, 10)],
    3: [],
}


def _slot(slot: int) -> np.ndarray:
    return np.random.default_rng(slot).integers(0, 256, size=6000, dtype=np.uint8)


def _worker(rank: int, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    from megatron_mecefo.snapshot.parity import Traffic, fetch_ranges

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=N, timeout=datetime.timedelta(seconds=60))
    try:
        holders = {10: 0, 11: 1, 12: 2}
        local = {s: _slot(s) for s, r in holders.items() if r == rank}
        traffic = Traffic()
        got = fetch_ranges(local, holders, WANTS[rank], dist.group.WORLD, BUCKET, traffic)
        result = {
            "equal": [
                bool(np.array_equal(got[w], _slot(w[0])[w[1] : w[1] + w[2]])) for w in WANTS[rank]
            ],
            "keys": sorted(map(list, got)),
            "sent": traffic.sent,
            "received": traffic.received,
            "largest": traffic.largest,
        }
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_fetch_ranges_moves_only_the_wanted_bytes(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from conftest import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=N, start_method="fork")
    res = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)}
    holders = {10: 0, 11: 1, 12: 2}
    for r in range(N):
        assert all(res[r]["equal"]) and len(res[r]["equal"]) == len(WANTS[r]), res[r]
        assert res[r]["keys"] == sorted(map(list, WANTS[r]))
        remote_in = sum(n for s, _, n in WANTS[r] if holders[s] != r)
        remote_out = sum(
            n for q, ws in WANTS.items() for s, _, n in ws if holders[s] == r and q != r
        )
        assert res[r]["received"] == remote_in and res[r]["sent"] == remote_out, res[r]
        assert res[r]["largest"] <= BUCKET
    assert res[3]["sent"] == res[3]["received"] == 0
