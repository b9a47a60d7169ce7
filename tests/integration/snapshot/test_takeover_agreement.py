"""``SnapshotManager.takeover`` decides for the whole world: when one data-parallel group
cannot rebuild its snapshot, every rank gets ``SnapshotLost`` before any rank writes its state
(the disk fallback then runs on every rank alike, never a rank alone in a collective).

Four forked gloo ranks (torch only) in two data-parallel groups {0, 1} and {2, 3}, m = 1: both
members of group {0, 1} have a corrupt slot (two lost, more than m); group {2, 3} is intact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

N = 4


class _Part:
    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner


def _worker(rank: int, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    from megatron_mecefo.snapshot.config import SnapshotConfig
    from megatron_mecefo.snapshot.contents import TrainingState
    from megatron_mecefo.snapshot.erasure import SnapshotLost
    from megatron_mecefo.snapshot.manager import SnapshotManager

    store = dist.TCPStore("127.0.0.1", port, N, rank == 0)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=N, timeout=datetime.timedelta(seconds=60)
    )
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    result: dict = {}
    try:
        torch.manual_seed(rank // 2)
        model = torch.nn.Linear(16, 8)
        adam = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 16)).sum().backward()
        adam.step()
        state = TrainingState([model], _Part(adam), None, {"iteration": 1})
        manager = SnapshotManager(
            SnapshotConfig(1, None, 1), rank, N, store=store, parity_group=lambda: mine
        )
        manager.take(state, 1)
        manager.flush()  # the parity exchange of group {0, 1} / {2, 3}, and the commit
        slot = manager.parity_snapshots()[1]
        if rank < 2:
            slot.buffer[3] ^= 0xFF  # its checksum fails: counts as lost
        with torch.no_grad():
            model.weight.add_(1.0)  # a restore would put the snapshot's weights back
        moved = model.weight.detach().clone()
        try:
            manager.takeover(state, mine)
            result["outcome"] = "served"
        except SnapshotLost as err:
            result["outcome"] = str(err)
        except Exception as err:  # noqa: BLE001 (any other outcome fails the test)
            result["outcome"] = f"{type(err).__name__}: {err}"
        result["state_untouched"] = bool(torch.equal(model.weight, moved))
        dist.barrier()  # every rank left the takeover: nobody waits in a collective
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_one_group_lost_stops_every_group_before_any_restore(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from conftest import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=N, start_method="fork")
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)}
    for r in (0, 1):  # the group that lost two members
        assert "2 members of a group of 2 peers lost or corrupt" in results[r]["outcome"], results
    for r in (2, 3):  # intact, but told by the world's verdict
        assert "another data-parallel group lost" in results[r]["outcome"], results
    assert all(res["state_untouched"] for res in results.values()), results
