"""Convergence under failures: failure-free vs every takeover policy under the paper's schedules.

Trains the example trainer's default LLaMA-style model (4 layers, hidden 128, 4 heads, seq 128,
byte tokens) on the default real-text data (``data/stdlib_text_document``) on CPU, DP = 4
ranks over gloo, once failure-free and once per (policy, scenario):

* failure-free: the stock path (no ``--mecefo``);
* each policy (``neighbor``, ``spread``, ``exact``, ``drop``) under the paper's low / mid /
  high scenario (MeCeFO Table 1), compressed into the run: ``--horizon-hours`` of the
  scenario map onto ``--train-iters`` iterations. The paper's rates are for its 32 replicas;
  here each replica fails as often as one of the paper's (``reference_replicas=32``), so the
  share of the batch that is taken over matches the paper's rather than being 8x larger.
  Every policy of one (scenario, seed) replays the same failure trace.

``--virtual-replicas N`` runs the same study at the paper's scale without N processes: every
run is one process with ``--mecefo-virtual-replicas N`` (the example trainer's single-process
simulation of N replicas under the same plan and re-weighting,
``megatron_mecefo/takeover/virtual_replicas.py``), the failure-free one included (with
``--mecefo`` and no failure, every factor is 1). ``--jobs`` runs that many at once.
``--policies`` may include ``auto`` (the recovery planner).

Seeds (model init, data order and the failure victims): the failure-free runs and the
``--every-seed-scenarios`` (default: high) run with every seed; the other scenarios with the
first seed only, which keeps ``make bench`` under 30 minutes on 2 cores. A gap is compared with
the failure-free seed-to-seed spread and with the same run's gap under the other seed.

Each run writes its metrics (JSON lines) and log under ``--output-dir``; the summary
(``convergence.json``) holds, per run, the validation curve, the final validation loss and
perplexity, the degraded iterations, skipped samples and the logged gradient relative error,
and per (policy, scenario) the perplexity gap to the failure-free run of the same seed.

Usage (repo root): ``.venv/bin/python examples/pretrain_gpt/convergence.py [flags]``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a plain script from the repo root

from megatron_mecefo.takeover.failure_schedule import PAPER_SCENARIOS, FailureSchedule  # noqa: E402
from megatron_mecefo.takeover.policies import POLICIES  # noqa: E402

TRAINER = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt.py"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Flags; the defaults are what ``make bench`` runs."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks = DP replicas (PP = TP = 1)")
    p.add_argument(
        "--virtual-replicas",
        type=int,
        default=None,
        metavar="N",
        help="simulate N DP replicas in one process per run (--mecefo-virtual-replicas) "
        "instead of --nproc ranks",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each its own ranks)")
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup-iters", type=int, default=10)
    p.add_argument(
        "--seq-length", type=int, default=None, help="the trainer's (default: its own, 128)"
    )
    p.add_argument(
        "--hidden-size", type=int, default=None, help="the trainer's (default: its own, 128)"
    )
    p.add_argument(
        "--ffn-hidden-size", type=int, default=None, help="the trainer's (default: its own)"
    )
    p.add_argument("--adam-beta2", type=float, default=0.999)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--mecefo-rank", type=int, default=32)
    p.add_argument(
        "--grad-error-interval",
        type=int,
        default=5,
        help="log the gradient relative error every N-th degraded iteration",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235])
    p.add_argument(
        "--every-seed-scenarios",
        nargs="*",
        choices=list(PAPER_SCENARIOS),
        default=["high"],
        help="scenarios run with every seed; the others run with the first seed only (the "
        "failure-free run always uses every seed)",
    )
    p.add_argument(
        "--policies", nargs="+", choices=sorted(POLICIES) + ["auto"], default=list(POLICIES)
    )
    p.add_argument(
        "--scenarios", nargs="+", choices=list(PAPER_SCENARIOS), default=list(PAPER_SCENARIOS)
    )
    p.add_argument(
        "--horizon-hours",
        type=float,
        default=24.0,
        help="hours of the paper's scenario compressed into --train-iters iterations",
    )
    p.add_argument(
        "--reference-replicas",
        type=int,
        default=32,
        help="the scenario's failure interval is that of a cluster this large (the paper's)",
    )
    p.add_argument("--data-path", default="data/stdlib_text_document")
    p.add_argument("--output-dir", default="results/convergence")
    p.add_argument("--master-port", type=int, default=29561)
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep finished runs: those with a run directory, and those recorded in "
        "--output-dir's convergence.json under the same recipe (a fresh clone's committed "
        "study); share the queue with other --reuse invocations on the same --output-dir (each "
        "run is claimed by one)",
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="auto-last",
        help="queue order (see ORDERS); with --reuse, invocations with different orders share "
        "the queue",
    )
    p.add_argument(
        "--summarize-only",
        action="store_true",
        help="run nothing: write convergence.json from the finished runs (a seed counts for a "
        "policy when its failure-free run and the policy's finished)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of the same study: 60 iterations (warm-up at most 20, evaluation "
        "every 20), the first two seeds; too short to resolve a gap",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.train_iters, args.eval_interval = 60, 20
        args.lr_warmup_iters = min(args.lr_warmup_iters, 20)
        args.seeds = args.seeds[:2]
    replicas = args.virtual_replicas or args.nproc
    which = "--virtual-replicas" if args.virtual_replicas else "--nproc"
    if args.global_batch_size % (args.micro_batch_size * replicas):
        p.error(
            f"--global-batch-size={args.global_batch_size} must be a multiple of "
            f"--micro-batch-size x {which} = {args.micro_batch_size * replicas}"
        )
    if args.jobs < 1:
        p.error(f"--jobs={args.jobs}: must be at least 1")
    if not Path(args.data_path + ".bin").exists():
        p.error(f"--data-path={args.data_path}: no {args.data_path}.bin; run `make data` first")
    return args


ORDERS = ("auto-last", "auto-first", "priority", "priority-auto-first")
"""Queue orders (a stable sort of the seed-major job list): ``auto-last``: auto's runs after
every fixed policy's; ``priority``: failure-free, ``neighbor`` and ``spread`` of every seed,
then ``auto``, then the rest (``exact``, ``drop``), so that a study cut short by the time has
the pairs the planner's goal needs; the ``-auto-first`` variants put auto's runs first (a
second worker started once the planner is ready)."""


def queue_rank(policy: Optional[str], order: str) -> int:
    """The sort key of a run of ``policy`` (None: failure-free) in ``order``."""
    auto_first = order.endswith("auto-first")
    if policy == "auto":
        return -1 if auto_first else (1 if order.startswith("priority") else 2)
    if order.startswith("priority"):
        return 0 if policy in (None, "neighbor", "spread") else 2
    return 0


def seeds_scenarios(args: argparse.Namespace, seed: int) -> List[str]:
    """The scenarios run with ``seed``."""
    first = seed == args.seeds[0]
    return [s for s in args.scenarios if first or s in args.every_seed_scenarios]


def run_name(policy: Optional[str], scenario: Optional[str], seed: int) -> str:
    """Directory name of one run."""
    return f"seed{seed}_failure-free" if policy is None else f"seed{seed}_{scenario}_{policy}"


def torchrun_command(nproc: int, port: int, flags: List[str]) -> List[str]:
    """``torchrun`` of the example trainer with ``flags``, from this Python's environment."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={port}",
        str(TRAINER),
        *flags,
    ]


def num_replicas(args: argparse.Namespace) -> int:
    """The data-parallel size of the study (simulated or real)."""
    return args.virtual_replicas or args.nproc


def trainer_command(args: argparse.Namespace, seed: int, metrics: Path, port: int) -> List[str]:
    """The torchrun command of one run, without its MeCeFO flags."""
    virtual = args.virtual_replicas
    return torchrun_command(
        1 if virtual else args.nproc,
        port,
        [
            *(["--mecefo-virtual-replicas", str(virtual)] if virtual else []),
            "--data-path",
            args.data_path,
            "--split",
            "98,2,0",
            "--micro-batch-size",
            str(args.micro_batch_size),
            "--global-batch-size",
            str(args.global_batch_size),
            "--train-iters",
            str(args.train_iters),
            "--lr",
            str(args.lr),
            "--min-lr",
            str(args.min_lr),
            "--lr-warmup-iters",
            str(args.lr_warmup_iters),
            *(["--seq-length", str(args.seq_length)] if args.seq_length else []),
            *(["--hidden-size", str(args.hidden_size)] if args.hidden_size else []),
            *(["--ffn-hidden-size", str(args.ffn_hidden_size)] if args.ffn_hidden_size else []),
            "--adam-beta2",
            str(args.adam_beta2),
            "--clip-grad",
            str(args.clip_grad),
            "--log-interval",
            str(args.eval_interval),
            "--eval-interval",
            str(args.eval_interval),
            "--eval-iters",
            str(args.eval_iters),
            "--seed",
            str(seed),
            "--metrics-file",
            str(metrics),
        ],
    )


DONE = "done"
"""A run's marker file, written when its trainer exited cleanly (its wall seconds)."""

CLAIM = "claim"


def done_wall_s(run_dir: Path) -> Optional[float]:
    """The wall seconds a finished run's DONE marker holds (None: not a number)."""
    try:
        return float((run_dir / DONE).read_text().split()[0])
    except (IndexError, ValueError):
        return None


SUMMARY = "convergence.json"

NOT_RECIPE = (
    "reuse",
    "order",
    "jobs",
    "summarize_only",
    "master_port",
    "output_dir",
    "policies",
    "seeds",
    "scenarios",
    "every_seed_scenarios",
)
"""Flags that do not change what one run computes (which runs there are, how many at once, on
which port): a run recorded under a config that differs from this one only in them is the
same run (its name holds its policy, scenario and seed)."""


def recipe(config: Dict[str, Any]) -> Dict[str, Any]:
    """The flags of ``config`` (``vars(args)`` or a summary's ``config``) that a run depends on."""
    skip = set(NOT_RECIPE) | {"model", "layout", "nominal_step_time_s"}
    return {k: v for k, v in config.items() if k not in skip}


def recorded_runs(
    out: Path, args: argparse.Namespace, schedules: Dict[str, Any]
) -> Dict[str, Dict[str, Any]]:
    """The runs already summarized in ``out/convergence.json`` that this invocation may reuse.

    A fresh clone has the committed summary but not the run directories (they are not
    committed): ``--reuse`` takes a run from the summary when the summary's recipe is this
    invocation's (every flag but those in NOT_RECIPE) and, for a failure run, its scenario's
    failure trace is the one this invocation replays. Anything else (no summary, another recipe,
    another trace) gives no run, so it runs again.
    """
    path = out / SUMMARY
    if not path.exists():
        return {}
    try:
        old = json.loads(path.read_text())
        config, runs = old["config"], old["runs"]
    except (ValueError, KeyError, TypeError):
        return {}
    if recipe(config) != recipe(vars(args)):
        return {}
    kept: Dict[str, Dict[str, Any]] = {}
    for name, run in runs.items():
        if run.get("scenario") is not None:
            key = f"seed{run['seed']}_{run['scenario']}"
            fresh = json.loads(json.dumps(schedules.get(key)))  # the summary's JSON types
            if fresh is None or old.get("schedules", {}).get(key) != fresh:
                continue  # another failure trace (or one this invocation does not replay)
        kept[name] = run
    return kept


def claim(run_dir: Path) -> bool:
    """Take ``run_dir`` for this process (False: another invocation took it first).

    Lets a second ``--reuse`` invocation on the same output directory share the queue, e.g. to
    add a worker while the first runs.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(run_dir / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def run_trainer(cmd: List[str], run_dir: Path) -> float:
    """Run one training job; its output goes to ``log.txt``. Returns the wall seconds."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if proc.returncode != 0:
        tail = (run_dir / "log.txt").read_text().splitlines()[-30:]
        raise RuntimeError(
            f"run {run_dir.name} failed (exit {proc.returncode}):\n" + "\n".join(tail)
        )
    return time.perf_counter() - started


def read_metrics(path: Path) -> Dict[str, Any]:
    """The training curve, validation curve and MeCeFO counters of one metrics file."""
    train, evals = [], []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "train":
            train.append(rec)
        elif rec["type"] == "eval":
            evals.append(rec)
    mecefo = [r.get("mecefo", {}) for r in train]
    errors = [
        (r["iteration"], r["mecefo"]["grad_rel_error"])
        for r in train
        if "grad_rel_error" in r.get("mecefo", {})
    ]
    probes = []  # each logged error with the shares of its plan (the error model's inputs)
    for r in train:
        m = r.get("mecefo", {})
        if "grad_rel_error" not in m:
            continue
        total = sum(m["microbatches_per_replica"]) + m.get("microbatches_skipped", 0)
        planner = m.get("planner", {})
        probes.append(
            {
                "iteration": r["iteration"],
                "error": m["grad_rel_error"],
                "failed": len(m["failed_replicas"]),
                "takeover_share": m["takeover_microbatches"] / total,
                "samples_lost_share": m.get("microbatches_skipped", 0) / total,
                "policy": planner.get("policy", m.get("policy")),
                "rank": planner.get("rank"),
                "predicted": planner.get("predicted_grad_error"),
            }
        )
    # auto: its decision per iteration (the policy run, predicted throughput and error)
    planner = [
        {
            "policy": r["mecefo"]["planner"].get("policy"),
            "rank": r["mecefo"]["planner"].get("rank"),
            "throughput_rel": r["mecefo"]["planner"].get("predicted_throughput_rel"),
            "grad_error": r["mecefo"]["planner"].get("predicted_grad_error"),
        }
        for r in train
        if "planner" in r.get("mecefo", {})
    ]
    return {
        "loss": [r["loss"] for r in train],
        "failed_replicas": [m.get("failed_replicas", []) for m in mecefo],
        "valid": [(e["iteration"], e["loss"]) for e in evals],
        "final_valid_loss": evals[-1]["loss"],
        "final_valid_ppl": evals[-1]["ppl"],
        "degraded_iterations": sum(bool(m.get("degraded")) for m in mecefo),
        "no_update_iterations": sum(bool(m.get("no_update")) for m in mecefo),
        "samples_skipped": sum(m.get("samples_skipped", 0) for m in mecefo),
        "takeover_microbatches": sum(m.get("takeover_microbatches", 0) for m in mecefo),
        "fallback_iterations": sum(bool(m.get("fallback")) for m in mecefo),
        "grad_rel_error": errors,
        "grad_error_probes": probes,
        **({"planner": planner} if planner else {}),
    }


def summarize(runs: Dict[str, Dict[str, Any]], args: argparse.Namespace) -> Dict[str, Any]:
    """Per (policy, scenario): perplexity gaps to the same seed's failure-free run."""
    # (--summarize-only: a seed counts for a policy when both of its runs finished)
    ff = {s: runs[run_name(None, None, s)] for s in args.seeds if run_name(None, None, s) in runs}
    ff_ppl = [r["final_valid_ppl"] for r in ff.values()]
    table: Dict[str, Dict[str, Any]] = {}
    for scenario in args.scenarios:
        for policy in args.policies:
            seeds = [
                s
                for s in args.seeds
                if scenario in seeds_scenarios(args, s)
                and s in ff
                and run_name(policy, scenario, s) in runs
            ]
            if not seeds:
                continue
            per_seed = [runs[run_name(policy, scenario, s)] for s in seeds]
            gaps = [
                100.0 * (r["final_valid_ppl"] / ff[s]["final_valid_ppl"] - 1.0)
                for r, s in zip(per_seed, seeds, strict=True)
            ]
            errors = [e for r in per_seed for _, e in r["grad_rel_error"]]
            table[f"{scenario}/{policy}"] = {
                "scenario": scenario,
                "policy": policy,
                "seeds": seeds,
                "valid_ppl": [r["final_valid_ppl"] for r in per_seed],
                "valid_loss": [r["final_valid_loss"] for r in per_seed],
                "ppl_gap_pct": gaps,
                "ppl_gap_pct_mean": statistics.fmean(gaps),
                "degraded_iterations": [r["degraded_iterations"] for r in per_seed],
                "samples_skipped": [r["samples_skipped"] for r in per_seed],
                "fallback_iterations": [r["fallback_iterations"] for r in per_seed],
                "grad_rel_error_mean": statistics.fmean(errors) if errors else None,
                "grad_rel_error_max": max(errors) if errors else None,
            }
    last = [r["valid"] for r in ff.values()]
    return {
        "failure_free": {
            "valid_ppl": ff_ppl,
            "seeds": list(ff),
            "valid_loss": [r["final_valid_loss"] for r in ff.values()],
            # Seed-to-seed spread: the noise floor a gap must clear to mean anything.
            "seed_spread_ppl_pct": (
                100.0 * (max(ff_ppl) - min(ff_ppl)) / min(ff_ppl) if len(ff_ppl) > 1 else None
            ),
            # How flat the curve is at the end: the change over the last evaluation interval.
            "last_interval_valid_loss_change": [v[-1][1] - v[-2][1] for v in last if len(v) > 1],
        },
        "runs": table,
    }


def format_table(summary: Dict[str, Any]) -> str:
    """The README table: one row per (scenario, policy)."""
    ff = summary["failure_free"]
    ppl = " / ".join(f"{p:.3f}" for p in ff["valid_ppl"])
    lines = [
        (
            f"failure-free valid ppl per seed: {ppl} (seed spread {ff['seed_spread_ppl_pct']:.2f}%)"
            if ff["seed_spread_ppl_pct"] is not None
            else f"failure-free valid ppl: {ppl}"
        ),
        "| scenario | policy | valid ppl per seed | ppl gap % per seed | mean gap % "
        "| degraded iters | samples skipped | grad rel error mean / max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["runs"].values():
        err = (
            "-"
            if row["grad_rel_error_mean"] is None
            else f"{row['grad_rel_error_mean']:.3f} / {row['grad_rel_error_max']:.3f}"
        )
        lines.append(
            f"| {row['scenario']} | {row['policy']} | "
            + " / ".join(f"{p:.3f}" for p in row["valid_ppl"])
            + " | "
            + " / ".join(f"{g:+.2f}" for g in row["ppl_gap_pct"])
            + f" | {row['ppl_gap_pct_mean']:+.2f} | "
            + " / ".join(str(d) for d in row["degraded_iterations"])
            + " | "
            + " / ".join(str(d) for d in row["samples_skipped"])
            + f" | {err} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    """Run every job (sequentially: the ranks already fill the cores), then summarize."""
    args = parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    step_time_s = args.horizon_hours * 3600.0 / args.train_iters
    jobs: List[tuple] = []
    schedules: Dict[str, Any] = {}
    n = num_replicas(args)
    for seed in args.seeds:
        # A simulated failure-free run goes through the controller too (every factor 1).
        # (its r is the policies': an r above --hidden-size is refused even with no failure)
        ff_flags = ["--mecefo", "--mecefo-rank", str(args.mecefo_rank)]
        jobs.append((None, None, seed, ff_flags if args.virtual_replicas else []))
        for scenario in seeds_scenarios(args, seed):
            schedule = FailureSchedule.paper(
                scenario,
                n,
                args.train_iters,
                step_time_s,
                seed,
                reference_replicas=args.reference_replicas,
            )
            trace = out / f"trace_seed{seed}_{scenario}.json"
            trace.write_text(json.dumps(schedule.to_json(), indent=1) + "\n")
            schedules[f"seed{seed}_{scenario}"] = {
                "description": schedule.description,
                **schedule.to_json(),
                "degraded_iterations": schedule.degraded_iterations(args.train_iters),
            }
            for policy in args.policies:
                flags = [
                    "--mecefo",
                    "--mecefo-policy",
                    policy,
                    "--mecefo-rank",
                    str(args.mecefo_rank),
                    "--mecefo-failure-schedule",
                    "replay",
                    "--mecefo-failure-trace",
                    str(trace),
                    "--mecefo-grad-error-interval",
                    str(args.grad_error_interval),
                ]
                jobs.append((policy, scenario, seed, flags))

    runs: Dict[str, Dict[str, Any]] = {}
    started = time.perf_counter()
    ports: queue.Queue = queue.Queue()
    for k in range(args.jobs):
        ports.put(args.master_port + k)

    jobs.sort(key=lambda job: queue_rank(job[0], args.order))
    # Runs the committed summary already holds (a fresh clone has no run directories).
    recorded = recorded_runs(out, args, schedules) if args.reuse or args.summarize_only else {}

    def one(i: int, job: tuple) -> None:
        if args.summarize_only:
            return
        policy, scenario, seed, flags = job
        name = run_name(policy, scenario, seed)
        run_dir = out / name
        metrics = run_dir / "metrics.jsonl"
        if args.reuse and ((run_dir / DONE).exists() or name in recorded):
            return
        if args.reuse and not claim(run_dir):
            return  # another --reuse invocation on the same --output-dir runs it
        if metrics.exists():
            metrics.unlink()  # the trainer appends
        port = ports.get()  # one port per concurrent run
        try:
            wall = run_trainer(trainer_command(args, seed, metrics, port) + flags, run_dir)
        except BaseException:
            (run_dir / CLAIM).unlink(missing_ok=True)  # a later --reuse runs it again
            raise
        finally:
            ports.put(port)
        (run_dir / DONE).write_text(f"{wall:.1f}\n")
        print(f"[{i}/{len(jobs)}] {name}: {wall:.0f} s", flush=True)

    # A thread per concurrent run: each waits on its trainer's processes.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for future in [pool.submit(one, i, job) for i, job in enumerate(jobs, 1)]:
            future.result()
    reused = 0
    for policy, scenario, seed, _ in jobs:
        name = run_name(policy, scenario, seed)
        run_dir = out / name
        if not (run_dir / DONE).exists() and name in recorded:
            runs[name] = recorded[name]  # from the summary (its directory is gone)
            reused += 1
            continue
        if args.summarize_only and not (run_dir / DONE).exists():
            continue
        while not (run_dir / DONE).exists():  # claimed by another invocation: wait for it
            time.sleep(10)
        metrics = run_dir / "metrics.jsonl"
        runs[name] = {
            "policy": policy,
            "scenario": scenario,
            "seed": seed,
            "wall_s": done_wall_s(run_dir),
            **read_metrics(metrics),
        }

    summary = summarize(runs, args)
    result = {
        "benchmark": "convergence",
        "config": {
            **{
                k: v
                for k, v in vars(args).items()
                if k not in ("reuse", "order", "jobs", "summarize_only")
            },
            "model": "example trainer default: 4 layers, hidden 128, FFN 320 (SwiGLU), 4 heads, "
            "seq 128, RMSNorm, RoPE, byte vocab 384",
            "layout": (
                f"DP {n} simulated in one process (--mecefo-virtual-replicas), CPU"
                if args.virtual_replicas
                else f"DP {args.nproc} (TP 1, PP 1), gloo, CPU"
            ),
            "nominal_step_time_s": step_time_s,
        },
        "schedules": schedules,
        "summary": summary,
        "runs": runs,
        "wall_time_s": time.perf_counter() - started,
    }
    # Compact: the per-iteration curves of 18 runs are 2 MB indented.
    (out / SUMMARY).write_text(json.dumps(result, separators=(",", ":")) + "\n")
    print(format_table(summary))
    rows = summary["runs"].values()
    high = {r["policy"]: r["ppl_gap_pct_mean"] for r in rows if r["scenario"] == "high"}
    spread = summary["failure_free"]["seed_spread_ppl_pct"]
    print(
        "convergence: "
        + " ".join(f"high/{p} ppl gap {g:+.2f}%" for p, g in high.items())
        + (f" (failure-free seed spread {spread:.2f}%)" if spread is not None else "")
        + f" runs={len(jobs)} (from {SUMMARY}: {reused}) wall={result['wall_time_s']:.0f}s"
    )


if __name__ == "__main__":
    main()
