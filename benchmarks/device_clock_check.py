"""The device clock's check as data: failure-free step time at 4 and at 3 ranks, per-phase overruns.

Two short failure-free runs of the example trainer under ``--device-clock llama-1b-h100`` on the
shared cores: 4 ranks and 3 ranks, 2 micro-batches per rank (the global batch scales with the
ranks), ``--iters`` iterations each. Without the clock the 3-rank run steps faster (less CPU work
in total on the same cores); with it both last the emulated step, 2 x (forward + backward) +
optimizer. Recorded per run: the step times of iterations 2..N, their mean against the emulated
step, and the clock's overruns in total and per phase (forward, backward, optimizer: a phase
overruns when the host reached its end after its emulated end; within a step the phases lie end
to end, so the host's work between them counts in the next one's time). The goals
(``tests/integration/benchmarks/test_device_clock_agreement.py`` asserts them): the two means
within 2% of each other and of the emulated step; after the first step, no overrun.

Usage: ``.venv/bin/python benchmarks/device_clock_check.py [--output
results/device_clock_check.json]`` (about a minute; the figures are emulated).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt.py"
SHAPE = "llama-1b-h100"
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--lr",
    "3e-3",
    "--make-vocab-size-divisible-by",
    "256",
    "--eval-iters",
    "0",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emulated_step(shape: str = SHAPE, microbatches: int = 2) -> float:
    """The clock's failure-free step: ``microbatches`` x (forward + backward) + optimizer."""
    from megatron_mecefo.planner.device_clock import clock_for

    return clock_for(shape).step_s(microbatches)


def run_ranks(ranks: int, workdir: Path, data: str, iters: int, timeout: float = 400) -> Dict:
    """One failure-free torchrun run at ``ranks`` ranks: step times of iterations 2..N and the
    clock's overruns over every rank (in total and per phase)."""
    from megatron_mecefo.planner.device_clock import read_logs

    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / f"m{ranks}.jsonl"
    for old in workdir.glob(f"m{ranks}.jsonl*"):
        old.unlink()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={_free_port()}",
        str(TRAINER),
        *MODEL,
        "--global-batch-size",
        str(4 * ranks),
        "--train-iters",
        str(iters),
        "--data-path",
        data,
        "--metrics-file",
        str(metrics),
        "--device-clock",
        SHAPE,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    log = workdir / f"log{ranks}.txt"
    load0 = os.getloadavg()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:  # torchrun and its ranks: one process group
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    recs = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [r["step_time_s"] for r in recs if r.get("type") == "train" and r["iteration"] > 1]
    clocks = sorted(str(p) for p in workdir.glob(f"m{ranks}.jsonl.clock*"))
    return {
        "ranks": ranks,
        "rc": rc,
        "log_tail": log.read_text(errors="replace")[-2000:] if rc != 0 else None,
        "global_batch_size": 4 * ranks,
        "iterations": iters,
        "step_times_s": [round(x, 4) for x in steps],
        "step_mean_s": round(statistics.mean(steps), 4) if steps else None,
        "clock_logs": len(clocks),
        "overruns": read_logs(clocks),
        "loadavg_start_end": [list(load0), list(os.getloadavg())],
    }


def check(workdir: Path, data: str, iters: int = 8) -> Dict[str, Any]:
    """Both runs and the comparison (emulated step, 4 against 3 ranks, overruns after step 1)."""
    emulated = emulated_step()
    runs = [run_ranks(4, workdir, data, iters), run_ranks(3, workdir, data, iters)]
    m4, m3 = runs[0]["step_mean_s"], runs[1]["step_mean_s"]
    out: Dict[str, Any] = {
        "emulated_step_s": round(emulated, 4),
        "runs": runs,
        "four_over_three": round(m4 / m3, 4) if m4 and m3 else None,
        "four_vs_three_rel": round(abs(m4 - m3) / m3, 4) if m4 and m3 else None,
        "four_vs_emulated_rel": round(abs(m4 - emulated) / emulated, 4) if m4 else None,
        "three_vs_emulated_rel": round(abs(m3 - emulated) / emulated, 4) if m3 else None,
    }
    out["goals"] = {
        "four_vs_three_within_2pct": out["four_vs_three_rel"] is not None
        and out["four_vs_three_rel"] < 0.02,
        "four_vs_emulated_within_2pct": out["four_vs_emulated_rel"] is not None
        and out["four_vs_emulated_rel"] < 0.02,
        # Every rank logs 5 phases a step; the first step builds what later ones reuse and
        # may overrun (at most its 5 phases per rank); later ones must fit.
        "phases_fit_after_step_1": all(
            r["overruns"]["phases"] == 5 * iters * r["ranks"]
            and r["overruns"]["overruns"] <= 5 * r["ranks"]
            for r in runs
        ),
    }
    return out


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", default=str(REPO / "results" / "device_clock_check.json"))
    p.add_argument("--workdir", default=str(REPO / "results" / "device_clock_check"))
    p.add_argument("--data-path", default=str(REPO / "data" / "stdlib_text_document"))
    p.add_argument("--iters", type=int, default=8)
    a = p.parse_args(argv)
    if not Path(a.data_path + ".bin").exists():
        raise SystemExit(f"device_clock_check: --data-path {a.data_path}: no .bin; run make data")
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    res = {
        "benchmark": "device_clock_check",
        "date": started,
        "emulated": True,
        "shape": SHAPE,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": {"model": MODEL, "microbatches_per_rank": 2, "iterations": a.iters},
        **check(Path(a.workdir), a.data_path, a.iters),
    }
    Path(a.output).write_text(json.dumps(res, indent=1) + "\n")
    r4, r3 = res["runs"]
    per = {
        r["ranks"]: {
            k: f"{v['overruns']}/{v['phases']}" for k, v in r["overruns"]["per_phase"].items()
        }
        for r in res["runs"]
    }
    print(
        f"device clock check ({SHAPE}, emulated step {res['emulated_step_s']} s): 4 ranks "
        f"{r4['step_mean_s']} s, 3 ranks {r3['step_mean_s']} s (4 vs 3: "
        f"{res['four_vs_three_rel']}); overruns per phase {per}; goals {res['goals']}; "
        f"wrote {a.output}"
    )
    return res


if __name__ == "__main__":
    main()
