"""Recovery time against state size, per recovery path (``snapshot_overhead.py --parts
recovery_size``).

Four forked gloo ranks on this machine, each with ``S`` MiB of fp32 state (a weight and its two
Adam moments, as ``memory_vs_disk``), for each ``S`` in ``--recovery-mib``:

* **local**: rank 0 alone restores its newest committed snapshot from its slot in
  ``/dev/shm`` (a fresh ``SnapshotManager.restore``: agreement, CRC-32 of the slot, copy into
  the live tensors): a trainer restarted on a node whose holder is alive.
* **whole job from holders**: the same restore on all 4 ranks at once (the slowest rank's
  time): every trainer died, the holders kept the slots.
* **peers+parity m=1 / m=2**: the 4 ranks exchange the snapshot's parity
  (``parity.exchange_parity``: XOR for m = 1, zfec for m = 2), then m ranks are lost and the
  survivors run ``parity.rebuild_group`` over their own group (gather of the slots, decode,
  CRC-32 of every rebuilt slot) and restore their own slot into the live tensors (the slowest
  survivor's time). Not included: re-sharding the distributed optimizer's state over the
  survivors (``contents.reshard``, one pass over the gathered shards) and the regroup itself.
* **disk**: ``dist_checkpointing.load`` (torch_dist) on all 4 ranks of the same tensors, saved
  as one sharded checkpoint (each rank its shard), and the copy into the live tensors (the
  slowest rank's time). The files were just written and fsync'ed, so they come from the page
  cache: the best case for disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

RANKS = 4


def adam_state(mib: int, seed: int) -> tuple:
    """A ``TrainingState`` of about ``mib`` MiB (one weight and its two Adam moments, after
    one step) and its tensors by name."""
    from megatron_mecefo.snapshot.contents import TrainingState

    torch.manual_seed(seed)
    n = (mib << 20) // 4 // 3  # params + two Adam moments
    model = torch.nn.Linear(n // 1024, 1024, bias=False)

    class Wrapped:
        optimizer = torch.optim.Adam(model.parameters())

    model(torch.ones(1, n // 1024)).sum().backward()
    Wrapped.optimizer.step()
    state = TrainingState([model], Wrapped(), None, {"iteration": 1})
    tensors = {"w": model.weight.data}
    tensors.update({k: v for k, v in Wrapped.optimizer.state[model.weight].items() if v.dim()})
    return state, tensors


def _slowest(seconds: float, group: Any = None) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _sharded(tensors: Dict[str, torch.Tensor], rank: int) -> Dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, v, (0, rank, RANKS)) for k, v in tensors.items()}


def _worker(
    rank: int, sizes: List[int], shm_base: str, disk_base: str, port: int, out: str
) -> None:
    """One rank: every path at every size (module docstring); rank 0 writes the rows."""
    import json

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_mecefo.runtime import enable_cpu_runtime
    from megatron_mecefo.snapshot.config import SnapshotConfig
    from megatron_mecefo.snapshot.contents import restore
    from megatron_mecefo.snapshot.manager import SnapshotManager
    from megatron_mecefo.snapshot.parity import exchange_parity, read_tensors, rebuild_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, RANKS, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=RANKS)
    enable_cpu_runtime()  # dist_checkpointing's writer calls torch.cuda.synchronize()
    world = dist.group.WORLD
    solo = dist.new_group([0])
    survivors = {m: dist.new_group(list(range(RANKS - m))) for m in (1, 2)}
    rows: List[Dict[str, Any]] = []

    def row(mib: float, path: str, seconds: float, ranks: int, **extra: Any) -> None:
        rows.append({"state_mib_per_rank": mib, "path": path, "seconds": seconds,
                     "ranks": ranks, **extra})  # fmt: skip
        if rank == 0:
            print(f"  recovery_size: {mib:.0f} MiB/rank {path}: {seconds:.3f} s", flush=True)

    for mib in sizes:
        state, tensors = adam_state(mib, seed=rank)
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
        real_mib = nbytes / 2**20
        shm = os.path.join(shm_base, f"shm{mib}")  # the slots in /dev/shm, as a holder's
        config = SnapshotConfig(1, shm)
        manager = SnapshotManager(config, rank, RANKS, store=store)
        manager.take(state, 1)
        manager.flush()
        dist.barrier()
        # local: rank 0 alone (a restarted trainer, its holder alive)
        if rank == 0:
            t0 = time.perf_counter()
            SnapshotManager(config, 0, 1, store=store).restore(state, group=solo)
            row(real_mib, "local (1 rank)", time.perf_counter() - t0, 1)
        dist.barrier()
        # whole job from holders: every rank at once
        t0 = time.perf_counter()
        SnapshotManager(config, rank, RANKS, store=store).restore(state, group=world)
        row(real_mib, "whole job from holders (4 ranks at once)",
            _slowest(time.perf_counter() - t0), RANKS)  # fmt: skip
        # peers+parity: exchange, lose m ranks, rebuild on the survivors
        slot = manager.local_snapshots(verify=False)[1][0]
        header = slot.header()
        for m in (1, 2):
            t0 = time.perf_counter()
            parity = exchange_parity(slot.buffer, header, m, world, rank)
            exchange_s = _slowest(time.perf_counter() - t0)
            if rank < RANKS - m:
                group = survivors[m]
                dist.barrier(group=group)
                t0 = time.perf_counter()
                shards = rebuild_group(slot.buffer, parity, group, rank)
                rebuild_s = time.perf_counter() - t0
                own_header, own = shards[rank]
                restore(state, read_tensors(own_header, own), own_header["meta"])
                total = _slowest(time.perf_counter() - t0, group)
                rebuild_s = _slowest(rebuild_s, group)
                lost = sorted(set(range(RANKS)) - set(range(RANKS - m)))
                assert all(s in shards for s in lost)
                row(real_mib, f"peers+parity m={m} ({m} lost)", total, RANKS - m,
                    rebuild_s=rebuild_s, parity_exchange_s=exchange_s)  # fmt: skip
                del shards
            dist.barrier()
        # disk: dist_checkpointing load of the same tensors (one sharded checkpoint)
        ckpt = os.path.join(disk_base, f"ckpt{mib}")
        if rank == 0:
            os.makedirs(ckpt)
        dist.barrier()

        t0 = time.perf_counter()
        dist_checkpointing.save(_sharded(tensors, rank), ckpt)
        dist.barrier()
        if rank == 0:  # its files on disk (not os.sync(): other users' writes would count)
            for name in os.listdir(ckpt):
                fd = os.open(os.path.join(ckpt, name), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        save_s = _slowest(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        loaded = dist_checkpointing.load(_sharded(tensors, rank), ckpt)
        with torch.no_grad():
            for k, v in tensors.items():
                v.copy_(loaded[k])
        row(real_mib, "disk (dist_checkpointing load, 4 ranks)",
            _slowest(time.perf_counter() - t0), RANKS, save_s=save_s)  # fmt: skip
        del loaded, state, tensors, manager, slot, parity
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def recovery_size(sizes: List[int], results_dir: Path) -> Dict[str, Any]:
    """Run :func:`_worker` on 4 forked ranks; returns the rows (module docstring)."""
    import json
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = tempfile.mkdtemp(prefix="mecefo-bench-recovery-", dir="/dev/shm")
    disk = tempfile.mkdtemp(dir=str(results_dir))
    out = os.path.join(disk, "rows.json")
    ctx = mp.get_context("fork")
    procs = []
    try:
        for rank in range(RANKS):
            p = ctx.Process(target=_run_rank, args=(rank, sizes, base, disk, port, out))
            p.start()
            procs.append(p)
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"recovery_size: ranks exited {[p.exitcode for p in procs]}")
        with open(out) as f:
            rows = json.load(f)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    return {"sizes_mib": sizes, "ranks": RANKS, "rows": rows}


def _run_rank(rank: int, sizes: List[int], shm: str, disk: str, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    _worker(rank, sizes, shm, disk, port, out)


def summary(result: Dict[str, Any]) -> str:
    by: Dict[str, List[str]] = {}
    for r in result["rows"]:
        by.setdefault(r["path"].split(" (")[0], []).append(
            f"{r['state_mib_per_rank']:.0f}:{r['seconds']:.2f}"
        )
    return "recovery s by MiB/rank: " + ", ".join(f"{k} {' '.join(v)}" for k, v in by.items())
