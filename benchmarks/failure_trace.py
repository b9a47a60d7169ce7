"""Time-averaged throughput of every policy under failure traces, at n = 8, 32 and 128.

Each trace is a real
:class:`~megatron_mecefo.takeover.failure_schedule.FailureSchedule` (the paper's
low / mid / high scenario, and a Poisson trace) over ``--hours`` of training at a nominal
``--step-time``. Every iteration is planned by the real policy object and timed by
:class:`megatron_mecefo.planner.step_cost_model.StepCostModel` with the costs measured by
``benchmarks/degraded_throughput.py`` (c, optimizer, sync). Transition costs are counted:

* **basis computation**: a replica running takeover micro-batches computes V for its FFN
  weights when it has none younger than τ steps (``MecefoState.basis_is_stale``): on entering
  takeover, and every τ steps while it stays there. The cost is ``takeover_cost.py``'s measured
  refresh, on that replica's critical path;
* **data re-mapping**: the plan and its exactly-once accounting, timed here on the real
  ``TakeoverPolicy.plan`` and ``GlobalBatchLayout.account``, on every iteration whose failed set
  changed. Reading an absorbed micro-batch by index costs what reading an own one costs and is
  inside the measured micro-batch cost.

Failure detection, process restart and communicator rebuilds are not in the model: this
plugin's failures are simulated (the process stays), so they cost nothing here and would be
the same for every policy.

Rates: the paper's scenarios are for its 32 replicas. At other n, by default each replica fails
as often as one of the paper's (``per-replica``); ``cluster`` keeps the paper's cluster-wide
rate. Both are in the JSON; the table shows ``per-replica`` (the two agree at n = 32).

Usage (repo root, after ``degraded_throughput.py``): ``.venv/bin/python
benchmarks/failure_trace.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for path in (BENCH, REPO):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from megatron_mecefo.planner.step_cost_model import StepCostModel  # noqa: E402
from megatron_mecefo.takeover.data_remap import GlobalBatchLayout  # noqa: E402
from megatron_mecefo.takeover.failure_schedule import FailureSchedule  # noqa: E402
from megatron_mecefo.takeover.plan import TAKEOVER  # noqa: E402
from megatron_mecefo.takeover.policies import POLICIES, build_policy  # noqa: E402
from megatron_mecefo.techniques.config import MecefoConfig  # noqa: E402

# MeCeFO Table 2 (paper), LLaMA-7B on 32 A100s, high-frequency failures: throughput drop in %.
PAPER_7B_HIGH_DROP = {"MeCeFO (paper)": 4.18, "Bamboo (paper)": 20.84, "Oobleck (paper)": 28.09}
REFERENCE_REPLICAS = 32


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Flags; the defaults are what ``make bench`` runs."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--throughput", default="results/degraded_throughput.json")
    p.add_argument("--n", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--hours", type=float, default=72.0, help="length of each trace")
    p.add_argument(
        "--step-time", type=float, default=10.0, help="nominal failure-free step time (s)"
    )
    p.add_argument("--microbatches", type=int, default=None, help="default: the grid's")
    p.add_argument("--mtbf-hours", type=float, default=16.0, help="Poisson, per replica")
    p.add_argument("--mttr-hours", type=float, default=2.0, help="Poisson, per replica")
    p.add_argument(
        "--basis-interval", type=int, default=MecefoConfig.basis_interval, help="τ (steps)"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--output", default="results/failure_trace.json")
    args = p.parse_args(argv)
    if not Path(args.throughput).exists():
        p.error(
            f"--throughput={args.throughput} does not exist; run "
            "benchmarks/degraded_throughput.py first (or `make bench`)"
        )
    return args


def build_schedule(
    scenario: str, n: int, iters: int, args: argparse.Namespace, rate: str
) -> FailureSchedule:
    """The trace of one scenario at n replicas (``rate``: per-replica or cluster)."""
    if scenario == "poisson":
        return FailureSchedule.poisson(
            n, iters, args.step_time, args.mtbf_hours, args.mttr_hours, args.seed
        )
    ref = REFERENCE_REPLICAS if rate == "per-replica" else None
    return FailureSchedule.paper(scenario, n, iters, args.step_time, args.seed, ref)


def time_remap_ms(
    policy: str, sets: List[FrozenSet[int]], n: int, m: int, samples: int = 16
) -> float:
    """Median wall ms of a real plan + exactly-once accounting (the data re-mapping).

    Timed on up to ``samples`` of the trace's distinct failed sets, spread over them in a fixed
    order, three calls each.
    """
    distinct = sorted(set(sets[1:]), key=lambda s: (len(s), sorted(s)))
    picked = distinct[:: max(1, len(distinct) // samples)][:samples]
    layout = GlobalBatchLayout(n * m, 1, n)
    obj = build_policy(policy)
    times = []
    for failed in picked:
        t0 = time.perf_counter()
        for _ in range(3):
            layout.account(obj.plan(1, failed, n, m), 0)
        times.append((time.perf_counter() - t0) / 3 * 1e3)
    return statistics.median(times)


def simulate(
    model: StepCostModel,
    sets: List[FrozenSet[int]],
    policy: str,
    n: int,
    m: int,
    refresh: float,
    remap: float,
    basis_interval: int,
) -> Dict[str, Any]:
    """Walk the trace (``sets``: ``FailureSchedule.failed_by_iteration``); returns the
    time-averaged throughput and the transition counts."""
    obj = build_policy(policy)
    # Per distinct failed set: the plan, the replicas running takeover micro-batches, and the
    # step time without transition costs (all down: nobody computes, the zero sync still runs).
    cache: Dict[FrozenSet[int], tuple] = {}
    last_basis: Dict[int, int] = {}
    total = processed = transition_time = 0.0
    refreshes = transitions = degraded = 0
    prev: FrozenSet[int] = frozenset()
    for it in range(1, len(sets)):
        failed = sets[it]
        if failed not in cache:
            plan = obj.plan(it, failed, n, m)
            takeover = [r for r in range(n) if any(mb.mode is TAKEOVER for mb in plan.work[r])]
            base = model.sync_time(n) if plan.no_update else model.step_time(plan)
            cache[failed] = (plan, takeover, base)
        plan, takeover, base = cache[failed]
        # A basis computation is on its replica's critical path, like MecefoState's refresh.
        extra: Dict[int, float] = {}
        for r in takeover:
            if r not in last_basis or it - last_basis[r] >= basis_interval:
                last_basis[r] = it
                extra[r] = refresh
        refreshes += len(extra)
        step = model.step_time(plan, extra) if extra else base
        if failed != prev:  # every rank re-plans: the whole step waits for it
            transitions += 1
            step += remap
        prev = failed
        degraded += bool(failed)
        transition_time += step - base
        total += step
        processed += plan.processed
    iters = len(sets) - 1
    healthy = model.failure_free_time(n, m)
    rel = (processed / (iters * n * m)) * (iters * healthy) / total
    return {
        "throughput_rel": rel,
        "drop_pct": 100.0 * (1.0 - rel),
        "samples_skipped_pct": 100.0 * (1.0 - processed / (iters * n * m)),
        "degraded_iterations_pct": 100.0 * degraded / iters,
        "transitions": transitions,
        "basis_computations": refreshes,
        "transition_time_pct": 100.0 * transition_time / total,
    }


def main(argv: Optional[List[str]] = None) -> None:
    """Every (n, scenario, rate, policy); JSON, the table and a summary line."""
    args = parse_args(argv)
    started = time.perf_counter()
    dt = json.loads(Path(args.throughput).read_text())
    model = StepCostModel(**{k: v for k, v in dt["model"].items() if k != "c"})
    m = args.microbatches or dt["config"]["grid_microbatches_per_replica"]
    unit_ms = dt["takeover_cost"]["per_microbatch"]["exact_ms"]
    refresh = dt["takeover_cost"]["basis_refresh_ms"] / unit_ms
    iters = int(round(args.hours * 3600.0 / args.step_time))
    rows: List[Dict[str, Any]] = []
    for n in args.n:
        rates = ["per-replica"] if n == REFERENCE_REPLICAS else ["per-replica", "cluster"]
        for rate in rates:
            for scenario in ("low", "mid", "high", "poisson"):
                if scenario == "poisson" and rate == "cluster":
                    continue  # Poisson rates are per replica by definition
                schedule = build_schedule(scenario, n, iters, args, rate)
                sets = schedule.failed_by_iteration(iters)
                concurrent = statistics.fmean(len(s) for s in sets[1:])
                for policy in POLICIES:
                    remap = time_remap_ms(policy, sets, n, m) / unit_ms
                    res = simulate(model, sets, policy, n, m, refresh, remap, args.basis_interval)
                    rows.append(
                        {
                            "n": n,
                            "rate": rate,
                            "scenario": scenario,
                            "policy": policy,
                            "schedule": schedule.description,
                            "events": len(schedule.events),
                            "mean_failed": concurrent,
                            "remap_exact_microbatches": remap,
                            **res,
                        }
                    )
    result = {
        "benchmark": "failure_trace",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "config": {
            "hours": args.hours,
            "nominal_step_time_s": args.step_time,
            "iterations": iters,
            "microbatches_per_replica": m,
            "poisson_mtbf_h_per_replica": args.mtbf_hours,
            "poisson_mttr_h_per_replica": args.mttr_hours,
            "basis_interval": args.basis_interval,
            "seed": args.seed,
            "reference_replicas": REFERENCE_REPLICAS,
            "cost_model": dt["model"],
            "basis_refresh_exact_microbatches": refresh,
            "cost_source": f"{args.throughput} (shape {dt['config']['cost_shape']}, "
            f"{dt['config']['cost_device']})",
        },
        "paper_7b_high_drop_pct": PAPER_7B_HIGH_DROP,
        "rows": rows,
        "wall_time_s": time.perf_counter() - started,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(rows))
    high32 = {r["policy"]: r["drop_pct"] for r in rows if r["n"] == 32 and r["scenario"] == "high"}
    print(
        "failure_trace: n=32 high-frequency time-averaged drop "
        + " ".join(f"{p} {d:.2f}%" for p, d in high32.items())
        + " | paper 7B: "
        + " ".join(f"{k} {v}%" for k, v in PAPER_7B_HIGH_DROP.items())
    )


def format_table(rows: List[Dict[str, Any]]) -> str:
    """The README table: drop % per policy, per-replica rates."""
    lines = [
        "| n | scenario | mean replicas down | degraded iterations | "
        + " | ".join(f"{p}: drop %" for p in POLICIES)
        + " | drop policy: samples skipped |",
        "|---|---|---|---|" + "---|" * len(POLICIES) + "---|",
    ]
    keyed = {(r["n"], r["rate"], r["scenario"], r["policy"]): r for r in rows}
    for (n, rate, scenario, policy), r in keyed.items():
        if rate != "per-replica" or policy != next(iter(POLICIES)):
            continue
        drops = " | ".join(f"{keyed[(n, rate, scenario, p)]['drop_pct']:.2f}%" for p in POLICIES)
        lines.append(
            f"| {n} | {scenario} | {r['mean_failed']:.2f} | {r['degraded_iterations_pct']:.0f}% "
            f"| {drops} | {keyed[(n, rate, scenario, 'drop')]['samples_skipped_pct']:.2f}% |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
