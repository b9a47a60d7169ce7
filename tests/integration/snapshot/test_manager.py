"""``SnapshotManager`` over 4 forked gloo ranks and a real TCPStore (torch only, no Megatron).

* The slot rule: with 3 slots a rank takes snapshot s+1 while a peer has not committed s
  (no per-snapshot barrier), and the newest snapshot every rank committed is held intact on
  every rank after every ``take``; with 2 slots the same schedule waits for that peer and
  fails with the commit timeout instead of overwriting.
* The parity exchanged by the background worker (over its own clone of the group) equals,
  byte for byte, the parity ``exchange_parity`` computes synchronously on the training thread
  for the same slots; ``abandon()`` returns at once while the worker is blocked in a
  collective whose peer never comes, and the worker ends when that peer destroys its groups.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

N = 4


class Wrapped:
    """The shape of a Megatron optimizer that ``contents`` reads: ``.optimizer`` inside."""

    def __init__(self, params) -> None:
        self.optimizer = torch.optim.Adam(params, lr=1e-2)


def _model(rank: int):
    torch.manual_seed(100 + rank)  # every rank a different shard, as under the dist. optimizer
    model = torch.nn.Sequential(torch.nn.Linear(48 + 8 * rank, 40), torch.nn.Linear(40, 24))
    return model, Wrapped(model.parameters())


def _step(model, opt) -> None:
    model(torch.ones(3, model[0].in_features)).square().mean().backward()
    opt.optimizer.step()
    opt.optimizer.zero_grad()


def _init(rank: int, port: int):
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=N, timeout=datetime.timedelta(seconds=30))
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _held_intact(manager) -> set:
    return set(manager.local_snapshots(verify=True))


def _slot_rule_worker(rank: int, port: int, slots: int, out: str) -> None:
    import torch.distributed as dist

    from megatron_mecefo.snapshot.config import SnapshotConfig
    from megatron_mecefo.snapshot.contents import TrainingState
    from megatron_mecefo.snapshot.manager import SnapshotManager

    store = _init(rank, port)
    model, opt = _model(rank)
    config = SnapshotConfig(interval=1, slots=slots, commit_timeout_s=3.0)
    manager = SnapshotManager(config, rank, world_size=N, store=store)
    result: dict = {"overtook": [], "invariant": [], "error": None}

    def newest_everywhere(upto: int):
        done = [i for i in range(1, upto + 1) if manager.commits(i) == N]
        return max(done) if done else None

    try:
        for it in range(1, 8):
            manager.before_optimizer_step()  # CPU: joins the copy and commits it
            _step(model, opt)
            if rank == N - 1 and 3 <= it < 7:
                # The slow rank: snapshot ``it`` only after rank 0 has taken ``it + 1``.
                while store.add(f"taken{it + 1}", 0) == 0:
                    if store.add("failed", 0):
                        raise RuntimeError("a peer failed")
                    time.sleep(0.005)
            manager.take(TrainingState([model], opt, None, {"iteration": it}), it)
            if rank == 0:
                # Rank 0 started ``it`` although the slow rank has not committed ``it - 1``.
                result["overtook"].append([it, manager.commits(it - 1)])
                store.add(f"taken{it}", 1)
            manager.copier.join()
            last = newest_everywhere(it)
            result["invariant"].append([it, last, sorted(_held_intact(manager))])
        manager.flush()
    except RuntimeError as err:
        result["error"] = str(err)
        store.add("failed", 1)  # the slow rank stops waiting
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    store.add("finished", 1)
    while rank == 0 and store.add("finished", 0) < N:  # rank 0 serves the store: last out
        time.sleep(0.01)
    dist.destroy_process_group()


def _spawn(fn, *args) -> None:
    import torch.multiprocessing as mp

    # The first Adam imports torch's lazy modules (seconds): once here, not in every child.
    _model(0)
    # fork: the children inherit the imported torch (spawn re-imports it: ~25 s on 2 cores).
    mp.start_processes(fn, args=args, nprocs=N, start_method="fork")


def test_third_slot_removes_the_barrier_and_keeps_the_newest_committed(tmp_path: Path) -> None:
    from conftest import free_port

    _spawn(_slot_rule_worker, free_port(), 3, str(tmp_path))
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)}
    for r, res in results.items():
        assert res["error"] is None, res
        for it, last, intact in res["invariant"]:
            if last is not None:  # never overwritten, never corrupt
                assert last in intact, (r, it, last, intact)
    # From iteration 4 on rank 0 took ``it`` before the slow rank committed ``it - 1``.
    overtook = {it: count for it, count in results[0]["overtook"]}
    assert all(overtook[it] < N for it in range(4, 8)), overtook


def test_two_slots_wait_for_the_previous_commit_instead_of_overwriting(tmp_path: Path) -> None:
    from conftest import free_port

    _spawn(_slot_rule_worker, free_port(), 2, str(tmp_path))
    res = json.loads((tmp_path / "rank0.json").read_text())
    # Rank 0's take of 4 must wait for 3, which the slow rank commits only after that take.
    assert res["error"] is not None and "snapshot of iteration 3: only 3 of 4" in res["error"]
    for it, last, intact in res["invariant"]:
        if last is not None:
            assert last in intact, (it, last, intact)


def _parity_worker(rank: int, port: int, m: int, out: str) -> None:
    import gc

    import torch.distributed as dist

    from megatron_mecefo.snapshot.config import SnapshotConfig
    from megatron_mecefo.snapshot.contents import TrainingState
    from megatron_mecefo.snapshot.manager import SnapshotManager
    from megatron_mecefo.snapshot.parity import exchange_parity

    store = _init(rank, port)
    dp = dist.new_group(list(range(N)))
    model, opt = _model(rank)
    config = SnapshotConfig(interval=1, redundancy=m)
    manager = SnapshotManager(
        config, rank, world_size=N, store=store, parity_group=lambda: dp, slot_id=20 + rank
    )
    manager.prepare()
    result: dict = {}
    for it in range(1, 6):
        manager.before_optimizer_step()
        _step(model, opt)
        manager.take(TrainingState([model], opt, None, {"iteration": it}), it)
    manager.flush()
    held = manager.parity_snapshots()
    result["held"] = sorted(held)
    result["equal"] = {}
    for it, slot in sorted(held.items()):  # the same slots, synchronously, on this thread
        ref = exchange_parity(slot.buffer, slot.header(), m, dp, 20 + rank)
        bg = slot.parity
        same = (
            bg.members == ref.members
            and bg.headers == ref.headers
            and bg.crcs == ref.crcs
            and sorted(bg.blocks) == sorted(ref.blocks)
            and all(np.array_equal(bg.blocks[k], ref.blocks[k]) for k in ref.blocks)
        )
        result["equal"][str(it)] = bool(same)
        result["parity_bytes"] = int(bg.nbytes)
    # A world that fails while the worker is in a collective: rank N-1 never submits 6.
    manager.before_optimizer_step()
    _step(model, opt)
    if rank < N - 1:
        manager.take(TrainingState([model], opt, None, {"iteration": 6}), 6)
        manager.copier.join()
        manager._finish_local()  # handed to the worker, which waits for rank N-1
        worker = manager._worker
        time.sleep(0.3)
        t0 = time.perf_counter()
        manager.abandon()
        result["abandon_s"] = time.perf_counter() - t0
        result["after_abandon"] = sorted(manager.parity_snapshots())
        store.add("abandoned", 1)
        del dp
        dist.destroy_process_group()  # as the recovery session's leave(): drop the groups
        gc.collect()
        t0 = time.perf_counter()
        result["worker_ended"] = worker.join(timeout=25)
        result["worker_end_s"] = time.perf_counter() - t0
    else:
        while store.add("abandoned", 0) < N - 1:
            time.sleep(0.01)
        manager.abandon()
        del dp
        dist.destroy_process_group()  # its sockets close: the peers' workers fail and end
        gc.collect()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize("m", [1, 2])
def test_background_parity_equals_synchronous_parity(tmp_path: Path, m: int) -> None:
    if m >= 2:
        pytest.importorskip("zfec")
    from conftest import free_port

    _spawn(_parity_worker, free_port(), m, str(tmp_path))
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)}
    for r, res in results.items():
        # 3 slots at K = 1: snapshots 3, 4, 5 held, each with its parity, equal bit for bit.
        assert res["held"] == [3, 4, 5], res
        assert res["equal"] == {"3": True, "4": True, "5": True}, res
        assert res["parity_bytes"] > 0
        if r < N - 1:
            assert res["abandon_s"] < 1.0, res  # never waits for the blocked worker
            assert 6 not in res["after_abandon"], res  # no parity: never used by a takeover
            assert res["worker_ended"], res
