"""Fail-slow throughput: one replica at half speed, with no mitigation, eviction, rebalancing.

The example trainer (real megatron-core, gloo on CPU) trains a small GPT (2 layers, hidden 128,
seq 256, micro-batch 2, SGD) with its ranks pinned to cores (``os.sched_setaffinity``):

* ``dp2``: 2 ranks, each on its own core;
* ``dp4``: 4 ranks at 2 per core (ranks 0, 1 on core 0; 2, 3 on core 1).

One rank (replica 1) is slowed from the start by an outside process
(:mod:`megatron_mecefo.failslow.duty_cycle`: SIGSTOP for half of every 20 ms, SIGCONT for the
other half). For M = 4 and 8 micro-batches per replica, each layout runs:

* ``failure_free``: nobody slowed (``detect``: its false slow marks are counted);
* ``none``: slowed, no mitigation (``--mecefo-fail-slow detect``);
* ``eviction``: slowed, and the slow replica treated as failed from iteration 1 (MeCeFO's
  takeover, ``--mecefo-fail 1:1``, policy ``neighbor``): its micro-batches are absorbed in
  takeover mode and it only joins the gradient sync;
* ``rebalance``: slowed, ``--mecefo-fail-slow rebalance`` (exact).

``--repeats`` rounds (default 3) each run the four once, in an order rotated from round to
round, so that a change of the machine's load hits every case alike. Throughput is samples per
second over the iterations after the first ``--warmup`` (detection and rebalancing happen
inside the warm-up), relative to ``failure_free`` of the same layout and M: per round
(``relative_per_round``, its median ``relative_median_of_rounds``) and as the ratio of the
median runs (``relative``). The ideal is the sum of the replicas' speeds over n (0.75 at DP2,
0.875 at DP4 with one replica at half speed); with whole micro-batches the best split reaches
less (the integer ideal, e.g. 5 + 3 at DP2, M = 4: 0.667); ``ideal_measured_speeds`` puts the
replicas' measured times per micro-batch (unmitigated, rebalanced) in place of 0.5. Every run
records the load average before and after it.

Usage (repo root, under the heavy-run lock; about 22 min on 2 cores):
``flock /tmp/mecefo-heavy.lock .venv/bin/python benchmarks/fail_slow.py --work-dir DIR``;
``--resummarise --work-dir DIR`` rebuilds the JSON's cases and the plot from the kept runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for path in (BENCH, REPO):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from run_header import plot_path, run_header  # noqa: E402

from megatron_mecefo.failslow.duty_cycle import DutyCycle  # noqa: E402
from megatron_mecefo.failslow.rebalance import plan_rebalance  # noqa: E402

WORKER = REPO / "tests" / "workers" / "failslow_trainer.py"
MBS = 2
MODEL = [
    "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "256", "--micro-batch-size", str(MBS), "--optimizer", "sgd", "--lr", "0.05",
    "--lr-decay-style", "constant", "--split", "90,10,0", "--make-vocab-size-divisible-by",
    "256", "--eval-iters", "0", "--log-interval", "1000", "--mecefo-fail-slow-window", "3",
]  # fmt: skip
LAYOUTS = {"dp2": (2, "0,1"), "dp4": (4, "0,0,1,1")}
"""Layout -> (ranks, MECEFO_TEST_CPUS: rank r on core cpus[r])."""
MITIGATIONS = {
    # detect, not off: the same exchange as the slowed runs, and the detector's false marks on
    # a loaded, unslowed machine are counted.
    "failure_free": ["--mecefo", "--mecefo-fail-slow", "detect"],
    "none": ["--mecefo", "--mecefo-fail-slow", "detect"],
    "eviction": ["--mecefo", "--mecefo-fail-slow", "off", "--mecefo-fail", "1:1"],
    "rebalance": ["--mecefo", "--mecefo-fail-slow", "rebalance"],
}
SLOW_RANK, SPEED, PERIOD_MS = 1, 0.5, 20.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(
    layout: str, m: int, mitigation: str, iters: int, data: str, work: Path
) -> Dict[str, Any]:
    """One torchrun launch; returns its train records' summary."""
    nproc, cpus = LAYOUTS[layout]
    out = work / f"{layout}_m{m}_{mitigation}"
    (out / "pids").mkdir(parents=True)
    metrics = out / "metrics.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={_free_port()}", str(WORKER), *MODEL,
        "--global-batch-size", str(m * MBS * nproc), "--train-iters", str(iters),
        "--data-path", data, "--metrics-file", str(metrics), *MITIGATIONS[mitigation],
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MECEFO_TEST_CPUS=cpus,
               MECEFO_TEST_PIDS=str(out / "pids"))  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    log = out / "log.txt"
    proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    duty: Optional[DutyCycle] = None
    pids: List[int] = []
    try:
        if not mitigation.startswith("failure_free"):
            pid_file = out / "pids" / f"rank{SLOW_RANK}.pid"
            deadline = time.time() + 180
            while not (pid_file.exists() and pid_file.read_text()):
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{out.name}: no PID:\n{log.read_text()[-3000:]}")
                time.sleep(0.05)
            duty = DutyCycle(int(pid_file.read_text()), SPEED, PERIOD_MS)
        rc = proc.wait(timeout=900)
        if rc != 0:
            raise RuntimeError(f"{out.name} failed ({rc}):\n{log.read_text()[-3000:]}")
    finally:
        if duty is not None:
            duty.stop()
        pids = [int(p.read_text()) for p in (out / "pids").glob("*.pid") if p.read_text()]
        for pid in pids:  # ranks left behind by a failure, by PID
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return {"records": [r for r in recs if r["type"] == "train"]}


def summarise(records: List[Dict[str, Any]], warmup: int) -> Dict[str, Any]:
    """Steady-state samples/s and what the fail-slow fields said."""
    steady = [r for r in records if r["iteration"] > warmup]
    samples = sum(r["mecefo"]["samples_processed"] for r in steady)
    seconds = sum(r["step_time_s"] for r in steady)
    fs = [r.get("fail_slow") for r in steady if r.get("fail_slow")]
    plans: Dict[str, int] = {}
    for r in steady:  # a flapping plan shows as several entries
        key = "+".join(str(c) for c in r["mecefo"]["microbatches_per_replica"])
        plans[key] = plans.get(key, 0) + 1
    out: Dict[str, Any] = {
        "steady_iterations": len(steady),
        "samples_per_s": samples / seconds,
        "mean_step_s": seconds / len(steady),
        "step_s": [round(r["step_time_s"], 4) for r in records],
        "microbatches_per_replica_last": steady[-1]["mecefo"]["microbatches_per_replica"],
        "steady_plans": plans,
    }
    if fs:
        out["ratio_last"] = fs[-1]["ratio"]
        # Each replica's median time per micro-batch over the steady steps (its speed).
        per = [f["time_per_microbatch_s"] for f in fs if f.get("time_per_microbatch_s")]
        if per:
            out["time_per_microbatch_s"] = [
                statistics.median(p[r] for p in per if p[r] is not None) for r in range(len(per[0]))
            ]
        out["rebalanced_steps"] = sum(bool(f["rebalanced"]) for f in fs)
        first = next((r["iteration"] for r in records if r.get("fail_slow", {}).get("slow")), None)
        out["first_iteration_marked_slow"] = first
        out["steps_marked_slow"] = sum(bool(r.get("fail_slow", {}).get("slow")) for r in records)
    return out


def integer_ideal(n: int, m: int, speed: float) -> float:
    """Best throughput share with whole micro-batches (replica 1 at ``speed``)."""
    times = [1.0] * n
    times[SLOW_RANK] = 1.0 / speed
    a = plan_rebalance(times, [SLOW_RANK], m)
    return m / a.predicted_step


def plot(result: Dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(result["cases"])
    mits = ["none", "eviction", "rebalance"]
    colors = {"none": "tab:red", "eviction": "tab:orange", "rebalance": "tab:green"}
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.25
    for i, mit in enumerate(mits):
        xs = [c + (i - 1) * width for c in range(len(cases))]
        ys = [result["cases"][k]["relative"][mit] for k in cases]
        ax.bar(xs, ys, width, label=mit, color=colors[mit])
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y + 0.01, f"{y:.2f}", ha="center", fontsize=7)
    for c, k in enumerate(cases):
        case = result["cases"][k]
        ax.hlines(case["ideal"], c - 1.5 * width, c + 1.5 * width, colors="k", linestyles="--",
                  label="ideal (sum of speeds)" if c == 0 else None)  # fmt: skip
        whole = "ideal, whole micro-batches" if c == 0 else None
        ax.hlines(case["integer_ideal"], c - 1.5 * width, c + 1.5 * width, colors="grey",
                  linestyles=":", label=whole)  # fmt: skip
        got = case.get("ideal_measured_speeds", {}).get("rebalance")
        if got:
            ax.hlines(got, c - 1.5 * width, c + 1.5 * width, colors="tab:blue", linestyles="-.",
                      label="ideal, speeds measured rebalanced" if c == 0 else None)  # fmt: skip
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("throughput / failure-free")
    top = max(v for k in cases for v in result["cases"][k]["relative"].values())
    ax.set_ylim(0, max(1.05, 1.12 * top))
    load0, load1 = result["machine"]["loadavg_start"][0], result["machine"]["loadavg_end"][0]
    ax.set_title(
        f"One replica at half speed (SIGSTOP duty cycle), CPU, gloo; median of "
        f"{result['config']['repeats']} interleaved rounds; load average {load0:.1f} -> "
        f"{load1:.1f} on {result['machine']['cpus']} cores",
        fontsize=8,
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _case(layout: str, m: int, tries: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """One cell: per mitigation the median run, and the relative throughputs (median over the
    rounds of each round's ratio to its own failure-free run, and ratio of the medians)."""
    n = LAYOUTS[layout][0]
    runs = {}
    for mit, ts in tries.items():
        srt = sorted(ts, key=lambda t: t["samples_per_s"])
        runs[mit] = dict(srt[(len(srt) - 1) // 2])  # the (lower) median
        runs[mit]["samples_per_s_all"] = [t["samples_per_s"] for t in ts]
        runs[mit]["loadavg_all"] = [t["loadavg"] for t in ts]
    ff = runs["failure_free"]["samples_per_s"]
    rel = {k: v["samples_per_s"] / ff for k, v in runs.items()}
    per_round = {
        mit: [
            t["samples_per_s"] / f["samples_per_s"]
            for t, f in zip(ts, tries["failure_free"], strict=True)
        ]
        for mit, ts in tries.items()
    }
    ideal = (n - 1 + SPEED) / n
    # The speeds the slowdown really gave: each replica's time per micro-batch unslowed over
    # slowed, same round, (a) without mitigation, (b) rebalanced (on this shared machine the
    # slowed rank ran slower per micro-batch when it ran fewer); their mean is the throughput
    # a perfect split would reach at those speeds.
    measured: Dict[str, List[float]] = {"none": [], "rebalance": []}
    for mit, got in measured.items():
        for t, f in zip(tries[mit], tries["failure_free"], strict=True):
            if "time_per_microbatch_s" in t and "time_per_microbatch_s" in f:
                sp = [
                    a / b
                    for a, b in zip(
                        f["time_per_microbatch_s"], t["time_per_microbatch_s"], strict=True
                    )
                ]
                got.append(sum(sp) / n)
    return {
        "layout": layout, "replicas": n, "microbatches": m, "runs": runs,
        "relative": rel, "relative_per_round": per_round,
        "relative_median_of_rounds": {k: statistics.median(v) for k, v in per_round.items()},
        "ideal": ideal, "integer_ideal": integer_ideal(n, m, SPEED),
        "ideal_measured_speeds": {
            k: statistics.median(v) if v else None for k, v in measured.items()
        },
        "rebalance_of_ideal": rel["rebalance"] / ideal,
        "rebalance_of_integer_ideal": rel["rebalance"] / integer_ideal(n, m, SPEED),
        "false_slow_steps_failure_free": sum(
            t.get("steps_marked_slow", 0) for t in tries["failure_free"]
        ),
    }  # fmt: skip


def _tries(work: Path, layout: str, m: int, warmup: int) -> Dict[str, List[Dict[str, Any]]]:
    """The kept runs of one cell, by mitigation, in round order."""
    tries: Dict[str, List[Dict[str, Any]]] = {mit: [] for mit in MITIGATIONS}
    for rnd in sorted(work.glob("r*"), key=lambda d: int(d.name[1:])):
        for mit in MITIGATIONS:
            metrics = rnd / f"{layout}_m{m}_{mit}" / "metrics.jsonl"
            recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            t = summarise([r for r in recs if r["type"] == "train"], warmup)
            tries[mit].append(t)
    return tries


def resummarise(a: argparse.Namespace) -> None:
    """Rebuild ``--out``'s cases and the plot from the runs kept in ``--work-dir``."""
    result = json.loads(Path(a.out).read_text())
    work = Path(a.work_dir)
    for key, case in result["cases"].items():
        old = case["runs"]
        tries = _tries(work, case["layout"], case["microbatches"], result["config"]["warmup"])
        for mit, ts in tries.items():  # the load average each run saw, from the first pass
            loads = {round(s, 6): lo for s, lo in zip(old[mit]["samples_per_s_all"],
                     old[mit]["loadavg_all"], strict=True)}  # fmt: skip
            for t in ts:
                t["loadavg"] = loads.get(round(t["samples_per_s"], 6))
        result["cases"][key] = _case(case["layout"], case["microbatches"], tries)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    plot(result, Path(a.plot) if a.plot else plot_path(Path(a.out)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--microbatches", nargs="+", type=int, default=[4, 8])
    p.add_argument("--iters", nargs="+", default=["dp2=28", "dp4=20"],
                   help="Iterations per run, per layout (LAYOUT=N).")  # fmt: skip
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--out", default=str(REPO / "results" / "fail_slow.json"))
    p.add_argument("--plot", default=None, help="default: results/plots/<--out's name>.png for "
                   "an --out in results/, else --out's path with .png")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="Rounds; each round runs every "
                   "mitigation once, in an order rotated from round to round; the median "
                   "samples/s is reported (every run is in the JSON).")  # fmt: skip
    p.add_argument("--work-dir", default=None, help="Keep the runs' logs and metrics here.")
    p.add_argument("--resummarise", action="store_true", help="Do not run: rebuild the JSON's "
                   "cases and the plot from the runs kept in --work-dir.")  # fmt: skip
    a = p.parse_args()
    if a.resummarise:
        resummarise(a)
        return
    from megatron_mecefo.data import prepare_stdlib_dataset

    iters = {k: int(v) for k, v in (x.split("=") for x in a.iters)}
    result = run_header("fail_slow")
    result["config"] = {
        "model": MODEL, "micro_batch_size": MBS, "layouts": {k: {"ranks": v[0], "cpus": v[1]}
        for k, v in LAYOUTS.items() if k in a.layouts}, "slowed_rank": SLOW_RANK,
        "speed": SPEED, "duty_cycle_period_ms": PERIOD_MS, "iters": iters,
        "warmup": a.warmup, "repeats": a.repeats, "mitigations": MITIGATIONS,
    }  # fmt: skip
    result["cases"] = {}
    t0 = time.time()
    mits = list(MITIGATIONS)
    with tempfile.TemporaryDirectory(prefix="fail_slow_") as tmp:
        work = Path(a.work_dir or tmp)
        data = str(work / "data" / "stdlib_text_document")
        prepare_stdlib_dataset(data, max_bytes=400_000)
        for layout in a.layouts:
            for m in a.microbatches:
                tries: Dict[str, List[Dict[str, Any]]] = {mit: [] for mit in mits}
                for rep in range(a.repeats):
                    # Interleaved and rotated: a load change hits every mitigation alike.
                    for mit in mits[rep % len(mits) :] + mits[: rep % len(mits)]:
                        load = os.getloadavg()[0]
                        recs = run_one(layout, m, mit, iters[layout], data, work / f"r{rep}")
                        t = summarise(recs["records"], a.warmup)
                        t["loadavg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
                        tries[mit].append(t)
                        print(f"{layout} M={m} {mit} #{rep}: {t['samples_per_s']:.1f} "
                              f"samples/s, load {t['loadavg']}, plans {t['steady_plans']}",
                              flush=True)  # fmt: skip
                result["cases"][f"{layout} M={m}"] = _case(layout, m, tries)
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["wall_s"] = time.time() - t0
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    plot(result, Path(a.plot) if a.plot else plot_path(Path(a.out)))
    for k, c in result["cases"].items():
        r = c["relative"]
        print(
            f"{k}: none {r['none']:.3f} eviction {r['eviction']:.3f} rebalance "
            f"{r['rebalance']:.3f} (ideal {c['ideal']:.3f}, whole micro-batches "
            f"{c['integer_ideal']:.3f}, at measured speeds {c['ideal_measured_speeds']}; "
            f"rebalance/ideal {c['rebalance_of_ideal']:.3f}; per round "
            f"{[round(x, 3) for x in c['relative_per_round']['rebalance']]})"
        )


if __name__ == "__main__":
    main()
