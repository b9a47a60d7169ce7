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

``--trainer megatron-lm`` measures Megatron-LM's own ``pretrain_gpt.py`` (core_v0.16.1, patched
with ``patches/megatron-lm-core_v0.16.1.patch``, on CPU ranks through
``patches/run_megatron_lm_cpu.py``; the tree is unpacked from
``../shared/megatron-lm/Megatron-LM-core_v0.16.1.tar.gz`` or given with ``--megatron-lm-dir``)
at DP4 on 4 ranks, the tiny GPT of ``tests/helpers/mlm_runs.py`` (:data:`MLM_MODEL`), in three
parts:

1. per phase, one supervised run with ``--kills-per-phase`` (default 10) ``--mecefo-kill``
   values ``--spacing`` (default 60) iterations apart, victims cycling over the replicas, each
   dead rank replaced from a warm standby (``--replace after:1 --standby 2``): detect, regroup
   (which here includes the ``pretrain()`` re-entry), redo and kill -> redone from the records;
2. one supervised run in which the benchmark itself sends ``kill -9`` to a random rank at a
   random moment (seeded, ``--external-kills``, each once the world is full again): the clock
   starts at the benchmark's ``time.time()`` just before ``os.kill``. The record's own
   ``total_s`` starts at the supervisor's reap (no kill time is known to it) and the record
   holds no absolute time, so the benchmark reads the members' absolute timestamps
   (``rt/<generation>/<slot>``: detect, built, done) and the reap (``dead/<slot>/<inc>``) from
   the membership store (``--store-file``) while the run is alive;
3. Megatron-LM's own checkpoint-restart, stock (no ``--mecefo``, no supervisor), under
   ``torchrun --max-restarts 3`` with a c10d rendezvous on localhost at a fixed port, ``--save
   D --load D --save-interval 10 --ckpt-format torch``: a rank is SIGKILLed from outside as
   iteration ``10 k + offset`` starts (``--ckpt-offsets``), and the clock runs to the log line
   of that iteration after the restart, split into kill -> the agent restarts the workers ->
   checkpoint loaded (Megatron-LM's "after model, optimizer ... built" time) -> replayed.

Writes ``results/recovery_latency_megatron_lm.json``.

``--scenarios`` measures the tails (issue 44): for each trainer (``--trainers``, default
both) and scenario, one supervised DP4 run with ``--tail-kills`` (default 10; ``--quick``: 3)
kill events from a seeded plan (:func:`tail_schedule`), each in its own window of iterations:

* ``regroup-kill``: a first death, then a survivor killed while the next world is built
  (``--mecefo-kill`` phases ``world`` and ``groups``, or the benchmark's own SIGKILL right
  after the first death's generation is published);
* ``save``: ``--save-interval 5``; a rank killed as a save starts (``save``), in its write
  (``save-write``), in its finalize (``save-finalize``), after it ended (``saved``), or by the
  benchmark at a random moment just after a save's iteration committed;
* ``rejoin-kill``: ``--standby 1``; a rank dies, and a survivor dies as the world of its
  replacement's rejoin is built (``world`` with the iteration after the failure);
* ``loader-worker``: Megatron-LM only (``--num-workers 1``; the example trainer has no
  data-loader workers): the benchmark SIGKILLs a data-loader worker of a rank (a child of the
  rank's pid in the supervisor's ``--pid-file``, found with psutil); the rank exits with 75;
* ``chaos``: seeded SIGKILLs of random trainer processes (ranks, and Megatron-LM's loader
  workers) at random moments.

Every event is timed from its first kill (``kill_time_source``: ``benchmark``, the
benchmark's ``time.time()`` before ``os.kill``; ``injected``, the rank's own timestamp; or
``reap``, the supervisor's) to the last member's redone iteration, from the absolute
timestamps in the membership store: detect, regroup, redo and total (:func:`event_timing`).
Each run also counts spurious generations (a failure generation with no rank lost; the goal
is 0) and ranks that left by a timeout (an ``err/`` message with a timeout, a heartbeat kill),
and samples the load average. The JSON keeps every event and record; the summary prints p50
and max per scenario with the load during the run. Writes ``results/recovery_tails.json``.
The full run (10 kill events per scenario, both trainers, on a quiet machine; the smoke run
adds ``--quick``):

``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recovery_latency.py --scenarios all``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from megatron_mecefo.runtime.megatron_lm_cpu import CPU_FLAGS

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
COLLECTIVE_TIMEOUT_S = 30.0
SUPERVISOR_TIMEOUTS = [
    "--heartbeat-interval", "1", "--heartbeat-timeout", "10",
    "--collective-timeout", str(int(COLLECTIVE_TIMEOUT_S)), "--init-timeout", "60",
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


def _at_backstop(fails: List[Dict]) -> int:
    """Kills whose recovery waited for the collective timeout (a survivor that nothing woke
    leaves only when its wait times out, so kill -> redone exceeds it)."""
    return sum(1 for r in fails if (r.get("total_s") or 0) >= 0.9 * COLLECTIVE_TIMEOUT_S)


def summarize(runs: List[Dict]) -> Dict[str, Any]:
    table = {}
    every: List[Dict] = []
    for run in runs:
        fails = [r for r in run["records"] if r.get("kind") == "failure"]
        joins = [r for r in run["records"] if r.get("kind") == "rejoin"]
        every += fails
        table[f"{run['layout']}/{run['phase']}"] = {
            key: _stats([r.get(key) for r in fails])
            for key in ("detect_s", "regroup_s", "redo_s", "total_s")
        } | {
            "heal_s": _stats([r.get("heal_s") for r in joins]),
            "rejoin_s": _stats([r.get("rejoin_s") for r in joins]),
            "at_backstop": _at_backstop(fails),
            "rc": run["rc"],
        }
    if len(runs) > 1:
        table["all"] = {"total_s": _stats([r.get("total_s") for r in every]),
                        "at_backstop": _at_backstop(every),
                        "rc": [run["rc"] for run in runs]}  # fmt: skip
    return table


# ---------------------------------------------------------------- --trainer megatron-lm

MLM_TARBALL = REPO.parent / "shared" / "megatron-lm" / "Megatron-LM-core_v0.16.1.tar.gz"
MLM_PATCH = REPO / "patches" / "megatron-lm-core_v0.16.1.patch"
MLM_LAUNCHER = REPO / "patches" / "run_megatron_lm_cpu.py"
MLM_MODEL = [
    *CPU_FLAGS,
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "16",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--lr", "1e-3", "--lr-decay-style", "constant",
    "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--seed", "1234",
    "--ckpt-format", "torch",
]  # fmt: skip
"""The CPU_GPT flags of ``tests/helpers/mlm_runs.py`` (DP4 on 4 ranks), without its
``--save-interval``."""
MLM_MECEFO = ["--mecefo", "--mecefo-rank", "16"]
MLM_SUPERVISOR = ["--replace", "after:1", "--standby", "2"]
MLM_ITERATION = re.compile(r"\[([0-9-]+ [0-9:.]+)\] iteration +(\d+)/")
MLM_BUILT = re.compile(r"\[after model, optimizer, and learning rate scheduler are built\] "
                       r"datetime: ([0-9-]+ [0-9:.]+)")  # fmt: skip


def megatron_lm_tree(out: Path, given: Optional[str]) -> Path:
    """The patched Megatron-LM tree: ``given``, or the tarball unpacked under ``out`` and
    patched there. ``git apply`` runs with the ceiling at ``out``: inside this repository's
    work tree it would otherwise resolve the patch's paths against the repository root and
    skip them all, yet exit 0."""
    if given:
        return Path(given)
    tree = out / "Megatron-LM-core_v0.16.1"
    script = tree / "pretrain_gpt.py"
    if script.is_file() and "mecefo" in script.read_text():
        return tree
    if tree.exists():
        raise SystemExit(f"{tree} exists but is not patched: remove it")
    with tarfile.open(MLM_TARBALL) as tar:
        tar.extractall(out, filter="data")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(out.resolve()))
    subprocess.run(["git", "apply", str(MLM_PATCH)], cwd=tree, env=env, check=True)
    if "mecefo" not in script.read_text():
        raise SystemExit(f"{MLM_PATCH} did not apply to {tree}")
    return tree


class _Tail:
    """New complete lines of a growing log, each with the time this process read it."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos, self.rest = path, 0, b""

    def lines(self) -> List[Tuple[float, str]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read()
        now = time.time()
        self.pos += len(data)
        parts = (self.rest + data).split(b"\n")
        self.rest = parts.pop()
        return [(now, p.decode(errors="replace")) for p in parts]


def _stamp(text: str) -> float:
    """Megatron-LM's log datetime (local time, this machine) as a ``time.time`` value."""
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def _read_jsonl(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _slot_pid(pid_file: Path, slot: int) -> Tuple[int, int]:
    """(incarnation, pid) of the process that holds ``slot`` now (the pid file's last line
    for it: a standby that took the slot is appended under it)."""
    found = None
    for line in pid_file.read_text().splitlines():
        s, inc, pid = map(int, line.split())
        if s == slot:
            found = (inc, pid)
    assert found is not None, f"slot {slot} not in {pid_file}"
    return found


def _start(cmd: List[str], log: Path, **env: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=dict(_env(), **env), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _stop(proc: subprocess.Popen, pids: List[int]) -> None:
    """Kill ``proc``'s process group and every PID in ``pids`` (ranks in their own
    sessions: torchrun's workers, the supervisor's ranks)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _mlm_supervised_cmd(run_dir: Path, tree: Path, iters: int, extra: List[str]) -> List[str]:
    pid_file = run_dir / "pids.txt"
    return [*_supervisor(4, pid_file), *MLM_SUPERVISOR, "--records",
            str(run_dir / "records.jsonl"), "--store-file", str(run_dir / "store.txt"), "--",
            str(MLM_LAUNCHER), "--megatron-lm-dir", str(tree), *MLM_MODEL, *MLM_MECEFO,
            "--train-iters", str(iters), *extra]  # fmt: skip


def _fresh_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.is_file():
            f.unlink()
    return path


def mlm_kill_run(out: Path, tree: Path, phase: str, kills: int, spacing: int) -> Dict:
    """One supervised DP4 run of Megatron-LM with ``kills`` ``--mecefo-kill`` in ``phase``,
    ``spacing`` iterations apart, victims cycling over the 4 replicas."""
    iters = 10 + kills * spacing
    specs = []
    for k in range(kills):
        specs += ["--mecefo-kill", f"{k % 4}:{6 + k * spacing}:{phase}"]
    run_dir = _fresh_dir(out / f"dp4_{phase}")
    cmd = _mlm_supervised_cmd(run_dir, tree, iters, specs)
    load = os.getloadavg()
    t0 = time.time()
    try:
        rc = _run(["nice", "-n", "5", *cmd], run_dir / "log.txt", timeout=300 + iters * 2)
    finally:
        _kill_pids(run_dir / "pids.txt")
    return {
        "trainer": "megatron-lm",
        "layout": "dp4",
        "phase": phase,
        "rc": rc,
        "kills_requested": kills,
        "kill_specs": specs[1::2],
        "train_iters": iters,
        "wall_s": round(time.time() - t0, 1),
        "loadavg_start_end": [load, os.getloadavg()],
        "records": [r for r in _read_jsonl(run_dir / "records.jsonl")
                    if r.get("type") == "recovery"],
    }  # fmt: skip


def _store_times(ms: Any, rec: Dict[str, Any]) -> Dict[int, Dict[str, float]]:
    """The members' absolute timestamps of the record's generation (``rt/<g>/<slot>``)."""
    gen = ms.generation(rec["generation"])
    return {s: ms.get_json(f"rt/{rec['generation']}/{s}") or {} for s in gen.members}


def mlm_external_run(out: Path, tree: Path, kills: int, spacing: int, seed: int) -> Dict:
    """One supervised DP4 run; the benchmark SIGKILLs a random rank at a random moment
    ``kills`` times, each once the world is full again and ``spacing`` iterations on."""
    from megatron_mecefo.recovery.membership import MembershipStore

    rng = random.Random(seed)
    iters = 20 + (kills + 2) * spacing
    run_dir = _fresh_dir(out / "dp4_external")
    log, records, pid_file = run_dir / "log.txt", run_dir / "records.jsonl", run_dir / "pids.txt"
    cmd = _mlm_supervised_cmd(run_dir, tree, iters, [])
    load = os.getloadavg()
    t0 = time.time()
    proc = _start(["nice", "-n", "5", *cmd], log)
    tail, last_it, ms = _Tail(log), 0, None
    events: List[Dict[str, Any]] = []
    error = None

    def poll() -> None:
        nonlocal last_it
        for _, line in tail.lines():
            m = MLM_ITERATION.search(line)
            if m:
                last_it = int(m.group(2))
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (rc {proc.returncode}) before the kills were done")
        time.sleep(0.02)

    try:
        deadline = t0 + 300 + iters * 2
        for k in range(kills):
            target = last_it + spacing if k else 6
            # Wait until the world is full again (every failure followed by its rejoin) and
            # the run is ``spacing`` iterations further.
            while True:
                recs = [r for r in _read_jsonl(records) if r.get("type") == "recovery"]
                rejoins = sum(1 for r in recs if r["kind"] == "rejoin")
                if last_it >= target and rejoins >= k:
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"kill {k}: timed out waiting for iteration {target}")
                poll()
            time.sleep(rng.uniform(0.0, 1.0))
            for _, line in tail.lines():  # the last iteration logged before the kill
                if m := MLM_ITERATION.search(line):
                    last_it = int(m.group(2))
            victim = rng.randrange(4)
            inc, pid = _slot_pid(pid_file, victim)
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            event: Dict[str, Any] = {"slot": victim, "incarnation": inc, "pid": pid,
                                     "kill_t": t_kill,
                                     "last_logged_iteration": last_it}  # fmt: skip
            while True:  # the failure record that lost the victim
                fails = [r for r in _read_jsonl(records) if r.get("kind") == "failure"
                         and victim in r["ranks_lost"] and r not in [e.get("record")
                                                                     for e in events]]  # fmt: skip
                if fails:
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"kill {k}: no failure record")
                poll()
            rec = fails[0]
            event["record_seen_t"] = time.time()
            event["record"] = rec
            if ms is None:
                ms = MembershipStore.connect((run_dir / "store.txt").read_text().strip(), 30)
            times = _store_times(ms, rec)
            dead = ms.dead_info(victim, inc) or {}
            detect, built, done = (_latest(times, key) for key in ("detect", "built", "done"))
            event["member_times"] = {str(s): t for s, t in times.items()}
            event["reap_t"] = dead.get("t")
            event["kill_to_reap_s"] = _diff_s(dead.get("t"), t_kill)
            event["detect_s"] = _diff_s(detect, t_kill)
            event["regroup_s"] = _diff_s(built, detect)
            event["redo_s"] = _diff_s(done, built)
            event["total_s"] = _diff_s(done, t_kill)
            # Cross-check: the record's reap-based total plus the kill -> reap gap.
            if rec.get("total_s") is not None and event["kill_to_reap_s"] is not None:
                event["record_total_plus_reap_s"] = round(
                    rec["total_s"] + event["kill_to_reap_s"], 4
                )
            events.append(event)
            print(f"  external kill {k + 1}/{kills}: rank {victim} (pid {pid}) after iteration "
                  f"{event['last_logged_iteration']}: kill -> redone {event['total_s']} s "
                  f"(kill -> reap {event['kill_to_reap_s']} s)", flush=True)  # fmt: skip
        rc = proc.wait(timeout=max(deadline - time.time(), 10))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        error, rc = str(e), proc.poll()
    finally:
        pids = [int(ln.split()[2]) for ln in pid_file.read_text().splitlines()] if (
            pid_file.exists()) else []  # fmt: skip
        _stop(proc, pids)
    return {
        "trainer": "megatron-lm",
        "layout": "dp4",
        "phase": "external",
        "rc": rc,
        "error": error,
        "kills_requested": kills,
        "seed": seed,
        "train_iters": iters,
        "wall_s": round(time.time() - t0, 1),
        "loadavg_start_end": [load, os.getloadavg()],
        "external_kills": events,
        "records": [r for r in _read_jsonl(records) if r.get("type") == "recovery"],
    }


def _latest(times: Dict[int, Dict[str, float]], key: str) -> Optional[float]:
    vals = [t[key] for t in times.values() if t.get(key)]
    return max(vals) if vals else None


def _diff_s(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else round(a - b, 4)


def _children(pid: int) -> List[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    kids: List[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def _local_rank(pid: int) -> Optional[int]:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"LOCAL_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def _restart_index(seen: List[Tuple[float, str]], since: float) -> Optional[int]:
    """Index of the agent's first "will restart worker group" line read at or after ``since``."""
    return next((i for i, (t, ln) in enumerate(seen)
                 if t >= since and "will restart worker group" in ln), None)  # fmt: skip


def _iteration_logged(lines: List[Tuple[float, str]], it: int) -> Optional[float]:
    """Megatron-LM's time of the first log line of iteration ``it`` in ``lines``."""
    for _, ln in lines:
        m = MLM_ITERATION.search(ln)
        if m and int(m.group(2)) == it:
            return _stamp(m.group(1))
    return None


def mlm_checkpoint_run(
    out: Path, tree: Path, offsets: List[int], seed: int, index: int, interval: int = 10
) -> Dict:
    """Stock Megatron-LM under ``torchrun --max-restarts 3`` (c10d rendezvous on localhost,
    fixed port), checkpoints every ``interval`` iterations; kill ``j`` SIGKILLs a random rank
    as iteration ``interval * (j + 1) + offsets[j]`` starts (just after the line of the one
    before it) and times the way back past that iteration."""
    assert len(offsets) <= 3 and all(2 <= o < interval for o in offsets), offsets
    rng = random.Random(seed)
    iters = interval * (len(offsets) + 2)
    run_dir = _fresh_dir(out / f"checkpoint_restart_{index}")
    save = run_dir / "ckpt"
    if save.exists():
        for f in sorted(save.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
    log = run_dir / "log.txt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = ["nice", "-n", "5", sys.executable, "-m", "torch.distributed.run",
           "--nproc_per_node=4", "--max-restarts", "3", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench{index}",
           str(MLM_LAUNCHER), "--megatron-lm-dir", str(tree), *MLM_MODEL,
           "--train-iters", str(iters), "--save", str(save), "--load", str(save),
           "--save-interval", str(interval)]  # fmt: skip
    load = os.getloadavg()
    t0 = time.time()
    # LOGLEVEL: the agent's "will restart worker group" line. TORCH_DISABLE_SHARE_RDZV_TCP_STORE:
    # with the c10d rendezvous's store shared with the workers (the default), the restarted
    # ranks read the dead attempt's gloo addresses from it and fail in connectFullMesh
    # ("Connection refused") or hang in init (pytorch issue 135712); with it set, each attempt
    # gets a store of its own at a new MASTER_PORT.
    proc = _start(cmd, log, LOGLEVEL="INFO", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    tail = _Tail(log)
    seen: List[Tuple[float, str]] = []
    workers: set = set()
    events: List[Dict[str, Any]] = []
    error = None

    def poll() -> None:
        seen.extend(tail.lines())
        # nice -> python (torchrun) -> workers: remember every worker ever seen
        for launcher in [proc.pid, *_children(proc.pid)]:
            workers.update(w for w in _children(launcher) if w != proc.pid)
        if proc.poll() is not None:
            raise RuntimeError(f"torchrun ended (rc {proc.returncode}) before the kills were done")
        time.sleep(0.02)

    def iteration_line(it: int, after: float) -> Optional[float]:
        for _, line in seen:
            m = MLM_ITERATION.search(line)
            if m and int(m.group(2)) == it and _stamp(m.group(1)) > after:
                return _stamp(m.group(1))
        return None

    try:
        deadline = t0 + 600 + iters * 3
        for j, offset in enumerate(offsets):
            failed = interval * (j + 1) + offset
            after = events[-1]["back_t"] if events else 0.0
            while iteration_line(failed - 1, after) is None:
                if time.time() > deadline:
                    raise RuntimeError(f"kill {j}: iteration {failed - 1} never logged")
                poll()
            victim = rng.randrange(4)
            ranks = {_local_rank(w): w for w in workers if Path(f"/proc/{w}").exists()}
            pid = ranks.get(victim)
            if pid is None:
                raise RuntimeError(f"kill {j}: no worker with LOCAL_RANK {victim} ({ranks})")
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)

            # The iteration that failed is the first one not logged before the agent's restart
            # (the planned one, unless the victim had done its part of it and the last rank
            # still logged it after the kill); it is back when logged after the restart.
            while (r := _restart_index(seen, t_kill)) is None:
                if time.time() > deadline:
                    raise RuntimeError(f"kill {j}: the agent never restarted the workers")
                poll()
            logged = [int(m.group(2)) for _, ln in seen[:r] if (m := MLM_ITERATION.search(ln))]
            failed = logged[-1] + 1
            while (back := _iteration_logged(seen[r:], failed)) is None:
                if time.time() > deadline:
                    raise RuntimeError(f"kill {j}: iteration {failed} never redone")
                poll()
            after_kill = seen[r:]
            restart = seen[r][0]
            built = next((_stamp(m.group(1)) for _, ln in after_kill
                          if (m := MLM_BUILT.search(ln))), None)  # fmt: skip
            loaded = [ln.strip() for _, ln in after_kill if "loaded checkpoint" in ln]
            event = {
                "rank": victim, "pid": pid, "failed_iteration": failed,
                "planned_iteration": interval * (j + 1) + offset,
                "checkpoint_iteration": interval * (j + 1), "offset": offset,
                "kill_t": t_kill, "restart_t": restart, "back_t": back,
                "kill_to_back_s": round(back - t_kill, 3),
                "kill_to_restart_s": _diff_s(restart, t_kill),
                "restart_to_loaded_s": _diff_s(built, restart),
                "kill_to_loaded_s": _diff_s(built, t_kill),
                "replay_s": _diff_s(back, built),
                "replayed_iterations": failed - interval * (j + 1),
                "loaded_lines": loaded[:2],
            }  # fmt: skip
            events.append(event)
            print(f"  checkpoint-restart kill {len(events)}: rank {victim} in iteration "
                  f"{failed} (checkpoint {interval * (j + 1)}): kill -> back past it "
                  f"{event['kill_to_back_s']} s (restart {event['kill_to_restart_s']} s, "
                  f"loaded {event['kill_to_loaded_s']} s, replay {event['replay_s']} s)",
                  flush=True)  # fmt: skip
        while proc.poll() is None and time.time() < deadline:
            seen.extend(tail.lines())
            time.sleep(0.2)
        rc = proc.poll()
        if rc is None:
            rc, error = -999, "timed out after the kills"
    except RuntimeError as e:
        error, rc = str(e), proc.poll()
    finally:
        for launcher in [proc.pid, *_children(proc.pid)]:
            workers.update(_children(launcher))
        _stop(proc, sorted(workers))
    return {
        "trainer": "megatron-lm (stock, torchrun --max-restarts 3)",
        "layout": "dp4",
        "rc": rc,
        "error": error,
        "offsets": offsets,
        "seed": seed,
        "train_iters": iters,
        "save_interval": interval,
        "torchrun": cmd[2:9],
        "wall_s": round(time.time() - t0, 1),
        "loadavg_start_end": [load, os.getloadavg()],
        "kills": events,
    }


def summarize_mlm(runs: List[Dict], external: Optional[Dict], ckpt: List[Dict]) -> Dict:
    table = summarize(runs)
    for run in runs:
        fails = [r for r in run["records"] if r.get("kind") == "failure"]
        row = table[f"{run['layout']}/{run['phase']}"]
        row["kills_requested"] = run["kills_requested"]
        # A kill that hit a full world leaves 3 replicas training.
        row["full_world_at_kill"] = sum(1 for r in fails if len(r["replicas"]) == 3)
        row["rejoins"] = sum(1 for r in run["records"] if r.get("kind") == "rejoin")
    allfails = [r for run in runs for r in run["records"] if r.get("kind") == "failure"]
    table["all phases"] = {
        key: _stats([r.get(key) for r in allfails])
        for key in ("detect_s", "regroup_s", "redo_s", "total_s")
    }
    if external is not None:
        ev = external["external_kills"]
        table["external kill -9"] = {
            key: _stats([e.get(key) for e in ev])
            for key in ("kill_to_reap_s", "detect_s", "regroup_s", "redo_s", "total_s")
        } | {
            "record_total_s_from_reap": _stats(
                [e["record"].get("total_s") for e in ev if e.get("record")]
            ),
            "rc": external["rc"],
        }
    kills = [k for run in ckpt for k in run["kills"]]
    if ckpt:
        table["checkpoint-restart"] = {
            key: _stats([k.get(key) for k in kills])
            for key in ("kill_to_restart_s", "restart_to_loaded_s", "kill_to_loaded_s",
                        "replay_s", "kill_to_back_s")
        } | {"rc": [run["rc"] for run in ckpt]}  # fmt: skip
    return table


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")


def _fmt_stats(s: Dict[str, Any]) -> str:
    return f"{s['p50']:.2f}/{s['max']:.2f}" if s.get("n") else "-"


def print_mlm_table(table: Dict[str, Any]) -> None:
    print(f"{'Megatron-LM DP4':>22} {'n':>3}  {'detect':>11} {'regroup':>11} {'redo':>11} "
          f"{'kill->redone':>12}   (p50/max s)")  # fmt: skip
    for name, row in table.items():
        if name.startswith("dp4/") or name in ("all phases", "external kill -9"):
            print(f"{name:>22} {row['total_s'].get('n', 0):>3}  {_fmt_stats(row['detect_s']):>11} "
                  f"{_fmt_stats(row['regroup_s']):>11} {_fmt_stats(row['redo_s']):>11} "
                  f"{_fmt_stats(row['total_s']):>12}")  # fmt: skip
    ext = table.get("external kill -9")
    if ext:
        reap = _fmt_stats(ext["record_total_s_from_reap"])
        print(f"{'':>22} external: kill -> reap {_fmt_stats(ext['kill_to_reap_s'])} s; the "
              f"records' reap -> redone {reap} s")  # fmt: skip
    ck = table.get("checkpoint-restart")
    if ck:
        print(f"{'checkpoint-restart':>22} {ck['kill_to_back_s'].get('n', 0):>3}  kill -> restart "
              f"{_fmt_stats(ck['kill_to_restart_s'])}, -> checkpoint loaded "
              f"{_fmt_stats(ck['kill_to_loaded_s'])} (restart -> loaded "
              f"{_fmt_stats(ck['restart_to_loaded_s'])}), replay "
              f"{_fmt_stats(ck['replay_s'])}, kill -> back past the failed iteration "
              f"{_fmt_stats(ck['kill_to_back_s'])}")  # fmt: skip


def main_megatron_lm(a: argparse.Namespace) -> None:
    out = Path(a.workdir)
    out.mkdir(parents=True, exist_ok=True)
    tree = megatron_lm_tree(out, a.megatron_lm_dir)
    load_start = os.getloadavg()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    parts = set(filter(None, a.parts.split(",")))
    merged = json.loads(Path(a.merge).read_text()) if a.merge else None
    runs = []
    for phase in filter(None, a.phases.split(",") if "kills" in parts else []):
        run = mlm_kill_run(out, tree, phase, a.kills_per_phase, a.spacing)
        runs.append(run)
        s = summarize([run])[f"dp4/{phase}"]
        print(f"megatron-lm dp4 {phase:>9}: failures {s['total_s'].get('n', 0)}/"
              f"{a.kills_per_phase}, kill->redone p50 {s['total_s'].get('p50')} s max "
              f"{s['total_s'].get('max')} s; rejoin p50 {s['rejoin_s'].get('p50')} s "
              f"(rc {run['rc']}, {run['wall_s']} s, load {run['loadavg_start_end'][1][0]:.1f})",
              flush=True)  # fmt: skip
    external = None
    if a.external_kills and "external" in parts:
        external = mlm_external_run(out, tree, a.external_kills, a.spacing, a.seed)
        print(f"megatron-lm dp4 external: {len(external['external_kills'])}/{a.external_kills} "
              f"kills (rc {external['rc']}, {external['wall_s']} s"
              + (f", error: {external['error']}" if external["error"] else "") + ")",
              flush=True)  # fmt: skip
    ckpt = []
    offsets = [int(x) for x in a.ckpt_offsets.split(",") if x] if "checkpoint" in parts else []
    for i in range(0, len(offsets), 3):  # torchrun --max-restarts 3: 3 kills per run
        ckpt.append(mlm_checkpoint_run(out, tree, offsets[i : i + 3], a.seed + i, i // 3))
        if ckpt[-1]["error"]:
            print(f"checkpoint-restart run {i // 3}: {ckpt[-1]['error']}", flush=True)
    if merged is not None:  # the parts not run here, from an earlier result of this script
        runs = runs if "kills" in parts else merged["runs"]
        external = external if "external" in parts else merged["external"]
        ckpt = ckpt if "checkpoint" in parts else merged["checkpoint_restart"]
    table = summarize_mlm(runs, external, ckpt)
    result = {
        "benchmark": "recovery_latency",
        "trainer": "megatron-lm",
        "date": started,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},  # fmt: skip
        "git_commit": _git_commit(),
        "config": {
            "megatron_lm": f"core_v0.16.1 ({tree}), patched with {MLM_PATCH.name}, launched by "
            f"{MLM_LAUNCHER.name}; megatron-core from the wheel",
            "layout": "DP4 on 4 CPU ranks (gloo), TP1 PP1",
            "model": MLM_MODEL,
            "mecefo": MLM_MECEFO,
            "supervisor": MLM_SUPERVISOR + SUPERVISOR_TIMEOUTS,
            "phases": a.phases,
            "kills_per_phase": a.kills_per_phase,
            "spacing": a.spacing,
            "external_kills": a.external_kills,
            "seed": a.seed,
            "checkpoint_restart": {"offsets": offsets, "save_interval": 10,
                                   "flags": ["--save D", "--load D", "--save-interval 10",
                                             "--ckpt-format torch"],
                                   "torchrun": "--nproc_per_node=4 --max-restarts 3 "
                                   "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:<fixed port>",
                                   "env": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (without it the "
                                   "restarted gloo ranks fail or hang in init), LOGLEVEL=INFO"},
            "nice": 5,
            "OMP_NUM_THREADS": 1,
        },  # fmt: skip
        "parts_run": sorted(parts),
        "merged_from": (
            None
            if merged is None
            else {
                "file": a.merge,
                "parts": sorted({"kills", "external", "checkpoint"} - parts),
                "date": merged["date"],
                "git_commit": merged["git_commit"],
                "machine": merged["machine"],
                "config": merged["config"],
            }
        ),
        "goal": "MeCeFO kill -> redone p50 <= 3 s, max <= 6 s (CPU)",
        "table": table,
        "runs": runs,
        "external": external,
        "checkpoint_restart": ckpt,
    }
    Path(a.output).write_text(json.dumps(result, indent=1))
    print_mlm_table(table)
    tot, ext = table["all phases"]["total_s"], table.get("external kill -9", {}).get("total_s", {})
    ck = table.get("checkpoint-restart", {}).get("kill_to_back_s", {})
    met = tot.get("n") and tot["p50"] <= 3 and tot["max"] <= 6
    print(f"recovery_latency (megatron-lm, DP4, load {load_start[0]:.1f} -> "
          f"{os.getloadavg()[0]:.1f}): MeCeFO kill -> redone p50 {tot.get('p50')} s, max "
          f"{tot.get('max')} s over {tot.get('n', 0)} kills (goal p50 <= 3, max <= 6: "
          f"{'met' if met else 'not met'}); external kill -9 p50 {ext.get('p50')} s, max "
          f"{ext.get('max')} s ({ext.get('n', 0)}); checkpoint-restart kill -> back past the "
          f"failed iteration p50 {ck.get('p50')} s, max {ck.get('max')} s ({ck.get('n', 0)}); "
          f"wrote {a.output}")  # fmt: skip


# ---------------------------------------------------------------- --scenarios (the tails)

TAIL_LEFT = re.compile(r"MeCeFO recovery: rank (\d+)( \(incarnation \d+\))? left generation "
                       r"(\d+): (.*)")  # fmt: skip
"""A rank's line as it leaves a generation on an error (its slot, generation, message)."""
TAIL_GENERATION = re.compile(r"\[coordinator\] generation (\d+) \(([^)]*)\):.* lost \[\],")
"""The coordinator's line of a generation that lost no rank (a failure one says ``now``)."""
SCENARIOS = ("regroup-kill", "save", "rejoin-kill", "loader-worker", "chaos")
"""The tail scenarios of ``--scenarios`` (issue 44, item 5)."""
TAIL_SAVE_INTERVAL = 5
"""``--save-interval`` of the save scenario: a save every 5 iterations, so that every kill
window holds saves."""
TAIL_EVENT_TIMEOUT_S = 120.0
"""How long an event may take from its window to its last failure record before the
benchmark records it as lost and goes on (a kill that hit nothing, or a stuck recovery)."""
TAIL_SPACING = {"example": 250, "megatron-lm": 100}
"""Iterations between kill windows (about 25-40 s here for either trainer at load 10): a
replacement started cold (once the warm standbys are used up) rejoins within it, so that the
next event starts from a full world. The external kills also wait for a full world; the
injected ones fire at their iteration whatever the world is then."""


def tail_schedule(scenario: str, trainer: str, kills: int, seed: int, spacing: int,
                  world: int = 4) -> List[Dict[str, Any]]:  # fmt: skip
    """The seeded plan of one scenario run: ``kills`` events, event ``k`` in the window that
    opens at iteration ``8 + k * spacing``.

    Each event is a dict: ``window`` (the iteration it waits for), ``action`` and its
    victims. ``internal`` events are ``--mecefo-kill`` values (``specs``) fired by the ranks
    themselves at an exact phase; ``external`` ones are SIGKILLs the benchmark sends (a rank,
    ``pair``: a second rank right after the first death's report, ``worker``: a data-loader
    worker of a rank, ``save``: a rank once a save's iteration committed) after ``delay_s``.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r} (one of {', '.join(SCENARIOS)})")
    if scenario == "loader-worker" and trainer != "megatron-lm":
        raise ValueError("loader-worker needs Megatron-LM (the example trainer has no workers)")
    rng = random.Random(f"{seed}/{scenario}/{trainer}")
    plan: List[Dict[str, Any]] = []
    for k in range(kills):
        w = 8 + k * spacing
        a, b = rng.sample(range(world), 2)
        ev: Dict[str, Any] = {"event": k, "window": w, "victims": [a]}
        if scenario == "regroup-kill":
            # A first death, then a survivor dies while the survivors build the next world:
            # before its rendezvous (world), during the groups' creation (groups), or at a
            # moment the benchmark picks just after the first death's report (pair).
            kind = ("world", "groups", "pair")[k % 3]
            ev["victims"] = [a, b]
            if kind == "pair":
                ev |= {"action": "external", "target": "pair", "delay_s": rng.uniform(0, 1)}
            else:
                ev |= {"action": "internal", "phase": kind,
                       "specs": [f"{a}:{w}:forward", f"{b}:{w}:{kind}"]}  # fmt: skip
        elif scenario == "save":
            it = -(-w // TAIL_SAVE_INTERVAL) * TAIL_SAVE_INTERVAL  # the first save in the window
            kind = ("save", "save-write", "save-finalize", "saved", "during")[k % 5]
            if kind == "during":
                ev |= {"action": "external", "target": "save", "save_iteration": it,
                       "delay_s": rng.uniform(0, 0.3)}  # fmt: skip
            else:
                ev |= {"action": "internal", "phase": kind, "specs": [f"{a}:{it}:{kind}"]}
        elif scenario == "rejoin-kill":
            # Rank a dies at w; b (a survivor) dies as the world of a's replacement's rejoin
            # is built: the first world left at iteration w + 1 or later (the failure's world
            # is left at w).
            ev |= {"action": "internal", "phase": "world", "victims": [a, b],
                   "specs": [f"{a}:{w}:forward", f"{b}:{w + 1}:world"]}  # fmt: skip
        elif scenario == "loader-worker":
            ev |= {"action": "external", "target": "worker", "delay_s": rng.uniform(0, 1)}
        else:  # chaos: random process (workers only where there are any), random moment
            target = "rank"
            if trainer == "megatron-lm" and rng.random() < 0.5:
                target = "worker"
            ev |= {"action": "external", "target": target, "delay_s": rng.uniform(0, 2),
                   "window": w + rng.randrange(spacing // 3)}  # fmt: skip
        plan.append(ev)
    return plan


def tail_specs(plan: List[Dict[str, Any]]) -> List[str]:
    """The ``--mecefo-kill`` arguments of a plan's internal events."""
    return [x for ev in plan for s in ev.get("specs", []) for x in ("--mecefo-kill", s)]


def event_timing(
    kill_t: Optional[float], gens: List[Dict[str, Dict[str, float]]]
) -> Dict[str, Optional[float]]:
    """An event's detect, regroup, redo and total from its first kill to the last member's
    redone iteration. ``gens`` are the member timestamps (``rt/<g>/<slot>``) of its failure
    generations, oldest first (one for a single death; a generation superseded while it was
    built has none). Detect ends at the last member's detection in the first generation that
    has any, regroup at the last member's build of the last generation, redo at its last
    member's done; so the three sum to total."""

    def latest(times: Dict[str, Dict[str, float]], key: str) -> Optional[float]:
        vals = [t[key] for t in times.values() if t.get(key)]
        return max(vals) if vals else None

    detect = next((d for g in gens if (d := latest(g, "detect")) is not None), None)
    built = latest(gens[-1], "built") if gens else None
    done = latest(gens[-1], "done") if gens else None
    if kill_t is not None and detect is not None:
        detect = max(detect, kill_t)  # a survivor that noticed before the clock started
    return {"detect_s": _diff_s(detect, kill_t), "regroup_s": _diff_s(built, detect),
            "redo_s": _diff_s(done, built), "total_s": _diff_s(done, kill_t)}  # fmt: skip


def summarize_tails(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per trainer/scenario: p50 and max of each event's times, events lost, spurious
    generations (a failure generation with no rank lost), ranks that left by a timeout, and
    the load average during the run."""
    table: Dict[str, Any] = {}
    for run in runs:
        evs = [e for e in run["events"] if e.get("total_s") is not None]
        loads = [x[1] for x in run.get("loadavg_samples", [])]
        table[f"{run['trainer']}/{run['scenario']}"] = {
            key: _stats([e.get(key) for e in evs])
            for key in ("detect_s", "regroup_s", "redo_s", "total_s")
        } | {
            "events_planned": len(run["plan"]),
            "events_measured": len(evs),
            "kills": sum(len(e.get("kills", [])) for e in run["events"]),
            "kill_time_sources": sorted({k["source"] for e in run["events"]
                                         for k in e.get("kills", [])}),  # fmt: skip
            "spurious_generations": len(run["spurious_generations"]),
            "timeouts": len(run["timeouts"]),
            "loadavg_1m": ({"mean": round(statistics.mean(loads), 1), "max": round(max(loads), 1)}
                           if loads else {}),  # fmt: skip
            "error": run.get("error"),
        }  # fmt: skip
    return table


def _rank_pids(pid_file: Path) -> Dict[int, Tuple[int, int]]:
    """slot -> (incarnation, pid) of the processes that hold the slots now."""
    out: Dict[int, Tuple[int, int]] = {}
    if pid_file.exists():
        for line in pid_file.read_text().splitlines():
            s, inc, pid = map(int, line.split())
            out[s] = (inc, pid)
    return out


def _loader_workers(pid: int) -> List[int]:
    """The data-loader workers of rank ``pid``: its children (psutil), those named
    ``pt_data_worker`` (PyTorch names its workers' threads so) if any."""
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=False)
    except psutil.Error:
        return []
    named = [c.pid for c in kids if "pt_data_worker" in (c.name() or "")]
    return named or [c.pid for c in kids]


def tail_run(out: Path, trainer: str, scenario: str, kills: int, seed: int,
             tree: Optional[Path], data: str, spacing: int,
             ckpt_format: str = "torch") -> Dict[str, Any]:  # fmt: skip
    """One supervised DP4 run of ``trainer`` under ``scenario``'s plan (:func:`tail_schedule`);
    every event measured from its first kill (the benchmark's ``time.time()`` before
    ``os.kill``, or the injected kill's own timestamp) to the last member's redone iteration,
    from the membership store's absolute timestamps, read while the run is alive."""
    from megatron_mecefo.recovery.membership import MembershipStore

    plan = tail_schedule(scenario, trainer, kills, seed, spacing)
    rng = random.Random(f"{seed}/{scenario}/{trainer}/victims")
    iters = 8 + (kills + 1) * spacing
    run_dir = _fresh_dir(out / f"{trainer}_{scenario}")
    records, pid_file, store_file = (run_dir / n for n in ("records.jsonl", "pids.txt",
                                                           "store.txt"))  # fmt: skip
    standby = {"rejoin-kill": "1", "regroup-kill": "4"}.get(scenario, "2")
    supervisor = ["--replace", "after:1", "--standby", standby,
                  "--records", str(records), "--store-file", str(store_file)]  # fmt: skip
    extra = [*tail_specs(plan), "--train-iters", str(iters)]
    if scenario == "save":
        ckpt = run_dir / "ckpt"
        if ckpt.exists():
            for f in sorted(ckpt.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
        extra += ["--save", str(ckpt), "--save-interval", str(TAIL_SAVE_INTERVAL)]
    if trainer == "megatron-lm":
        model = list(MLM_MODEL)
        if scenario in ("loader-worker", "chaos"):  # a loader worker per rank to kill
            model[model.index("--num-workers") + 1] = "1"
        model[model.index("--ckpt-format") + 1] = ckpt_format
        args = [str(MLM_LAUNCHER), "--megatron-lm-dir", str(tree), *model, *MLM_MECEFO]
    else:
        args = [str(TRAINER), *MODEL, "--data-path", data]
    cmd = ["nice", "-n", "5", *_supervisor(4, pid_file), *supervisor, "--", *args, *extra]
    load = os.getloadavg()
    t0 = time.time()
    proc = _start(cmd, run_dir / "log.txt")
    events: List[Dict[str, Any]] = []
    loads: List[Tuple[float, float]] = [(0.0, load[0])]
    spurious: Dict[int, Dict[str, Any]] = {}
    timeouts: Dict[str, Dict[str, Any]] = {}
    ms: Any = None
    error = None

    def poll() -> None:
        if time.time() - t0 - loads[-1][0] >= 5:
            loads.append((round(time.time() - t0, 1), os.getloadavg()[0]))
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (rc {proc.returncode}) before the events were done")
        time.sleep(0.02)

    def store() -> Any:
        nonlocal ms
        while ms is None:
            if store_file.exists() and store_file.read_text().strip():
                ms = MembershipStore.connect(store_file.read_text().strip(), 30)
            else:
                poll()
        return ms

    def full_world() -> bool:
        g = store().generation_number()
        return g >= 0 and len(store().generation(g).members) == 4

    def progress() -> int:
        return int(store().get_str("progress") or 0)

    def scan(upto: int) -> None:
        """Spurious generations and timeouts among generations 1..upto."""
        for g in range(1, upto + 1):
            gen = store().generation(g)
            if gen.at_iteration is None and not gen.lost and g not in spurious:
                spurious[g] = {"generation": g, "reason": gen.reason}
            for s in range(4):
                err = store().get_json(f"err/{g}/{s}")
                if err and re.search(r"time(d)? ?out", err.get("error", ""), re.I):
                    timeouts.setdefault(f"{g}/{s}", {"generation": g, "slot": s,
                                                     "error": err["error"][:200]})  # fmt: skip
        for s, (inc, _) in _rank_pids(pid_file).items():
            for i in range(inc + 1):
                why = store().get_json(f"kill/{s}/{i}")
                if why and why.get("reason") == "heartbeat":
                    timeouts.setdefault(f"hb/{s}/{i}", {"slot": s, "incarnation": i,
                                                        "reason": "heartbeat"})  # fmt: skip

    def one_event(ev: Dict[str, Any], event: Dict[str, Any]) -> None:
        """Wait for ``ev``'s window, kill, and time it into ``event``."""
        t_start = time.time()  # this event's kills come later (an earlier one's do not)
        # Generations after this one belong to the event (an internal kill may fire as
        # soon as its window opens, before this loop sees it).
        start_gen = max(store().generation_number(), 0)
        incs = _rank_pids(pid_file)
        # Every event starts from a full world at its window (internal kills fire there).
        while True:
            done_it = progress()
            if ev["action"] == "internal" and done_it >= ev["window"] - 1:
                break  # the ranks fire it themselves
            if done_it >= ev["window"] and full_world():
                break
            if time.time() > deadline:
                raise RuntimeError(f"event {ev['event']}: window {ev['window']} never reached")
            poll()
        t_ev = time.time()
        if ev["action"] == "external":
            start_gen = max(store().generation_number(), 0)
            if ev["target"] == "save":
                while progress() < ev["save_iteration"]:
                    poll()
            time.sleep(ev["delay_s"])
            victim = ev["victims"][0]
            inc, pid = _rank_pids(pid_file)[victim]
            target = pid
            if ev["target"] == "worker":
                workers = _loader_workers(pid)
                while not workers and time.time() < t_ev + 30:
                    poll()
                    workers = _loader_workers(pid)
                if workers:
                    target = rng.choice(workers)
                else:  # recorded, and the rank is killed instead
                    event["note"] = f"rank {victim} had no loader worker: killed the rank"
            t_kill = time.time()
            os.kill(target, signal.SIGKILL)
            event["kills"].append({"slot": victim, "incarnation": inc, "pid": target,
                                   "what": "loader worker" if target != pid else "rank",
                                   "t": t_kill, "source": "benchmark"})  # fmt: skip
            if ev["target"] == "pair":  # the second death right after the first's report
                while store().generation_number() <= start_gen:
                    poll()
                time.sleep(ev["delay_s"])
                b = ev["victims"][1]
                inc_b, pid_b = _rank_pids(pid_file)[b]
                t_b = time.time()
                os.kill(pid_b, signal.SIGKILL)
                event["kills"].append({"slot": b, "incarnation": inc_b, "pid": pid_b,
                                       "what": "rank", "t": t_b,
                                       "source": "benchmark"})  # fmt: skip
        # The failure generations of this event: until one loses the last victim.
        last_victim = ev["victims"][-1]
        gens: List[int] = []
        while True:
            g = store().generation_number()
            gens = [n for n in range(start_gen + 1, g + 1)
                    if store().generation(n).at_iteration is None]  # fmt: skip
            if any(last_victim in store().generation(n).lost for n in gens):
                # ... and its redone iteration (every member's done).
                gen = store().generation(gens[-1])
                rt = {s: store().get_json(f"rt/{gen.number}/{s}") or {} for s in gen.members}
                if all(t.get("done") for t in rt.values()):
                    break
            if time.time() > t_ev + TAIL_EVENT_TIMEOUT_S:
                event["error"] = "no complete failure generation losing the victim"
                break
            poll()
        if ev["action"] == "internal":  # the injected kills' own timestamps
            for s in ev["victims"]:
                first_inc = incs.get(s, (0, 0))[0]
                for i in range(first_inc, _rank_pids(pid_file).get(s, (0, 0))[0] + 1):
                    k = store().get_json(f"killed/{s}/{i}")
                    # The pid file may still name the incarnation an earlier event killed.
                    if k and k["t"] >= t_start:
                        event["kills"].append({"slot": s, "incarnation": i, "t": k["t"],
                                               "spec": k.get("spec"), "what": "rank",
                                               "source": "injected"})  # fmt: skip
                        break
        lost = {s: i for n in gens for s, i in store().generation(n - 1).members.items()
                if s in store().generation(n).lost}  # fmt: skip
        for s, i in lost.items():  # deaths of this event nobody here timed: the reap
            if not any(k["slot"] == s for k in event["kills"]):
                d = store().dead_info(s, i) or {}
                event["kills"].append({"slot": s, "incarnation": i, "t": d.get("t"),
                                       "exit_code": d.get("exit_code"), "what": "rank",
                                       "source": "reap"})  # fmt: skip
        for k in event["kills"]:
            if k["what"] == "rank" or k.get("exit_code") is not None:
                continue
            d = store().dead_info(k["slot"], k["incarnation"]) or {}
            k["rank_exit_code"] = d.get("exit_code")  # 75: it left for its dead worker
        times = [k["t"] for k in event["kills"] if k.get("t")]
        event["generations"] = gens
        if scenario == "rejoin-kill":  # the event is the survivor's death at the rejoin
            b = ev["victims"][1]
            times = [k["t"] for k in event["kills"] if k.get("t") and k["slot"] == b]
            gens = [n for n in gens if b in store().generation(n).lost][:1] or gens
        if gens and "error" not in event:
            rts = [{str(s): store().get_json(f"rt/{n}/{s}") or {}
                    for s in store().generation(n).members} for n in gens]  # fmt: skip
            event |= event_timing(min(times) if times else None, rts)
            event["member_times"] = dict(zip(map(str, gens), rts, strict=True))
        scan(store().generation_number())
        print(f"  {trainer} {scenario} event {ev['event'] + 1}/{len(plan)} "
              f"({ev['action']} {ev.get('phase') or ev.get('target')}, kills "
              f"{[(k['slot'], k['what'], k['source']) for k in event['kills']]}): "
              f"kill -> redone {event.get('total_s')} s"
              + (f" ({event['error']})" if event.get("error") else ""), flush=True)  # fmt: skip

    try:
        deadline = t0 + 300 + iters * 3
        for ev in plan:
            event: Dict[str, Any] = {"event": ev["event"], "plan": ev, "kills": []}
            events.append(event)
            try:
                one_event(ev, event)
            except (RuntimeError, OSError) as e:
                if proc.poll() is not None or "never reached" in str(e):
                    raise
                # The store client failed (its connection closed, a get timed out): the
                # event is recorded as lost and the next one gets a new client.
                event["error"] = f"store client: {type(e).__name__}: {e}"[:300]
                ms = None
                print(
                    f"  {trainer} {scenario} event {ev['event'] + 1}: {event['error']}", flush=True
                )
        scan(store().generation_number())
    except (RuntimeError, OSError) as e:
        error = str(e)
    finally:
        records_out = [r for r in _read_jsonl(records) if r.get("type") == "recovery"]
        # The ranks' own lines are the backstop of the store's err/ keys (read only between
        # events, and lost with a failed store client).
        text = (run_dir / "log.txt").read_text(errors="replace")
        for m in TAIL_GENERATION.finditer(text):  # a failure generation that lost nobody
            if "now" in m.group(2) and int(m.group(1)) not in spurious:
                spurious[int(m.group(1))] = {"generation": int(m.group(1)),
                                             "reason": m.group(2), "from": "log"}  # fmt: skip
        for m in TAIL_LEFT.finditer(text):
            if re.search(r"time(d)? ?out", m.group(4), re.I):
                timeouts.setdefault(f"{m.group(3)}/{m.group(1)}", {
                    "generation": int(m.group(3)), "slot": int(m.group(1)),
                    "error": m.group(4)[:200], "from": "log"})  # fmt: skip
        pids = [int(ln.split()[2]) for ln in pid_file.read_text().splitlines()] if (
            pid_file.exists()) else []  # fmt: skip
        rc = proc.poll()
        _stop(proc, pids)
    return {
        "trainer": trainer,
        "scenario": scenario,
        "layout": "dp4",
        "rc": rc,
        "stopped_by_benchmark": rc is None,
        "error": error,
        "seed": seed,
        "spacing": spacing,
        "train_iters": iters,
        "plan": plan,
        "wall_s": round(time.time() - t0, 1),
        "loadavg_start_end": [load, os.getloadavg()],
        "loadavg_samples": loads,
        "events": events,
        "spurious_generations": list(spurious.values()),
        "timeouts": list(timeouts.values()),
        "records": records_out,
    }


def print_tails(table: Dict[str, Any]) -> None:
    print(f"{'trainer/scenario':>28} {'n':>3}  {'kill->redone':>12} {'detect':>11} "
          f"{'regroup':>11} {'redo':>11} {'spurious':>8} {'timeouts':>8} {'load':>10}"
          "   (p50/max s; load: 1-min mean/max)")  # fmt: skip
    for name, row in table.items():
        ld = row["loadavg_1m"]
        load = f"{ld['mean']:.1f}/{ld['max']:.1f}" if ld else "-"
        print(f"{name:>28} {row['events_measured']:>3}  {_fmt_stats(row['total_s']):>12} "
              f"{_fmt_stats(row['detect_s']):>11} {_fmt_stats(row['regroup_s']):>11} "
              f"{_fmt_stats(row['redo_s']):>11} {row['spurious_generations']:>8} "
              f"{row['timeouts']:>8} {load:>10}"
              + (f"  error: {row['error']}" if row.get("error") else ""))  # fmt: skip


def main_tails(a: argparse.Namespace) -> None:
    scenarios = SCENARIOS if a.scenarios == "all" else tuple(a.scenarios.split(","))
    for s in scenarios:
        if s not in SCENARIOS:
            raise SystemExit(f"--scenarios: unknown {s!r} (one of {', '.join(SCENARIOS)}, all)")
    kills = 3 if a.quick else a.tail_kills
    out = Path(a.workdir or REPO / "results" / "recovery_tails")
    out.mkdir(parents=True, exist_ok=True)
    trainers = [t for t in a.trainers.split(",") if t]
    tree = megatron_lm_tree(out, a.megatron_lm_dir) if "megatron-lm" in trainers else None
    load_start = os.getloadavg()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    runs, notes = [], []
    for trainer in trainers:
        for scenario in scenarios:
            if scenario == "loader-worker" and trainer != "megatron-lm":
                note = (f"{trainer}/loader-worker: not run: the example trainer has no "
                        "data-loader workers (loader-worker is Megatron-LM only)")  # fmt: skip
                notes.append(note)
                print(note, flush=True)
                continue
            spacing = a.spacing or TAIL_SPACING[trainer]
            run = tail_run(out, trainer, scenario, kills, a.seed, tree, a.data_path, spacing,
                           a.ckpt_format)  # fmt: skip
            runs.append(run)
            row = summarize_tails([run])[f"{trainer}/{scenario}"]
            print(f"{trainer}/{scenario}: {row['events_measured']}/{kills} events, kill -> "
                  f"redone p50 {row['total_s'].get('p50')} s max {row['total_s'].get('max')} s, "
                  f"spurious generations {row['spurious_generations']}, timeouts "
                  f"{row['timeouts']}, load {row['loadavg_1m']} ({run['wall_s']} s)"
                  + (f", error: {run['error']}" if run["error"] else ""), flush=True)  # fmt: skip
    table = summarize_tails(runs)
    result = {
        "benchmark": "recovery_latency --scenarios",
        "date": started,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},  # fmt: skip
        "git_commit": _git_commit(),
        "config": {"scenarios": list(scenarios), "trainers": trainers,
                   "kills_per_scenario": kills, "quick": a.quick, "seed": a.seed,
                   "spacing": a.spacing or TAIL_SPACING, "save_interval": TAIL_SAVE_INTERVAL,
                   "layout": "DP4 on 4 CPU ranks (gloo)",
                   "supervisor": ["--replace", "after:1", "--standby",
                                  "2 (rejoin-kill: 1, regroup-kill: 4)",
                                  *SUPERVISOR_TIMEOUTS],
                   "example_model": MODEL, "megatron_lm_model": MLM_MODEL,
                   "megatron_lm_num_workers": "1 in loader-worker and chaos, else 0",
                   "megatron_lm_ckpt_format": a.ckpt_format,
                   "nice": 5, "OMP_NUM_THREADS": 1},  # fmt: skip
        "notes": notes,
        "goal": "kill -> redone max <= 3 s in every scenario, no spurious generation",
        "table": table,
        "runs": runs,
    }
    Path(a.output).write_text(json.dumps(result, indent=1))
    print_tails(table)
    for note in notes:
        print(note)
    print(f"recovery_latency --scenarios: wrote {a.output}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--trainer",
        choices=("example", "megatron-lm"),
        default="example",
        help="example: examples/pretrain_gpt (the layouts, the armed cost); megatron-lm: "
        "Megatron-LM's pretrain_gpt.py at DP4 (kills per phase, external kill -9, and stock "
        "checkpoint-restart under torchrun)",
    )
    p.add_argument("--layouts", default="dp4,tp2pp2dp2")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--kills-per-phase", type=int, default=None, help="default 20; megatron-lm: 10")
    p.add_argument(
        "--spacing",
        type=int,
        default=None,
        help="iterations between kills (default 100; megatron-lm: 60); keep the kill rate "
        "below the rate at which cold replacements come up (about 10 s each here), or the "
        "world shrinks to nothing",
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
    p.add_argument("--output", default=None, help="default results/recovery_latency.json "
                   "(megatron-lm: results/recovery_latency_megatron_lm.json)")  # fmt: skip
    p.add_argument("--workdir", default=None, help="default results/recovery_latency "
                   "(megatron-lm: results/recovery_latency_megatron_lm)")  # fmt: skip
    p.add_argument("--external-kills", type=int, default=5,
                   help="megatron-lm: kill -9 from the benchmark at random moments")  # fmt: skip
    p.add_argument(
        "--ckpt-offsets",
        default="7,3,5,7,4",
        help="megatron-lm: stock checkpoint-restart, one kill per value, in iteration "
        "10 k + value (2..9) after the checkpoint of iteration 10 k; 3 kills per torchrun run",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="megatron-lm: victims and moments (default 27; --scenarios: 44)",
    )
    p.add_argument("--parts", default="kills,external,checkpoint",
                   help="megatron-lm: which of the three parts to run")  # fmt: skip
    p.add_argument("--merge", default=None, metavar="JSON",
                   help="megatron-lm: take the parts not run from this earlier result")  # fmt: skip
    p.add_argument("--megatron-lm-dir", default=None,
                   help="megatron-lm: a patched core_v0.16.1 tree (default: unpack the "
                   "tarball into the workdir)")  # fmt: skip
    p.add_argument("--scenarios", default="", metavar="LIST",
                   help="the tails: comma-separated of " + ", ".join(SCENARIOS) + ", or all; "
                   "runs them for --trainers and writes results/recovery_tails.json (default: "
                   "none, the per-phase benchmark above)")  # fmt: skip
    p.add_argument("--trainers", default="example,megatron-lm",
                   help="--scenarios: which trainers")  # fmt: skip
    p.add_argument("--tail-kills", type=int, default=10,
                   help="--scenarios: kill events per scenario and trainer")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="--scenarios: a smoke run, 3 kill events per scenario")  # fmt: skip
    p.add_argument("--ckpt-format", default="torch", choices=("torch", "torch_dist"),
                   help="--scenarios: Megatron-LM's checkpoint format (torch_dist: its "
                   "default, a sharded save with forked writers)")  # fmt: skip
    a = p.parse_args()
    if a.scenarios:
        example = "example" in a.trainers.split(",")
    else:
        example = a.trainer != "megatron-lm"
    if example and not Path(a.data_path + ".bin").is_file():
        # Else each of the example trainer's runs fails at start-up inside the supervisor.
        p.error(f"--data-path {a.data_path}: no {a.data_path}.bin; build it with `make data`")
    if a.scenarios:
        a.seed = a.seed if a.seed is not None else 44
        a.output = a.output or str(REPO / "results" / "recovery_tails.json")
        main_tails(a)
        return
    a.seed = a.seed if a.seed is not None else 27
    mlm = a.trainer == "megatron-lm"
    name = "recovery_latency_megatron_lm" if mlm else "recovery_latency"
    a.kills_per_phase = a.kills_per_phase if a.kills_per_phase is not None else (10 if mlm else 20)
    a.spacing = a.spacing if a.spacing is not None else (60 if mlm else 100)
    a.output = a.output or str(REPO / "results" / f"{name}.json")
    a.workdir = a.workdir or str(REPO / "results" / name)
    if mlm:
        main_megatron_lm(a)
        return
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
                  f"{s['total_s'].get('max')} s, {s['at_backstop']} at the backstop; rejoin "
                  f"p50 {s['rejoin_s'].get('p50')} s (rc {run['rc']}, {run['wall_s']} s, load "
                  f"{os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
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
    every = result["table"].get("all")
    if every:
        tot = every["total_s"]
        print(f"recovery_latency ({a.layouts}, {tot.get('n', 0)} kills, load "
              f"{os.getloadavg()[0]:.1f}): kill -> redone p50 {tot.get('p50')} s, max "
              f"{tot.get('max')} s, {every['at_backstop']} at the {COLLECTIVE_TIMEOUT_S:.0f} s "
              f"backstop")  # fmt: skip
    print(f"recovery_latency: wrote {a.output}")


if __name__ == "__main__":
    main()
