"""In-memory snapshots: step overhead, erasure-code throughput, memory vs disk checkpoints.

Three parts, each measured side by side in one run of this script:

1. ``step``: the demo's model and layout (PP2 x DP4, 8 gloo ranks, ``make demo``'s flags
   without failures) trained ``--iters`` iterations with no snapshots, a snapshot every 10
   and every iteration (slots in a holder's /dev/shm directory), round-robin ``--repeats``
   times. Reported: median step time (iterations 3+) and the seconds per step the training
   thread spent in snapshot code (``snapshot_s`` in the metrics: fences, commits, starting
   copies), the direct measure of the overhead.
2. ``ec``: encode / decode throughput at ``--ec-mib`` MiB of data, k = 4, one thread: XOR in
   torch (m = 1), pyeclib ``isa_l_rs_vand`` / ``liberasurecode_rs_vand`` and zfec (m = 1, 2);
   MB/s of data = bytes / CPU time (``process_time``; wall time beside it), best of 3, every
   decode checked byte for byte. Plus CRC-32 and a plain copy at the same size.
3. ``memory_vs_disk``: one process, ``--state-mib`` MiB of fp32 tensors: a snapshot to a
   holder's shared memory (copy + CRC + commit) and its restore, against megatron-core
   ``dist_checkpointing.save`` / ``load`` (torch_dist) of the same tensors to disk.
4. ``recovery_size`` (not in the default parts): recovery time against state size
   (``--recovery-mib``, per rank) for each path: local, whole job from holders, peers+parity
   (m = 1 and 2) and disk, over 4 forked gloo ranks (``benchmarks/snapshot_recovery.py``).

Usage (repo root): ``.venv/bin/python benchmarks/snapshot_overhead.py [--parts step ec
memory_vs_disk]``. Writes ``results/snapshot_overhead.json`` and prints one summary line.
"""

# ruff: noqa: B023 (each timed lambda runs inside the loop iteration that defines it)
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

TRAINER = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt.py"
DEMO = [
    "--pipeline-model-parallel-size", "2", "--split", "98,2,0", "--num-layers", "4",
    "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "3e-3",
    "--min-lr", "3e-4", "--lr-warmup-iters", "10", "--log-interval", "10", "--eval-iters", "0",
]  # fmt: skip


def _timed(fn: Callable[[], Any]) -> Tuple[float, float, Any]:
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - w0, out


def _best(fn: Callable[[], Any], repeats: int = 3) -> Tuple[float, float, Any]:
    runs = [_timed(fn) for _ in range(repeats)]
    cpu = min(r[0] for r in runs)
    wall = min(r[1] for r in runs)
    return cpu, wall, runs[-1][2]


# ---------------------------------------------------------------------- 1. step overhead
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _holder(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_mecefo.snapshot.holder", "--dir", str(directory)],
        start_new_session=True,
    )
    while not (directory / "holder.pid").exists():
        time.sleep(0.05)
    return proc


# name -> (extra trainer flags, snapshot interval or None); "dist-opt": the distributed
# optimizer with m = 1 parity, as ``make demo-snapshot``; "2 slots": the previous rule (a
# barrier on the previous snapshot's commit at every snapshot).
STEP_VARIANTS: Dict[str, Tuple[List[str], Any]] = {
    "none": ([], None),
    "every 10": ([], 10),
    "every 1": ([], 1),
    "none, dist-opt": (["--use-distributed-optimizer"], None),
    "every 10, dist-opt m=1": (
        ["--use-distributed-optimizer", "--mecefo-snapshot-redundancy", "1"],
        10,
    ),
    "every 1, dist-opt m=1": (
        ["--use-distributed-optimizer", "--mecefo-snapshot-redundancy", "1"],
        1,
    ),
    "every 1, dist-opt m=1, 4 slots": (
        ["--use-distributed-optimizer", "--mecefo-snapshot-redundancy", "1"]
        + ["--mecefo-snapshot-slots", "4"],
        1,
    ),
    "every 1, dist-opt m=1, 2 slots": (
        ["--use-distributed-optimizer", "--mecefo-snapshot-redundancy", "1"]
        + ["--mecefo-snapshot-slots", "2"],
        1,
    ),
}


def _per_step(train: List[Dict[str, Any]], key: str) -> float:
    """Mean per-step increase of a cumulative metric (0 when the run has none)."""
    if key not in train[0]:
        return 0.0
    return statistics.mean(b[key] - a[key] for a, b in zip(train, train[1:], strict=False))


def step_overhead(
    data: str, iters: int, repeats: int, names: List[str] | None = None
) -> Dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    shm = Path("/dev/shm") / f"mecefo-bench-{os.getpid()}"
    holder = _holder(shm)
    variants = {n: STEP_VARIANTS[n] for n in (names or list(STEP_VARIANTS))}
    runs: Dict[str, List[Dict[str, float]]] = {v: [] for v in variants}
    try:
        for r in range(repeats):
            for name, (flags, interval) in variants.items():
                metrics = Path(tempfile.mkdtemp()) / "m.jsonl"
                extra = list(flags)
                if interval:
                    extra += ["--mecefo-snapshot-interval", str(interval),
                              "--mecefo-snapshot-dir", str(shm)]  # fmt: skip
                else:
                    extra = [f for f in flags if f == "--use-distributed-optimizer"]
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=8",
                       f"--master_port={_free_port()}", str(TRAINER),
                       *DEMO, "--data-path", data, "--train-iters", str(iters), *extra,
                       "--metrics-file", str(metrics)]  # fmt: skip
                load = os.getloadavg()[0]
                subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=1800)
                train = [json.loads(x) for x in metrics.read_text().splitlines()]
                train = [t for t in train if t["type"] == "train"][2:]
                runs[name].append(
                    {
                        "step_time_s": statistics.median(t["step_time_s"] for t in train),
                        "snapshot_s_per_step": _per_step(train, "snapshot_s"),
                        "commit_wait_s_per_step": _per_step(train, "snapshot_commit_wait_s"),
                        "copy_wait_s_per_step": _per_step(train, "snapshot_copy_wait_s"),
                        "parity_s_per_step": _per_step(train, "snapshot_parity_s"),
                        "load_avg_1min_at_start": load,
                    }
                )
                shutil.rmtree(metrics.parent, ignore_errors=True)
                for sub in shm.glob("rank*"):  # each run starts without snapshots
                    shutil.rmtree(sub)
                print(f"  step: repeat {r} {name}: {runs[name][-1]}", flush=True)
    finally:
        os.killpg(holder.pid, signal.SIGTERM)
        holder.wait()
    out = {}
    base = {
        n: statistics.median(x["step_time_s"] for x in runs[n])
        for n in ("none", "none, dist-opt")
        if n in runs
    }
    for name, rs in runs.items():
        step = statistics.median(x["step_time_s"] for x in rs)
        snap = statistics.median(x["snapshot_s_per_step"] for x in rs)
        ref = base.get("none, dist-opt" if "dist-opt" in name else "none")
        out[name] = {
            "median_step_time_s": step,
            "step_time_vs_none": step / ref if ref else None,
            "snapshot_s_per_step": snap,
            "snapshot_share_of_step": snap / step,
            "commit_wait_s_per_step": statistics.median(x["commit_wait_s_per_step"] for x in rs),
            "copy_wait_s_per_step": statistics.median(x.get("copy_wait_s_per_step", 0) for x in rs),
            "parity_s_per_step_background": statistics.median(x["parity_s_per_step"] for x in rs),
            "runs": rs,
        }
    return out


# ---------------------------------------------------------------------- 2. erasure codes
def ec_throughput(mib: int) -> Dict[str, Any]:
    torch.set_num_threads(1)
    k, size = 4, mib << 20
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=size, dtype=np.uint8)
    blocks = [data[i * size // k : (i + 1) * size // k] for i in range(k)]
    mb = size / 1e6
    rows: List[Dict[str, Any]] = []

    def row(
        name: str, m: int, op: str, fn: Callable[[], Any], check: Callable[[Any], bool]
    ) -> None:
        cpu, wall, out = _best(fn)
        rows.append({"codec": name, "m": m, "op": op, "MBps_cpu": mb / cpu,
                     "MBps_wall": mb / wall, "exact": bool(check(out))})  # fmt: skip

    dst = np.empty_like(data)
    row("memcpy (numpy copyto)", 0, "copy", lambda: np.copyto(dst, data), lambda _: True)
    from megatron_mecefo.snapshot.checksum import crc32

    t = torch.from_numpy(data)
    row("crc32 (zlib)", 0, "checksum", lambda: crc32(t), lambda _: True)
    from megatron_mecefo.snapshot.erasure import ReedSolomonCodec, XorCodec

    xor = XorCodec(k, 1)
    parity = xor.encode(blocks)
    row("xor (torch int64)", 1, "encode", lambda: xor.encode(blocks), lambda _: True)
    have = {i: b for i, b in enumerate(blocks) if i != 1}
    have[k] = parity[0]
    row("xor (torch int64)", 1, "decode 1 lost", lambda: xor.decode(have),
        lambda out: np.array_equal(out[1], blocks[1]))  # fmt: skip
    from pyeclib.ec_iface import ECDriver

    joined = data.tobytes()
    for m in (1, 2):  # the library alone, on one buffer (our codec adds framing around it)
        driver = ECDriver(k=k, m=m, ec_type="isa_l_rs_vand")
        row("pyeclib isa_l_rs_vand (raw driver)", m, "encode", lambda: driver.encode(joined),
            lambda _: True)  # fmt: skip
    for ec_type in ("isa_l_rs_vand", "liberasurecode_rs_vand"):
        for m in (1, 2):
            codec = ReedSolomonCodec(k, m, ec_type)
            par = codec.encode(blocks)
            row(f"pyeclib {ec_type}", m, "encode", lambda: codec.encode(blocks), lambda _: True)
            have = {i: b for i, b in enumerate(blocks) if i >= m}
            have.update({k + j: p for j, p in enumerate(par)})
            row(f"pyeclib {ec_type}", m, f"decode {m} lost", lambda: codec.decode(have),
                lambda out: all(np.array_equal(out[i], blocks[i]) for i in range(k)))  # fmt: skip
    try:
        import zfec
    except ImportError:  # a candidate only: `pip install zfec` to measure it
        zfec = None
    for m in (1, 2) if zfec is not None else ():
        enc = zfec.Encoder(k, k + m)
        raw = [b.tobytes() for b in blocks]
        checks = enc.encode(raw, list(range(k, k + m)))
        row("zfec", m, "encode", lambda: enc.encode(raw, list(range(k, k + m))), lambda _: True)
        dec = zfec.Decoder(k, k + m)
        nums = list(range(m, k + m))
        avail = raw[m:] + list(checks)
        # zfec permutes the list it is given: pass a fresh copy each time.
        row("zfec", m, f"decode {m} lost", lambda: dec.decode(list(avail), list(nums)),
            lambda out: all(bytes(out[i]) == raw[i] for i in range(k)))  # fmt: skip
    from megatron_mecefo.snapshot.erasure import encode_group, rebuild

    shards = [data[i * size // 4 : (i + 1) * size // 4] for i in range(4)]
    for m in (1, 2):
        group = encode_group(shards, m)
        row(
            "encode_group n=4 (placement+CRC)",
            m,
            "encode",
            lambda: encode_group(shards, m),
            lambda _: True,
        )
        alive = {i: s for i, s in enumerate(shards) if i >= m}
        row("encode_group n=4 (placement+CRC)", m, f"rebuild {m} lost",
            lambda: rebuild(group, alive, list(range(m))),
            lambda out: all(np.array_equal(out[i], shards[i]) for i in range(m)))  # fmt: skip
    return {"mib": mib, "k": k, "rows": rows}


# ---------------------------------------------------------------------- 3. memory vs disk
def memory_vs_disk(mib: int) -> Dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_mecefo.snapshot.config import SnapshotConfig
    from megatron_mecefo.snapshot.manager import SnapshotManager

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    from megatron_mecefo.runtime import enable_cpu_runtime

    enable_cpu_runtime()  # dist_checkpointing's writer calls torch.cuda.synchronize()
    from snapshot_recovery import adam_state

    state, tensors = adam_state(mib, 0)
    nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
    shm = Path("/dev/shm") / f"mecefo-bench-mem-{os.getpid()}"
    holder = _holder(shm)
    out: Dict[str, Any] = {"state_mib": nbytes / 2**20}
    try:
        manager = SnapshotManager(SnapshotConfig(1, str(shm)), 0, 1, store=store)
        it = [0]

        def snap() -> None:
            it[0] += 1
            manager.take(state, it[0])
            manager.flush()

        snap()  # allocates the slots
        snap()
        cpu, wall, _ = _best(snap)
        out["snapshot_save_s"] = wall
        out["snapshot_save_cpu_s"] = cpu
        cpu, wall, _ = _best(
            lambda: SnapshotManager(SnapshotConfig(1, str(shm)), 0, 1, store=store).restore(state)
        )
        out["snapshot_load_s"] = wall
        disk = Path(tempfile.mkdtemp(dir=str(REPO / "results")))

        def sharded() -> Dict[str, Any]:
            return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}

        def save() -> None:
            target = disk / f"ckpt{time.monotonic_ns()}"
            target.mkdir()
            dist_checkpointing.save(sharded(), str(target))
            os.sync()
            out["_last"] = str(target)

        cpu, wall, _ = _best(save)
        out["dist_checkpointing_save_s"] = wall
        cpu, wall, _ = _best(lambda: dist_checkpointing.load(sharded(), out["_last"]))
        out["dist_checkpointing_load_s"] = wall
        out.pop("_last")
        shutil.rmtree(disk, ignore_errors=True)
    finally:
        os.killpg(holder.pid, signal.SIGTERM)
        holder.wait()
    out["save_speedup"] = out["dist_checkpointing_save_s"] / out["snapshot_save_s"]
    out["load_speedup"] = out["dist_checkpointing_load_s"] / out["snapshot_load_s"]
    return out


def summary(result: Dict[str, Any]) -> str:
    parts = []
    if "step" in result:
        s = result["step"]
        parts.append(
            "step overhead (snapshot code on the training thread, share of step): "
            + ", ".join(f"{n} {v['snapshot_share_of_step']:.2%}" for n, v in s.items())
        )
    if "ec" in result:
        best = {(r["codec"], r["m"], r["op"]): r["MBps_cpu"] for r in result["ec"]["rows"]}
        parts.append(
            f"EC {result['ec']['mib']} MiB k=4: isa_l m=2 encode "
            f"{best[('pyeclib isa_l_rs_vand', 2, 'encode')]:.0f} MB/s, xor m=1 "
            f"{best[('xor (torch int64)', 1, 'encode')]:.0f} MB/s, zfec m=2 "
            f"{best.get(('zfec', 2, 'encode'), float('nan')):.0f} MB/s"
        )
    if "memory_vs_disk" in result:
        m = result["memory_vs_disk"]
        parts.append(
            f"{m['state_mib']:.0f} MiB: snapshot save {m['snapshot_save_s']:.3f} s vs "
            f"dist_checkpointing {m['dist_checkpointing_save_s']:.3f} s "
            f"(x{m['save_speedup']:.1f}), "
            f"load {m['snapshot_load_s']:.3f} s vs {m['dist_checkpointing_load_s']:.3f} s "
            f"(x{m['load_speedup']:.1f})"
        )
    if "recovery_size" in result:
        from snapshot_recovery import summary as recovery_summary

        parts.append(recovery_summary(result["recovery_size"]))
    return "snapshot_overhead: " + "; ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=["step", "ec", "memory_vs_disk"],
                   choices=["step", "ec", "memory_vs_disk", "recovery_size"])  # fmt: skip
    p.add_argument("--data-path", default=str(REPO / "data" / "stdlib_text_document"))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--variants", nargs="+", default=None, choices=list(STEP_VARIANTS),
                   help="step part: the variants to run round-robin (default: all)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ec-mib", type=int, default=64)
    p.add_argument("--state-mib", type=int, default=256)
    p.add_argument("--recovery-mib", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--out", default=str(REPO / "results" / "snapshot_overhead.json"))
    a = p.parse_args()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    result: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_avg_at_start": os.getloadavg(), "torch": torch.__version__},  # fmt: skip
        "config": vars(a),
    }
    if "ec" in a.parts:
        result["ec"] = ec_throughput(a.ec_mib)
    if "memory_vs_disk" in a.parts:
        result["memory_vs_disk"] = memory_vs_disk(a.state_mib)
    if "recovery_size" in a.parts:
        from snapshot_recovery import recovery_size

        result["recovery_size"] = recovery_size(a.recovery_mib, REPO / "results")
    if "step" in a.parts:
        result["step"] = step_overhead(a.data_path, a.iters, a.repeats, a.variants)
    result["machine"]["load_avg_at_end"] = os.getloadavg()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(summary(result))


if __name__ == "__main__":
    main()
