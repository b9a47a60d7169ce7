"""Rebuilding a lost snapshot slot by stripe (``parity.rebuild_slots``) at growing sizes.

For each data-parallel size ``dp`` and slot size ``S`` (MiB per rank), ``dp`` forked gloo
ranks on loopback each hold a slot of ``S`` random bytes and a spare slot of the same size
(resident, as the manager's other slots are), exchange its parity (``exchange_parity``, m
parity blocks per stripe), then member 1 dies and the survivors rebuild its slot over a group
of their own: the next member rebuilds it into its spare slot, the members whose blocks its
stripes need send them, the others (with m = 2) move nothing. Per rank and role (rebuilder,
sender, bystander): the rebuild's wall time, bytes sent and received, and resident memory
(VmRSS) at steady state before, its peak sampled by a thread every 0.5 ms during the
rebuild, and after. Also gloo's own point-to-point bandwidth on the same machine (rank 0 to
rank 1, the same message size), the ceiling of any transfer here.

At dp = 2 with m = 1 the survivor holds the lost slot's whole parity (its stripe's only other
block): the rebuild moves no bytes, it only copies and checks.

Usage::

    python benchmarks/snapshot_rebuild_scale.py            # results/snapshot_rebuild_scale.json
    python benchmarks/snapshot_rebuild_scale.py --quick    # 64 MiB only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_header import run_header  # noqa: E402

from megatron_mecefo.recovery.state.memory import PeakRss, release_unused, rss_bytes  # noqa: E402

MIB = 1 << 20
LOST = 1
TIMEOUT_S = 60


def allgather_rebuild(buffer: torch.Tensor, parity: Any, group: Any, my_slot: int) -> Dict:
    """The rebuild this replaced (``parity.rebuild_group`` before issue 53, item 5), kept here
    as the baseline: every survivor all-gathers every survivor's slot and parity blocks,
    packed into one buffer of a common size, and decodes the lost slots itself."""
    import torch.distributed as dist

    from megatron_mecefo.snapshot.erasure import GroupParity, crc, make_codec, rebuild

    n_old, m = len(parity.members), parity.m
    me = parity.members.index(my_slot)
    own = buffer[: parity.headers[me]["nbytes"]].numpy()
    size = dist.get_world_size(group)
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
    shards, blocks, crcs = {}, {}, {}
    for (slot, keys, their_crcs), their in zip(every, gathered, strict=True):
        idx = parity.members.index(int(slot))
        raw = their.numpy()
        data = raw[: int(parity.headers[idx]["nbytes"])]
        if crc(data) == parity.headers[idx]["crc32"]:
            shards[idx] = data
        for j, key in enumerate(keys):
            blocks[tuple(key)] = raw[top + j * length : top + (j + 1) * length]
        crcs.update(their_crcs)
    lost = [i for i in range(n_old) if i not in shards]
    codecs = {t: make_codec(n_old - m, m) for t in range(n_old)}
    nbytes = [int(h["nbytes"]) for h in parity.headers]
    gp = GroupParity(n_old, m, nbytes, parity.length, blocks, crcs, codecs)
    out = {parity.members[i]: data for i, data in shards.items()}
    for i, data in rebuild(gp, shards, lost).items():
        out[parity.members[i]] = data
    sent = packed.numel() * (size - 1)  # all_gather: this rank's buffer to every other
    return {"slots": out, "sent": sent, "received": sent, "largest": packed.numel()}


def _p2p_gbps(nbytes: int, bucket: int) -> float:
    """Rank 0 sends ``nbytes`` to rank 1 in messages of ``bucket`` (others idle): GB/s."""
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = torch.ones(bucket, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(nbytes // bucket):
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
    seconds = time.perf_counter() - t0
    dist.barrier()
    return nbytes / seconds / 1e9


def _worker(
    rank: int, port: int, dp: int, m: int, mib: int, bucket: int, old: bool, out: str
) -> None:
    import datetime
    import gc
    import zlib

    import torch.distributed as dist

    from megatron_mecefo.snapshot.parity import exchange_parity, rebuild_slots

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=dp, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    row: Dict[str, Any] = {"rank": rank}
    try:
        nbytes = mib * MIB
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        view = buffer.numpy()
        rng = np.random.default_rng(rank)
        for off in range(0, nbytes, 64 * MIB):  # random bytes, written in place
            size = min(64 * MIB, nbytes - off)
            view[off : off + size] = np.frombuffer(rng.bytes(size), dtype=np.uint8)
        header = {
            "iteration": 1,
            "rank": rank,
            "nbytes": nbytes,
            "crc32": zlib.crc32(memoryview(view)) & 0xFFFFFFFF,
            "entries": [["optim0.main.0.0", [nbytes], "uint8", 0, nbytes]],
            "meta": {},
        }
        t0 = time.perf_counter()
        parity = exchange_parity(buffer, header, m, dist.group.WORLD, my_slot=rank)
        row["exchange_s"] = time.perf_counter() - t0
        row["p2p_gbps"] = _p2p_gbps(min(nbytes, 256 * MIB), bucket)
        spare = torch.full((nbytes,), 1, dtype=torch.uint8)  # resident, like a written slot
        survivors = [r for r in range(dp) if r != LOST]
        group = dist.new_group(survivors)
        if rank in survivors:
            gc.collect()
            release_unused()
            row["steady"] = rss_bytes()
            dist.barrier(group=group)
            t0 = time.perf_counter()
            with PeakRss() as sampler:
                if old:
                    done: Any = allgather_rebuild(buffer, parity, group, my_slot=rank)
                else:
                    done = rebuild_slots(
                        buffer,
                        parity,
                        group,
                        my_slot=rank,
                        bucket_bytes=bucket,
                        allocate=lambda slot, n: spare[:n],
                    )
            row["seconds"] = time.perf_counter() - t0
            row["peak"] = sampler.peak
            row["after"] = rss_bytes()
            if old:
                got = done["slots"][LOST]
                row["sent"], row["received"] = done["sent"], done["received"]
                row["messages"], row["largest"] = 1, done["largest"]
                # Every survivor decodes; the one rebuild_slots would pick is the "rebuilder".
                rebuilder = next((r for r in survivors if r > LOST), survivors[0])
                senders = [r for r in survivors if r != rebuilder]
            else:
                got = done.slots[LOST][1] if LOST in done.slots else None
                row["sent"], row["received"] = done.traffic.sent, done.traffic.received
                row["messages"], row["largest"] = done.traffic.ops, done.traffic.largest
                rebuilder, senders = done.rebuilders[LOST], done.senders
            row["role"] = (
                "rebuilder" if rank == rebuilder else "sender" if rank in senders else "bystander"
            )
            if old:
                del done
            gc.collect()
            release_unused()  # what glibc kept in its arenas, not a leak, comes back
            row["after_trim"] = rss_bytes()
            if rank == rebuilder:
                expected = np.random.default_rng(LOST)
                ok = True
                for off in range(0, nbytes, 64 * MIB):
                    size = min(64 * MIB, nbytes - off)
                    want = np.frombuffer(expected.bytes(size), dtype=np.uint8)
                    ok &= bool(np.array_equal(got[off : off + size], want))
                row["rebuilt_equal"] = ok
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(row))


def run_point(dp: int, m: int, mib: int, bucket: int, old: bool = False) -> Dict[str, Any]:
    """One (dp, m, size) point: per-rank rows and the rebuild's wall time (slowest rank);
    ``old``: the all-gather baseline instead of the rebuild by stripe."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker, args=(port, dp, m, mib, bucket, old, out), nprocs=dp, start_method="fork"
        )
        rows = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(dp)]
    survivors = [r for r in rows if "seconds" in r]
    seconds = max(r["seconds"] for r in survivors)
    roles: Dict[str, List[Dict[str, Any]]] = {}
    for r in survivors:
        roles.setdefault(r["role"], []).append(
            {
                "rank": r["rank"],
                "steady_mib": round(r["steady"] / MIB, 1),
                "peak_mib": round(r["peak"] / MIB, 1),
                "after_mib": round(r["after"] / MIB, 1),
                "after_trim_mib": round(r["after_trim"] / MIB, 1),
                "peak_over_steady": round(r["peak"] / r["steady"], 4),
                "sent_mib": round(r["sent"] / MIB, 2),
                "received_mib": round(r["received"] / MIB, 2),
                "messages": r["messages"],
                "largest_message_mib": round(r["largest"] / MIB, 2),
            }
        )
    rebuilder = next(r for r in survivors if r["role"] == "rebuilder")
    return {
        "path": "allgather (old)" if old else "by stripe",
        "dp": dp,
        "m": m,
        "slot_mib": mib,
        "rebuild_s": round(seconds, 4),
        "rebuild_gbps": round(mib * MIB / seconds / 1e9, 3),
        "received_gbps": round(rebuilder["received"] / seconds / 1e9, 3),
        "p2p_gbps": round(rows[0]["p2p_gbps"], 3),
        "exchange_parity_s": round(max(r["exchange_s"] for r in rows), 3),
        "rebuilt_equal": rebuilder["rebuilt_equal"],
        "max_peak_over_steady": max(x["peak_over_steady"] for role in roles.values() for x in role),
        "roles": roles,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB points only")
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--no-baseline", action="store_true", help="skip the old all-gather")
    default_out = Path(__file__).resolve().parents[1] / "results" / "snapshot_rebuild_scale.json"
    parser.add_argument("--out", default=str(default_out))
    args = parser.parse_args()
    sizes = [64] if args.quick else [64, 256, 1024]
    points = [(2, 1, s, False) for s in sizes] + [(4, 1, s, False) for s in sizes]
    points += [(4, 2, s, False) for s in sizes if s <= 256]  # m = 2: a bystander; zfec is slower
    # The old all-gather path as the baseline, up to 256 MiB (at 1 GiB and dp = 4 its gathered
    # copies, about 5 GiB per rank, do not fit this machine's memory three times over).
    points += [(dp, m, s, True) for dp, m, s, _ in points if s <= 256 and not args.no_baseline]
    bucket = args.bucket_mib * MIB
    result = run_header("snapshot_rebuild_scale")
    result["config"] = {
        "backend": "gloo over loopback (127.0.0.1), forked processes, one machine",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "lost_member": LOST,
        "scenario": (
            "member 1 dies after the parity exchange; the survivors rebuild its slot over a "
            "group of their own, on the next member (rebuild_slots' default), into a spare "
            "slot allocated and written before the steady-state RSS is read"
        ),
        "bucket_bytes": bucket,
        "collective_timeout_s": TIMEOUT_S,
        "rss": "VmRSS: steady = before (after gc and malloc_trim), peak = sampled every "
        "0.5 ms during the rebuild, after = right after it returns, after_trim = after "
        "malloc_trim(0)",
        "gbps": "rebuild_gbps = slot bytes / slowest survivor's rebuild seconds; "
        "received_gbps = bytes the rebuilder received / that time; p2p_gbps = rank 0 to 1 "
        "send/recv in bucket-sized messages",
        "points": "[dp, m, slot MiB, old all-gather baseline]: "
        + json.dumps([list(p) for p in points]),
    }
    result["rows"] = []
    t0 = time.perf_counter()
    for dp, m, mib, old in points:
        row = run_point(dp, m, mib, bucket, old)
        result["rows"].append(row)
        print(
            f"{row['path']:>15} dp={dp} m={m} {mib:5d} MiB: rebuild {row['rebuild_s']:.3f} s "
            f"({row['rebuild_gbps']:.2f} GB/s of slot, rebuilder received "
            f"{row['received_gbps']:.2f} GB/s; gloo p2p {row['p2p_gbps']:.2f} GB/s), "
            f"peak/steady <= {row['max_peak_over_steady']:.3f}, equal={row['rebuilt_equal']}",
            flush=True,
        )
    result["total_s"] = round(time.perf_counter() - t0, 1)
    rows = [r for r in result["rows"] if r["path"] == "by stripe"]
    worst = max(r["max_peak_over_steady"] for r in rows)
    big = max(rows, key=lambda r: (r["slot_mib"], r["dp"]))
    largest = max(
        x["largest_message_mib"] for r in rows for role in r["roles"].values() for x in role
    )
    before = [r for r in result["rows"] if r["path"] != "by stripe"]
    versus = ""
    if before:
        worst_old = max(r["max_peak_over_steady"] for r in before)
        versus = f" (old all-gather path: up to {worst_old:.2f}x)"
    result["summary"] = (
        f"rebuild by stripe, {len(rows)} points up to {big['slot_mib']} MiB/rank: "
        f"dp={big['dp']} m={big['m']} {big['slot_mib']} MiB in {big['rebuild_s']:.2f} s "
        f"({big['rebuild_gbps']:.2f} GB/s); peak RSS <= {worst:.3f}x steady on every rank{versus}; "
        f"largest message {largest} MiB (bucket {bucket // MIB} MiB); every rebuilt slot equal: "
        f"{all(r['rebuilt_equal'] for r in rows)}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(result["summary"])


if __name__ == "__main__":
    main()
