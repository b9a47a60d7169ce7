"""Real rank deaths: kill -> every survivor finished the redone iteration, per phase.

For each layout (DP4 on 4 ranks; TP2xPP2xDP2 on 8 ranks) and each kill phase (forward,
backward, grad-sync, optimizer, between), one supervised run of the example trainer
(``examples/pretrain_gpt/pretrain_gpt.py``, the small model below, gloo on CPU) SIGKILLs a
rank ``--kills-per-phase`` times with ``--mecefo-kill``, spaced ``--spacing`` iterations apart.
Each dead rank is replaced from a warm standby after ``--replace`` (default ``after:2``, a
repair of 2 s): the survivors first regroup without it and redo the failed iteration under the
takeover plan, then the replacement rejoins at an iteration boundary and is healed, so every
kill hits a full world. (With ``--replace immediately`` the standby is usually up before the
survivors regroup, and the failure's new world includes it: the regroup then waits for it and
heals it.) The recovery records (JSONL, one per event) give:

* per failure: ``detect_s`` (kill -> the last survivor noticed), ``regroup_s`` (-> every member
  had the new world, Megatron state, model, DDP, optimizer and restored state), ``redo_s``
  (-> every member finished the redone iteration), and ``total_s`` (kill -> redone);
* per rejoin: ``heal_s`` (state copy + checksum) and ``rejoin_s`` (boundary -> first step).

Then the cost of the armed supervisor without any failure: the same DP4 job, plain torchrun
vs supervisor, alternated ``--overhead-repeats`` times: CPU time per iteration of the whole
process tree (the difference of a short and a long run) and the mean step time (see
:func:`overhead`).

Usage: ``.venv/bin/python benchmarks/recovery_latency.py [--kills-per-phase 20]``; writes
``results/recovery_latency.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt.py"
PHASES = ("forward", "backward", "grad-sync", "optimizer", "between")
LAYOUTS = {"dp4": (1, 1, 4), "tp2pp2dp2": (2, 2, 2)}
MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
    "--lr", "3e-3", "--lr-decay-style", "constant", "--split", "90,10,0",
    "--make-vocab-size-divisible-by", "256", "--eval-iters", "0", "--log-interval", "20",
    "--mecefo", "--mecefo-rank", "16",
]  # fmt: skip
SUPERVISOR_TIMEOUTS = [
    "--heartbeat-interval", "1", "--heartbeat-timeout", "10",
    "--collective-timeout", "30", "--init-timeout", "60",
]  # fmt: skip


def _env() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _run(cmd: List[str], log: Path, timeout: float) -> int:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return -999
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _kill_pids(pid_file: Path) -> None:
    """End every rank the supervisor started, by PID (a supervisor that died leaves none, as
    its ranks die with it; this is the belt to those braces)."""
    if not pid_file.exists():
        return
    for line in pid_file.read_text().splitlines():
        pid = int(line.split()[2])
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _supervisor(world: int, pid_file: Path) -> List[str]:
    """The supervisor's command line up to its own options: ``world`` ranks on this node,
    their PIDs written to ``pid_file`` (for :func:`_kill_pids`), the benchmark's timeouts."""
    supervisor = [sys.executable, "-m", "megatron_mecefo.recovery.supervisor"]
    return [
        *supervisor,
        f"--nproc-per-node={world}",
        "--pid-file",
        str(pid_file),
        *SUPERVISOR_TIMEOUTS,
    ]


def kill_run(
    out: Path, layout: str, phase: str, kills: int, spacing: int, data: str, replace: str
) -> Dict:
    tp, pp, dp = LAYOUTS[layout]
    world = tp * pp * dp
    iters = 10 + kills * spacing
    # Victims cycle over the replicas and, within a replica, over its ranks.
    specs = []
    for k in range(kills):
        replica, inner = k % dp, (k // dp) % (tp * pp)
        rank = (inner % tp) + tp * replica + tp * dp * (inner // tp)
        specs += ["--mecefo-kill", f"{rank}:{6 + k * spacing}:{phase}"]
    run_dir = out / f"{layout}_{phase}"
    run_dir.mkdir(parents=True, exist_ok=True)
    records, metrics = run_dir / "recovery.jsonl", run_dir / "metrics.jsonl"
    for f in (records, metrics):
        f.unlink(missing_ok=True)
    pid_file = run_dir / "pids.txt"
    pid_file.unlink(missing_ok=True)
    cmd = [*_supervisor(world, pid_file), "--replace", replace, "--standby", "2",
           "--records", str(records), "--", str(TRAINER), *MODEL, "--data-path", data,
           "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
           "--train-iters", str(iters), "--metrics-file", str(metrics), *specs]  # fmt: skip
    t0 = time.time()
    try:
        rc = _run(cmd, run_dir / "log.txt", timeout=60 + iters * 6)
    finally:
        _kill_pids(pid_file)
    recs = []
    if records.exists():
        recs = [json.loads(line) for line in records.read_text().splitlines()]
    return {
        "layout": layout,
        "phase": phase,
        "rc": rc,
        "kills_requested": kills,
        "train_iters": iters,
        "wall_s": round(time.time() - t0, 1),
        "records": recs,
    }


def step_time(metrics: Path) -> float:
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    steps = [r["step_time_s"] for r in recs if r["type"] == "train"][5:]
    return statistics.mean(steps)


def _launch(out: Path, name: str, supervised: bool, args: List[str]) -> tuple:
    """One DP4 run without failures: (its process tree's CPU seconds, its metrics file)."""
    metrics, pid_file = out / f"{name}.jsonl", out / f"{name}_pids.txt"
    records = out / f"{name}_records.jsonl"
    records.unlink(missing_ok=True)
    if supervised:
        cmd = [*_supervisor(4, pid_file), "--records", str(records), "--"]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
               f"--master_port={port}"]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        rc = _run([*cmd, str(TRAINER), *args, "--metrics-file", str(metrics)],
                  out / f"{name}.log", timeout=900)  # fmt: skip
    finally:
        _kill_pids(pid_file)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert rc == 0, f"run failed: see {out}/{name}.log"
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, metrics, records


def _model(hidden: int, seq: int) -> List[str]:
    """:data:`MODEL` with another hidden size and sequence length."""
    args = list(MODEL)
    args[args.index("--hidden-size") + 1] = str(hidden)
    args[args.index("--seq-length") + 1] = str(seq)
    return args


def overhead(
    out: Path, repeats: int, iters: int, data: str, hidden: int = 64, seq: int = 64
) -> Dict[str, Any]:
    """Plain torchrun vs the armed supervisor, no failure, DP4, alternated ``repeats`` times.

    CPU time is the robust measure on shared cores (a rank waiting in gloo or in the store
    does not spin, and 4 ranks on 2 cores make wall time a function of everyone's CPU work):
    each launcher runs ``iters`` and ``4 * iters`` iterations, and the difference of the whole
    process tree's CPU time (launcher, ranks, store, supervisor threads), divided by the
    difference in iterations, is its CPU cost per iteration, start-up cancelled out. The
    mean step time of the long runs (after 5 warm-up iterations) is reported beside it.
    """
    args = [*_model(hidden, seq), "--data-path", data]
    cpu: Dict[str, List[float]] = {"plain": [], "supervised": []}
    wall: Dict[str, List[float]] = {"plain": [], "supervised": []}
    armed: List[Dict[str, Any]] = []
    armed_short: List[Dict[str, Any]] = []
    sup: List[Dict[str, Any]] = []
    for i in range(repeats):
        for kind in ("plain", "supervised"):
            armed_run = kind == "supervised"
            short, _, short_records = _launch(out, f"overhead_{kind}_{i}_short", armed_run,
                                              args + ["--train-iters", str(iters)])  # fmt: skip
            long, metrics, records = _launch(out, f"overhead_{kind}_{i}_long", armed_run,
                                             args + ["--train-iters", str(4 * iters)])  # fmt: skip
            cpu[kind].append((long - short) / (3 * iters))
            wall[kind].append(step_time(metrics))
            if armed_run:
                armed += _armed_records(records, i)
                armed_short += _armed_records(short_records, i)
                sup += _armed_records(records, i, "supervisor_cost")
    med = {k: statistics.median(v) for k, v in cpu.items()}
    pairs = [100 * (s / p - 1) for p, s in zip(cpu["plain"], cpu["supervised"], strict=True)]
    return {
        "layout": "dp4", "hidden_size": hidden, "seq_length": seq,
        "iterations": [iters, 4 * iters], "repeats": repeats,
        "cpu_per_iteration_s": cpu, "step_time_s": wall,
        "plain_cpu_median_s": med["plain"], "supervised_cpu_median_s": med["supervised"],
        "overhead_cpu_pct": 100 * (med["supervised"] / med["plain"] - 1),
        "overhead_cpu_pct_per_pair": pairs,
        "plain_cpu_spread_pct": 100 * (max(cpu["plain"]) - min(cpu["plain"])) / med["plain"],
        "overhead_wall_pct": 100 * (
            statistics.median(wall["supervised"]) / statistics.median(wall["plain"]) - 1
        ),
        "plain_wall_spread_pct": 100
        * (max(wall["plain"]) - min(wall["plain"]))
        / statistics.median(wall["plain"]),
        "vote_line": _vote_line(out, repeats),
        "accounting": armed_accounting(
            armed, statistics.median(wall["plain"]), armed_short,
            supervisor=sup, plain_cpu_s=med["plain"],
        ),
    }  # fmt: skip


def _armed_records(records: Path, repeat: int, kind: str = "armed_cost") -> List[Dict[str, Any]]:
    """The ``kind`` records of one supervised run (the ranks' ``armed_cost``, the supervisor's
    ``supervisor_cost``), tagged with its repeat."""
    return [dict(json.loads(ln), repeat=repeat) for ln in records.read_text().splitlines()
            if f'"{kind}"' in ln]  # fmt: skip


def armed_accounting(
    ranks: List[Dict[str, Any]],
    plain_step_s: float,
    short: Optional[List[Dict[str, Any]]] = None,
    supervisor: Optional[List[Dict[str, Any]]] = None,
    plain_cpu_s: Optional[float] = None,
) -> Dict[str, Any]:
    """The armed supervisor's own cost per iteration, summed from what it does (a direct
    account, immune to the A/B noise of shared cores), in two parts:

    * **On the training thread** (what a GPU node with spare host cores pays), against the
      plain launcher's step time: the commit vote as the member that completes it waits for
      it (it never waits for a peer, so this is what is left of the store round trips after
      they overlap the optimizer's gradient preparation; the other members wait for the
      slowest one's gradient sync, which without the vote they would wait for at the next
      collective), and the worst rank's boundary hooks (RNG/counter snapshot, generation
      check).
    * **CPU beside it** (what this machine pays, where the ranks share 2 cores with it),
      against the plain run's CPU per iteration (ranks and launcher): the heartbeat,
      watchdog and vote threads of every rank (the difference between the long and the short
      run of a repeat over the difference in iterations, so start-up cancels out), and the
      supervisor process (its loop, the coordinator and the store's server thread: its CPU
      from iteration 5 to the end of the long runs, per iteration).

    ``armed_pct`` is the sum of the two shares. The round trips themselves (before the
    overlap) are reported beside.
    """
    if not ranks:
        return {}
    votes = sorted(v for r in ranks for v in r["vote_last_s"][5:])
    protocol = sorted(v for r in ranks for v in r.get("vote_protocol_s", [])[5:])
    vote = statistics.median(votes)
    hooks = max(statistics.median(r["hooks_s"][5:]) for r in ranks)
    first = {(r.get("repeat"), r["slot"]): r for r in short or []}
    per_rank: Dict[int, List[float]] = {}
    per_repeat: Dict[Any, float] = {}
    for r in ranks:
        s = first.get((r.get("repeat"), r["slot"]))
        if s is not None and r["iterations"] > s["iterations"]:
            d = (r["thread_cpu_s"] - s["thread_cpu_s"]) / (r["iterations"] - s["iterations"])
            per_rank.setdefault(r["slot"], []).append(d)
            per_repeat[r.get("repeat")] = per_repeat.get(r.get("repeat"), 0.0) + d
    if per_rank:
        threads = max(statistics.median(v) for v in per_rank.values())
        threads_all = statistics.median(per_repeat.values())
    else:  # without the short runs: the threads' CPU over the iterations
        per = [r["thread_cpu_s"] / max(r["iterations"], 1) for r in ranks]
        threads, threads_all = max(per), sum(per) / len({r.get("repeat") for r in ranks})
    sup_cpu = None
    if supervisor:  # its CPU from iteration 5 to the end, per iteration (start-up left out)
        steady = [r["steady"] for r in supervisor if r.get("steady", {}).get("iterations")]
        if steady:
            sup_cpu = statistics.median(d["cpu_s"] / d["iterations"] for d in steady)
    critical = vote + hooks
    beside = threads_all + (sup_cpu or 0.0)
    critical_pct = 100 * critical / plain_step_s
    cpu_pct = 100 * beside / plain_cpu_s if plain_cpu_s else None
    return {
        "ranks": len(ranks),
        "vote_wait_s": {"p50": vote, "p90": votes[int(0.9 * (len(votes) - 1))]},
        "vote_round_trips_s": (
            {"p50": statistics.median(protocol), "p90": protocol[int(0.9 * (len(protocol) - 1))]}
            if protocol
            else {}
        ),
        "vote_with_wait_p50_s": statistics.median(v for r in ranks for v in r["vote_s"][5:]),
        "hooks_p50_s": hooks,
        "thread_cpu_per_iteration_s": threads,
        "thread_cpu_all_ranks_per_iteration_s": threads_all,
        "supervisor_cpu_per_iteration_s": sup_cpu,
        "plain_step_s": plain_step_s,
        "plain_cpu_per_iteration_s": plain_cpu_s,
        "critical_path_pct_of_step": critical_pct,
        "cpu_pct_of_plain_cpu": cpu_pct,
        "armed_pct": critical_pct + (cpu_pct or 0.0),
    }


def _vote_line(out: Path, repeats: int) -> List[str]:
    """The supervised runs' 'commit vote' summary rows (p50/max ms per iteration)."""
    lines = []
    for i in range(repeats):
        log = out / f"overhead_supervised_{i}_long.log"
        if log.exists():
            lines += [ln.strip() for ln in log.read_text().splitlines() if "commit vote" in ln]
    return lines


def _stats(values: List[float]) -> Dict[str, Any]:
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(statistics.median(values), 3),
            "max": round(max(values), 3)}  # fmt: skip


def summarize(runs: List[Dict]) -> Dict[str, Any]:
    table = {}
    for run in runs:
        fails = [r for r in run["records"] if r.get("kind") == "failure"]
        joins = [r for r in run["records"] if r.get("kind") == "rejoin"]
        table[f"{run['layout']}/{run['phase']}"] = {
            key: _stats([r.get(key) for r in fails])
            for key in ("detect_s", "regroup_s", "redo_s", "total_s")
        } | {
            "heal_s": _stats([r.get("heal_s") for r in joins]),
            "rejoin_s": _stats([r.get("rejoin_s") for r in joins]),
            "rc": run["rc"],
        }
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default="dp4,tp2pp2dp2")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--kills-per-phase", type=int, default=20)
    p.add_argument(
        "--spacing",
        type=int,
        default=100,
        help="iterations between kills; keep the kill rate below the rate at which cold "
        "replacements come up (about 10 s each here), or the world shrinks to nothing",
    )
    p.add_argument(
        "--replace",
        default="after:2",
        help="the supervisor's replacement policy for the dead ranks (a warm standby serves)",
    )
    p.add_argument("--overhead-repeats", type=int, default=3)
    p.add_argument("--overhead-iters", type=int, default=40)
    p.add_argument(
        "--overhead-hidden",
        type=int,
        default=64,
        help="hidden size of the armed-cost runs (the kill runs use 64)",
    )
    p.add_argument(
        "--overhead-seq",
        type=int,
        default=64,
        help="sequence length of the armed-cost runs (the kill runs use 64)",
    )
    p.add_argument("--data-path", default=str(REPO / "data" / "stdlib_text_document"))
    p.add_argument("--output", default=str(REPO / "results" / "recovery_latency.json"))
    p.add_argument("--workdir", default=str(REPO / "results" / "recovery_latency"))
    a = p.parse_args()
    out = Path(a.workdir)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for layout in filter(None, a.layouts.split(",")):
        for phase in filter(None, a.phases.split(",")):
            run = kill_run(out, layout, phase, a.kills_per_phase, a.spacing, a.data_path, a.replace)
            runs.append(run)
            s = summarize([run])[f"{layout}/{phase}"]
            print(f"{layout:>10} {phase:>9}: failures {s['total_s'].get('n', 0)}/"
                  f"{a.kills_per_phase}, kill->redone p50 {s['total_s'].get('p50')} s max "
                  f"{s['total_s'].get('max')} s; rejoin p50 {s['rejoin_s'].get('p50')} s "
                  f"(rc {run['rc']}, {run['wall_s']} s)", flush=True)  # fmt: skip
    over = (
        overhead(out, a.overhead_repeats, a.overhead_iters, a.data_path, a.overhead_hidden,
                 a.overhead_seq)  # fmt: skip
        if a.overhead_repeats
        else None
    )
    result = {
        "benchmark": "recovery_latency",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_at_end": os.getloadavg()},  # fmt: skip
        "config": {"model": MODEL, "supervisor": SUPERVISOR_TIMEOUTS,
                   "kills_per_phase": a.kills_per_phase, "spacing": a.spacing,
                   "replace": a.replace},  # fmt: skip
        "table": summarize(runs),
        "overhead": over,
        "runs": runs,
    }
    Path(a.output).write_text(json.dumps(result, indent=1))
    if over:
        print(
            f"armed supervisor, no failure (DP4, hidden {a.overhead_hidden}, seq "
            f"{a.overhead_seq}): CPU per iteration "
            f"{over['plain_cpu_median_s']:.4f}"
            f" s plain vs {over['supervised_cpu_median_s']:.4f} s supervised "
            f"({over['overhead_cpu_pct']:+.2f}%; pairs "
            + ", ".join(f"{x:+.1f}%" for x in over["overhead_cpu_pct_per_pair"])
            + f"); wall {over['overhead_wall_pct']:+.2f}%"
        )
        acc = over["accounting"]
        vote_ms, hooks_ms = 1e3 * acc["vote_wait_s"]["p50"], 1e3 * acc["hooks_p50_s"]
        trips_ms = 1e3 * acc["vote_round_trips_s"].get("p50", float("nan"))
        threads_ms = 1e3 * acc["thread_cpu_all_ranks_per_iteration_s"]
        sup_ms = 1e3 * (acc["supervisor_cpu_per_iteration_s"] or float("nan"))
        print(
            f"armed supervisor, accounted per iteration: on the training thread vote "
            f"{vote_ms:.2f} ms (round trips {trips_ms:.2f} ms, overlapped) + hooks "
            f"{hooks_ms:.2f} ms = {acc['critical_path_pct_of_step']:.2f}% of the "
            f"{1e3 * acc['plain_step_s']:.0f} ms step; CPU beside it: threads of all ranks "
            f"{threads_ms:.2f} ms + supervisor process {sup_ms:.2f} ms = "
            f"{acc['cpu_pct_of_plain_cpu']:.2f}% of the plain run's "
            f"{1e3 * acc['plain_cpu_per_iteration_s']:.0f} ms CPU; armed cost "
            f"{acc['armed_pct']:.2f}%"
        )
    print(f"recovery_latency: wrote {a.output}")


if __name__ == "__main__":
    main()
