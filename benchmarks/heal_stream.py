"""Where the heal's bandwidth goes: its tensor stream against gloo's one tensor, side by side.

Two processes on loopback over gloo (``OMP_NUM_THREADS=1``). Rank 0 holds ``--mib`` MiB of
float32 state in tensors of ``--tensor-mib`` MiB (about one GPT layer's weight at hidden 1024);
rank 1 receives it. Every repetition runs each mode once, in turn, so the ratios come from the
same minutes of a noisy machine:

* ``gloo_one_warm`` / ``gloo_one_fresh``: one ``send``/``recv`` of all the bytes as a single
  tensor, into a buffer whose pages are touched, or allocated just before (untouched: what a
  joiner's optimizer moments and its weights built without initialisation are; the workers
  run with a fixed mmap threshold, so that every such buffer is a fresh mapping);
* ``stream_warm``: the heal's :func:`send_tensors` / :func:`recv_tensors` (per-message
  checksums, prefaulting, messages dealt over two groups: two gloo connections, as the heal
  does with Megatron's two data-parallel groups) into touched tensors;
* ``stream_warm_one_connection``: the same over one group;
* ``stream_warm_no_checksum``: the same with the checksum replaced by a constant (what the
  checksum costs on two cores, where it competes with gloo's own copying);
* ``stream_fresh``: into tensors allocated just before: the heal's case;
* ``stream_fresh_no_prefault``: the same without :class:`.memory.Prefaulter` (the heal before
  it).

Each process also counts the CPU it spent on every mode (``time.process_time``: all its
threads, gloo's send and receive loops included). On loopback the link is the machine's cores,
so the CPU a mode spends per GB, against gloo's one tensor, says how close to gloo it can get
on a machine whose cores are all busy with it (and with the job's other processes, in a heal).

Writes ``results/heal_stream.json`` (``--output``) and prints a one-line summary: each mode's
median seconds and GB/s (1e9 bytes), its ratio to ``gloo_one_warm``, the CPU seconds of both
processes per GB and that CPU's ratio to ``gloo_one_warm``'s.

Usage (repo root)::

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/heal_stream.py [--mib 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from recovery_scale import _free_port, run_pair  # noqa: E402
from run_header import run_header  # noqa: E402

MiB = 1 << 20
MODES = (
    "gloo_one_warm",
    "gloo_one_fresh",
    "stream_warm",
    "stream_warm_one_connection",
    "stream_warm_no_checksum",
    "stream_fresh",
    "stream_fresh_no_prefault",
)


class _NoPrefault:
    """Stands in for :class:`.memory.Prefaulter`: populates nothing."""

    populated = 0

    def __init__(self, ranges: Any, chunk_bytes: int = 0) -> None:
        del ranges, chunk_bytes

    def __enter__(self) -> "_NoPrefault":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def worker(rank: int, port: int, mib: int, tensor_mib: int, reps: int) -> None:
    """One of the two processes; rank 0 prints the timings as one JSON line."""
    import torch
    import torch.distributed as dist

    from megatron_mecefo.recovery.state import tensor_stream as ts

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    second = dist.new_group([0, 1], backend="gloo")  # a connection of its own
    count = max(1, mib // tensor_mib)
    numel = tensor_mib * MiB // 4
    total = count * numel * 4
    cfg = ts.stream_config(600.0)  # the heal's own: MECEFO_HEAL_BUCKET_MB applies
    mine = [torch.ones(numel) if rank == 0 else torch.zeros(numel) for _ in range(count)]
    one = torch.ones(count * numel) if rank == 0 else torch.zeros(count * numel)
    prefaulter, real_checksum = ts.Prefaulter, ts.bytes_checksum
    in_checksum = [0.0]  # this process's CPU seconds inside the checksum, in the current mode

    def checksum(data: torch.Tensor) -> torch.Tensor:
        c0 = time.thread_time()  # the calling thread's own CPU (the heal's main thread)
        out = real_checksum(data)
        in_checksum[0] += time.thread_time() - c0
        return out

    def run(mode: str) -> None:
        ts.bytes_checksum = checksum
        ts.Prefaulter = prefaulter
        if mode == "stream_warm_no_checksum":
            ts.bytes_checksum = lambda data: torch.zeros(2, dtype=torch.int64)
        if mode == "stream_fresh_no_prefault":
            ts.Prefaulter = _NoPrefault
        lanes = [] if mode == "stream_warm_one_connection" else [second]
        if mode.startswith("gloo_one"):
            if rank == 0:
                dist.send(one, 1)
            else:
                dist.recv(one if mode == "gloo_one_warm" else torch.empty(count * numel), 0)
        elif rank == 0:
            ts.send_tensors(mine, [1], None, cfg, more_groups=lanes)
        else:
            fresh = mode.startswith("stream_fresh")
            dests = [torch.empty(numel) for _ in range(count)] if fresh else mine
            ts.recv_tensors(dests, 0, None, cfg, more_groups=lanes)

    times: Dict[str, List[float]] = {m: [] for m in MODES}
    cpu: Dict[str, List[float]] = {m: [] for m in MODES}
    cpu_checksum: Dict[str, List[float]] = {m: [] for m in MODES}
    for rep in range(reps + 1):  # the first round untimed: a warm-up
        for mode in MODES:
            dist.barrier()
            t0, c0, in_checksum[0] = time.perf_counter(), time.process_time(), 0.0
            run(mode)
            dist.barrier()  # both ends done
            if rep:
                times[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)  # every thread: gloo's loops too
                cpu_checksum[mode].append(in_checksum[0])
    result = {"rank": rank, "cpu_s": cpu, "checksum_cpu_s": cpu_checksum}
    if rank == 0:
        result.update(bytes=total, seconds=times)
    print("HEAL_STREAM_JSON " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def measure(mib: int, tensor_mib: int, reps: int, timeout: float) -> Dict[str, Any]:
    """Run the two workers; per mode the seconds, the median's GB/s and its ratio to
    ``gloo_one_warm``."""
    port = _free_port()
    # A fixed mmap threshold: glibc's dynamic one rises after the first free of a 12 MiB
    # block, and later "fresh" tensors would reuse the freed, still resident heap (warm).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # fmt: skip
    cmd = [sys.executable, __file__, "--worker", "--port", str(port), "--mib", str(mib),
           "--tensor-mib", str(tensor_mib), "--reps", str(reps)]  # fmt: skip
    outs = run_pair(cmd, "--rank", env, timeout)
    lines = [
        next((ln for ln in out.splitlines() if ln.startswith("HEAL_STREAM_JSON ")), None)
        for out in outs
    ]
    if None in lines:
        raise RuntimeError(f"the workers printed no result:\n{outs[0][-3000:]}{outs[1][-2000:]}")
    raw, other = (json.loads(ln.split(" ", 1)[1]) for ln in lines)  # type: ignore[union-attr]
    return summarize(
        raw["bytes"], raw["seconds"], [raw["cpu_s"], other["cpu_s"]],
        [raw["checksum_cpu_s"], other["checksum_cpu_s"]],
    )  # fmt: skip


def summarize(
    nbytes: int,
    seconds: Dict[str, List[float]],
    cpu_s: List[Dict[str, List[float]]],
    checksum_cpu_s: List[Dict[str, List[float]]],
) -> Dict[str, Any]:
    """Per mode: the seconds, the median's GB/s and its ratio to ``gloo_one_warm``; and the CPU
    that both processes spent on it (every thread, gloo's included), per GB and in cores, and
    the part of it inside the per-message checksums.

    On loopback the link is the machine's cores: a mode that spends ``cpu_s_per_gb`` CPU
    seconds per GB cannot move more than ``cores / cpu_s_per_gb`` GB/s on a machine with
    ``cores`` and nothing else running (``ceiling_gbps_2_cores``); in a job, the other
    processes' CPU comes out of that."""
    median: Callable[[str], float] = lambda m: statistics.median(seconds[m])  # noqa: E731
    ref = nbytes / median("gloo_one_warm") / 1e9

    def of_both(per_rank: List[Dict[str, List[float]]], m: str) -> List[float]:
        return [sum(per[m][i] for per in per_rank) for i in range(len(seconds[m]))]

    both = {m: of_both(cpu_s, m) for m in MODES}
    ref_cpu = statistics.median(both["gloo_one_warm"])
    modes = {}
    for m in MODES:
        gbps = nbytes / median(m) / 1e9
        cpu = statistics.median(both[m])
        modes[m] = {
            "seconds": [round(x, 4) for x in seconds[m]],
            "median_s": round(median(m), 4),
            "gbps": round(gbps, 3),
            "vs_gloo_one_warm": round(gbps / ref, 3),
            "cpu_s_both": [round(x, 4) for x in both[m]],
            "cpu_s_per_gb": round(cpu / (nbytes / 1e9), 4),
            "checksum_cpu_s_per_gb": round(
                statistics.median(of_both(checksum_cpu_s, m)) / (nbytes / 1e9), 4
            ),
            "cores_busy": round(cpu / median(m), 2),
            "cpu_vs_gloo_one_warm": round(cpu / ref_cpu, 3),
            "ceiling_gbps_2_cores": round(2 * (nbytes / 1e9) / cpu, 3),
        }
    return {"bytes": nbytes, "modes": modes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="state sent, MiB")
    p.add_argument("--tensor-mib", type=int, default=12, help="size of each tensor, MiB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--output", default=str(REPO / "results" / "heal_stream.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.rank, a.port, a.mib, a.tensor_mib, a.reps)
        return
    out = run_header("heal_stream")
    out["config"] = {
        "ranks": 2,
        "backend": "gloo on loopback, OMP_NUM_THREADS=1",
        "mib": a.mib,
        "tensor_mib": a.tensor_mib,
        "reps": a.reps,
        "order": "each repetition runs every mode once, in turn; medians",
        "bucket_mib": float(os.environ.get("MECEFO_HEAL_BUCKET_MB", "16")),
        "malloc_mmap_threshold": "1 MiB (fixed: every fresh buffer is a new mapping)",
    }
    out.update(measure(a.mib, a.tensor_mib, a.reps, a.timeout))
    out["machine"]["loadavg_end"] = os.getloadavg()
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=1) + "\n")
    modes = out["modes"]
    print(
        f"heal_stream: {a.mib} MiB in {a.tensor_mib} MiB tensors, 2 ranks, gloo; "
        + "; ".join(
            f"{m} {v['median_s']} s ({v['gbps']} GB/s, x{v['vs_gloo_one_warm']}; "
            f"{v['cpu_s_per_gb']} CPU s/GB, x{v['cpu_vs_gloo_one_warm']})"
            for m, v in modes.items()
        )
    )


if __name__ == "__main__":
    main()
