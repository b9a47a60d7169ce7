"""One GPU, two ranks: a SIGKILL, a regroup, a rejoin and a heal at >= 1 GiB of state per rank.

Issue 53, item 8, for a lent H200 (the ``device`` tool). The example trainer runs under the
recovery supervisor at DP2 on one GPU: both ranks share it, so the world is gloo on CUDA
tensors (``MECEFO_RECOVERY_BACKEND=gloo``; NCCL refuses two ranks on one device), with the
local layer spec. Rank 1 is SIGKILLed in its forward pass at ``--kill-iteration`` and replaced
a second later from a warm standby: the survivor regroups alone (takeover), then the
replacement rejoins and is healed from it (the heal stages each bucket through host memory,
since gloo moves host memory).

Each rank prints its peak CUDA memory (``torch.cuda.max_memory_allocated``, reset after each
line) at every iteration and recovery point (``MECEFO_MEM_TRACE=1``,
:func:`megatron_mecefo.recovery.state.memory.mem_trace`). Reported per role (survivor/sender,
joiner): steady (the highest iteration peak before the kill), regroup, heal, and after (the
two iterations after the heal), each over steady; the goal is <= 1.15 for the peaks and <= 1.05
after. The recovery records give kill -> redone, regroup, heal seconds and GB/s.

Usage on the device machine (megatron-core is not in its image: carry its wheel, see
``.library/device/README.md``; the command must fit in 8 minutes)::

    python3 benchmarks/recovery_scale_gpu.py --out results/gpu/recovery_scale_h200.json

``--device cpu --hidden-size 256 --num-layers 2`` runs the same flow on the CPU (RSS peaks),
which is how it was checked on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from run_header import run_header  # noqa: E402

MEM_LINE = re.compile(
    r"\[mecefo-mem\] slot=(\d+) inc=(\d+) point=(\S+) iteration=(-?\d+) kind=(\w+) "
    r"peak=(\d+) now=(\d+)((?: \w+=\d+)*)"
)


def parse_mem(log: str) -> List[Dict[str, Any]]:
    """The ``[mecefo-mem]`` lines of a run's log, in order, with the allocator's figures where
    the line has them (``heap_in_use``, ``heap_free``, ``mmapped``: CPU ranks on glibc)."""
    out = []
    for m in MEM_LINE.finditer(log):
        slot, inc, point, it, kind, peak, now, extra = m.groups()
        row = {"slot": int(slot), "inc": int(inc), "point": point, "iteration": int(it),
               "kind": kind, "peak": int(peak), "now": int(now)}  # fmt: skip
        for pair in extra.split():
            key, value = pair.split("=")
            row[key] = int(value)
        out.append(row)
    return out


def role_peaks(
    mem: List[Dict[str, Any]], kill_iteration: int, heal_iteration: int
) -> Dict[str, Dict[str, Optional[float]]]:
    """Per process (``slot.inc``): steady, regroup, heal and after peaks (bytes) and ratios.

    A point's peak covers the time since the previous point of that process, so:
    steady = the iteration points 2..kill-1; regroup = from the kill's leave to the first
    iteration after the failure's world was built; heal = the rejoin's leave to the first
    iteration after the heal; after = the two iterations after that."""
    out: Dict[str, Dict[str, Optional[float]]] = {}
    for key in sorted({(m["slot"], m["inc"]) for m in mem}):
        lines = [m for m in mem if (m["slot"], m["inc"]) == key]
        its = [m for m in lines if m["point"] == "iteration"]

        def peak(pred: Any, lines: List[Dict[str, Any]] = lines) -> Optional[int]:
            vals = [m["peak"] for m in lines if pred(m)]
            return max(vals) if vals else None

        steady = peak(lambda m: m["point"] == "iteration" and 2 <= m["iteration"] < kill_iteration)
        regroup = peak(
            lambda m: kill_iteration - 1 <= m["iteration"] < heal_iteration - 1
            and m["point"] in ("leave", "built", "iteration")
            and not (m["point"] == "iteration" and m["iteration"] < kill_iteration)
        )
        heal = peak(lambda m: m["point"].startswith("heal-") or (
            m["point"] in ("leave", "built") and m["iteration"] >= heal_iteration - 1) or (
            m["point"] == "iteration" and m["iteration"] == heal_iteration))  # fmt: skip
        after = peak(
            lambda m: m["point"] == "iteration"
            and heal_iteration + 1 <= m["iteration"] <= heal_iteration + 2
        )
        if steady is None and its:  # the joiner: its own steady after the heal
            steady = max(m["peak"] for m in its[1:] or its)
        row: Dict[str, Optional[float]] = {"steady": steady, "regroup": regroup, "heal": heal,
                                           "after": after}  # fmt: skip
        for name in ("regroup", "heal", "after"):
            v = row[name]
            row[f"{name}_over_steady"] = round(v / steady, 4) if v and steady else None
        roles = {m["point"][5:] for m in lines if m["point"].startswith("heal-")}
        row["role"] = ",".join(sorted(roles)) or None  # type: ignore[assignment]
        out[f"{key[0]}.{key[1]}"] = row
    return out


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=6, help="6 x hidden 1024: 76 M params")
    p.add_argument("--train-iters", type=int, default=24)
    p.add_argument("--kill-iteration", type=int, default=6)
    p.add_argument("--timeout", type=float, default=420.0, help="seconds for the whole run")
    p.add_argument("--out", default=str(REPO / "results" / "gpu" / "recovery_scale_h200.json"))
    a = p.parse_args(argv)
    work = Path(os.environ.get("OUT", "/tmp")) / "recovery_scale_gpu"
    work.mkdir(parents=True, exist_ok=True)
    records, metrics = work / "recovery.jsonl", work / "metrics.jsonl"
    for f in (records, metrics):
        f.unlink(missing_ok=True)
    trainer = [
        str(REPO / "examples" / "pretrain_gpt" / "pretrain_gpt.py"), "--device", a.device,
        "--transformer-impl", "local", "--mock-data",
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", "16", "--seq-length", "256", "--max-position-embeddings", "256",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(a.train_iters),
        "--lr", "1e-4", "--lr-decay-style", "constant", "--eval-iters", "0", "--log-interval", "1",
        "--mecefo", "--mecefo-rank", "32", "--mecefo-kill", f"1:{a.kill_iteration}:forward",
        "--metrics-file", str(metrics),
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "megatron_mecefo.recovery.supervisor", "--nproc-per-node", "2",
           "--replace", "after:1", "--standby", "1", "--records", str(records),
           "--collective-timeout", "60", "--", *trainer]  # fmt: skip
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, MECEFO_RECOVERY_BACKEND="gloo", MECEFO_MEM_TRACE="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)  # fmt: skip
    result: Dict[str, Any] = run_header("recovery_scale_gpu")
    result["config"] = {"device": a.device, "hidden_size": a.hidden_size, "layers": a.num_layers,
                        "dp": 2, "backend": "gloo", "kill": f"1:{a.kill_iteration}:forward",
                        "replace": "after:1", "precision": "fp32, Adam"}  # fmt: skip
    log_path = work / "run.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the supervisor's group: its ranks too
            proc.wait()
            result["timed_out"] = True
    result["wall_s"] = round(time.time() - t0, 1)
    result["exit_code"] = proc.returncode
    text = log_path.read_text(errors="replace")
    recs = [json.loads(x) for x in records.read_text().splitlines()] if records.exists() else []
    recs = [r for r in recs if r.get("type") == "recovery"]
    result["records"] = recs
    rejoin = next((r for r in recs if r.get("kind") == "rejoin"), None)
    if rejoin is not None:
        result["memory"] = role_peaks(parse_mem(text), a.kill_iteration, rejoin["iteration"])
        result["spurious_generations"] = [
            r["generation"] for r in recs if not r["ranks_lost"] and not r["ranks_joined"]
        ]
    result["log_tail"] = text[-3000:]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    mem = result.get("memory", {})
    print(
        f"recovery_scale_gpu ({a.device}, hidden {a.hidden_size} x {a.num_layers}): exit "
        f"{proc.returncode}, heal "
        f"{rejoin.get('heal_s') if rejoin else None} s "
        f"({rejoin.get('heal_gbps') if rejoin else None} GB/s); peaks over steady "
        + "; ".join(f"{k} {v.get('role')}: regroup {v.get('regroup_over_steady')}, heal "
                    f"{v.get('heal_over_steady')}, after {v.get('after_over_steady')}"
                    for k, v in mem.items())  # fmt: skip
        + f" -> {a.out}"
    )


if __name__ == "__main__":
    main()
