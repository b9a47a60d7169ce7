"""Cluster-scale simulator: failure traces through the real planner and the real policies.

For every trace, replica count n and policy (each fixed policy and ``auto``), the trace is cut
into segments where the failed set is constant. Each segment is costed by the recovery planner
(:mod:`megatron_mecefo.planner.recovery_planner`): the policy's plan (the real policy objects up
to ``REAL_PLAN_LIMIT`` micro-batches, their O(1) counts above, tested equal; with at most half
the replicas down the counts depend on k alone, so one decision per k), its step time,
the samples it skips, its takeover share and its transition cost (basis computation on entering
takeover; measured regroup + rejoin for ``shrink``). ``auto`` is
:func:`~megatron_mecefo.planner.recovery_planner.plan_recovery` with the trace's failure and
repair rates and the default budgets (no sample lost, any takeover share, shrink allowed).

Time is wall-clock: a segment of D seconds with transition C runs ``D - C`` seconds at the
segment's throughput (samples/s relative to failure-free). Outputs per row: time-averaged
throughput and its drop, samples lost, takeover share of the processed micro-batches, time in
transitions, and beside them the time-averaged physical limits ``(n-k)/n`` (exact methods) and
``1/(1 + c k/(n-k))`` (takeover at the profile's c without recompute).

Traces:

* ``low`` / ``mid`` / ``high``: MeCeFO Table 1 taken literally for the whole cluster (a failure
  every 2 / 1 / 0.5 h, each replica back after 4 / 3 / 2 h; victims uniform among the replicas
  up, seeded). ``benchmarks/failure_trace.py`` has the per-replica scaling;
* ``poisson-meta``: Poisson failures at Meta's published rate, MTTF 7.9 h for a 1,024-GPU job
  (Meta RSC reliability study, arXiv 2410.21680, as quoted in docs/landscape.md; the doc grades
  the number "B", quoted by a third party), i.e. one failure per 7.9 x 1024 GPU-hours, with
  ``--gpus-per-replica`` GPUs per replica and an assumed MTTR (``--mttr-hours``, default 2 h:
  Meta's figure is for interruptions, not repairs);
* ``json``: ``--trace FILE`` (the ``replay`` format of ``--mecefo-failure-trace``).

Profiles: ``llama7b``: the paper's setting, LLaMA-7B (h 4096, FFN 11008, 32 layers, seq 256,
vocab 32000), global batch 1024 sequences at micro-batch size 1 (M = 1024/n, at least 1), the
failure-free step 2.36 s (1024 x 256 tokens at the paper's 111.1k tokens/s); the micro-batch
costs from the FLOP model of ``benchmarks/takeover_cost.py`` (block + embedding/output head),
optimizer and gradient sync not modelled (compute-bound: the largest drop), regroup and rejoin
as measured on CPU. ``cpu-demo``: the calibrated profile of this machine
(``results/planner_profile.json``, demo model, M = 4).

Usage: ``.venv/bin/python benchmarks/cluster_sim.py`` (what ``make bench`` runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for path in (BENCH, REPO):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from takeover_cost import SHAPES, flop_model, memory_model  # noqa: E402

from megatron_mecefo.planner.calibration import load_profile  # noqa: E402
from megatron_mecefo.planner.recovery_planner import (  # noqa: E402
    CHOICES,
    CostProfile,
    Decision,
    FailureState,
    PlannerConfig,
    fixed_decision,
    plan_recovery,
)
from megatron_mecefo.planner.step_cost_model import limit_exact, limit_takeover  # noqa: E402
from megatron_mecefo.takeover.failure_schedule import (  # noqa: E402
    NEVER,
    PAPER_SCENARIOS,
    FailureEvent,
    FailureSchedule,
)

PAPER_DROP_PCT = 4.18  # MeCeFO Table 2, LLaMA-7B, 32 A100s, high frequency
META_GPU_HOURS_PER_FAILURE = 7.9 * 1024  # Meta RSC: MTTF 7.9 h at 1,024 GPUs
LLAMA7B_STEP_S = 1024 * 256 / 111.1e3  # paper: 111.1k tokens/s failure-free
POLICIES = CHOICES + ("auto", "auto-exact", "auto-loss")
"""Fixed choices, ``auto`` (default budgets: no sample lost; shrink allowed), ``auto-exact``
(approx budget 0: no takeover micro-batch) and ``auto-loss`` (up to 1% of a step's samples
may be skipped)."""


# ------------------------------------------------------------------------------ profiles
def llama7b_profile(calibrated: CostProfile, microbatches: int) -> CostProfile:
    """The paper's LLaMA-7B setting from the FLOP model (see the module docstring)."""
    shape = replace(SHAPES["llama-7b"], num_layers=32, seq_length=256)
    flops = flop_model(shape, core_attention_factor=0.5)["flops"]
    tokens = shape.seq_length * shape.micro_batch_size
    head = 3 * 2 * tokens * shape.hidden * shape.vocab  # output layer fwd + bwd (embedding ~0)
    exact = flops["exact"] + head
    mem = memory_model(shape)["elements"]
    exact_ms = LLAMA7B_STEP_S * 1e3 / microbatches
    per = exact_ms / exact  # ms per FLOP
    return CostProfile(
        exact_ms=exact_ms,
        takeover_ms=(flops["skip_lowrank"] + head) * per,
        takeover_recompute_ms=(flops["all"] + head) * per,
        optimizer_ms=0.0,
        sync_ms=0.0,
        sync_replicas=32,
        profile_rank=shape.rank,
        takeover_ms_per_rank=0.0,
        # The basis refresh as the same share of an exact micro-batch as measured on CPU.
        basis_refresh_ms=calibrated.basis_refresh_ms / calibrated.exact_ms * exact_ms,
        regroup_ms=calibrated.regroup_ms,
        rejoin_ms=calibrated.rejoin_ms,
        activation_exact_bytes=2.0 * mem["exact"],
        activation_takeover_bytes=2.0 * mem["skip_lowrank"],
        activation_takeover_recompute_bytes=2.0 * mem["all"],
        in_flight=1,
        source="FLOP model of benchmarks/takeover_cost.py at LLaMA-7B (32 layers, seq 256), "
        f"step {LLAMA7B_STEP_S:.2f} s at 32 replicas; regroup/rejoin: {calibrated.source}",
    )


# ------------------------------------------------------------------------------ traces
def paper_trace(scenario: str, n: int, hours: float, seed: int) -> Tuple[FailureSchedule, float]:
    """The paper's scenario for the whole cluster, in seconds (1 iteration = 1 s)."""
    every, recover = PAPER_SCENARIOS[scenario]
    sched = FailureSchedule.periodic(
        n, int(hours * 3600), every * 3600, recover * 3600, seed, f"paper {scenario} (cluster)"
    )
    return sched, 1.0


def batch_recovery_trace(n: int, hours: float, seed: int) -> Tuple[FailureSchedule, float]:
    """High frequency read as 'a failure every 0.5 h, every failed replica repaired at each
    2-hour mark' (the other reading of 'recovery every 2 h')."""
    rng = random.Random(seed)
    events = []
    t = 1800
    while t < hours * 3600:
        back = (t // 7200 + 1) * 7200
        up = [r for r in range(n) if all(not (e.replica == r and e.covers(t)) for e in events)]
        events.append(FailureEvent(t, back, rng.choice(up)))
        t += 1800
    return FailureSchedule(events, n, "paper high, batch repair every 2 h"), 1.0


def poisson_meta_trace(
    n: int, hours: float, gpus: int, mttr_h: float, seed: int
) -> Tuple[FailureSchedule, float]:
    """Poisson failures at Meta's per-GPU rate; 1 iteration = 10 s."""
    mtbf = META_GPU_HOURS_PER_FAILURE / gpus
    step = 10.0
    sched = FailureSchedule.poisson(n, int(hours * 3600 / step), step, mtbf, mttr_h, seed)
    return sched, step


def segments(sched: FailureSchedule, horizon: int) -> List[Tuple[int, int, frozenset]]:
    """(start, end, failed set) with the failed set constant on [start, end)."""
    changes: Dict[int, List[Tuple[int, int]]] = {}
    for e in sched.events:
        changes.setdefault(e.fail_iteration, []).append((e.replica, 1))
        if e.recover_iteration < NEVER:
            changes.setdefault(e.recover_iteration, []).append((e.replica, -1))
    out, down, t = [], set(), 0
    for at in sorted(changes):
        if at >= horizon:
            break
        if at > t:
            out.append((t, at, frozenset(down)))
        for r, d in sorted(changes[at], key=lambda x: x[1]):  # recoveries first
            (down.add if d > 0 else down.discard)(r)
        t = at
    out.append((t, horizon, frozenset(down)))
    return out


# ------------------------------------------------------------------------------ simulation
def decide(
    policy: str, failed: frozenset, n: int, m: int, prof: CostProfile, cfg: PlannerConfig
) -> Decision:
    """The decision of ``policy`` for one failed set."""
    state = FailureState(n, failed, m)
    if policy == "auto":
        return plan_recovery(state, prof, cfg)
    if policy == "auto-exact":
        return plan_recovery(state, prof, replace(cfg, approx_budget=0.0))
    if policy == "auto-loss":
        return plan_recovery(state, prof, replace(cfg, sample_loss_budget=0.01))
    return fixed_decision(policy, state, prof, cfg)


def simulate(
    segs: List[Tuple[int, int, frozenset]],
    step_s: float,
    n: int,
    m: int,
    prof: CostProfile,
    cfg: PlannerConfig,
) -> List[Dict[str, Any]]:
    """Every policy over the segments; one row each."""
    ff = prof.failure_free_step(n, m)
    total_s = sum(b - a for a, b, _ in segs) * step_s
    rows = []
    for policy in POLICIES:
        cache: Dict[Any, Decision] = {}
        work = trans = lost = takeover = processed = 0.0
        lim_e = lim_t = degraded = 0.0
        choices: Dict[str, float] = {}
        for a, b, failed in segs:
            k = len(failed)
            dur = (b - a) * step_s
            # With k <= n - k every plan's counts depend on k alone (analytic_shape, tested
            # equal to the real policies' plans): one decision per k.
            key = k if 2 * k <= n else failed
            d = cache.get(key)
            if d is None:
                d = cache[key] = decide(policy, failed, n, m, prof, cfg)
            # Every change to a degraded set pays the decision's transition (the planner's
            # model: new absorbers compute a basis; shrink regroups now and rejoins later).
            c = min(d.transition_ms / 1e3 if k else 0.0, dur)
            rel = 0.0 if k >= n else (1.0 - d.samples_lost_share) * ff / d.step_time_ms
            work += (dur - c) * rel
            trans += c
            run = (dur - c) * (1.0 - d.samples_lost_share) * ff / d.step_time_ms if k < n else 0
            processed += run
            lost += (dur - c) * d.samples_lost_share * ff / d.step_time_ms if k < n else 0
            takeover += run * d.takeover_share / max(1e-12, 1.0 - d.samples_lost_share)
            lim_e += dur * limit_exact(n, k)
            lim_t += dur * limit_takeover(n, k, prof.takeover_ms / prof.exact_ms)
            degraded += dur if k else 0.0
            if k:
                choices[d.policy] = choices.get(d.policy, 0.0) + dur
        thr = work / total_s
        rows.append(
            {
                "policy": policy,
                "throughput_rel": thr,
                "drop_pct": 100 * (1 - thr),
                "samples_lost_pct": 100 * lost / max(1e-12, lost + processed),
                "takeover_share_pct": 100 * takeover / max(1e-12, processed),
                "transition_time_pct": 100 * trans / total_s,
                "limit_exact_drop_pct": 100 * (1 - lim_e / total_s),
                "limit_takeover_drop_pct": 100 * (1 - lim_t / total_s),
                "degraded_time_pct": 100 * degraded / total_s,
                "choices_degraded_time_pct": {
                    p: 100 * t / max(1e-12, degraded) for p, t in sorted(choices.items())
                },
            }
        )
    return rows


def run_trace(
    name: str, sched: FailureSchedule, step_s: float, hours: float, n: int, m: int,
    prof: CostProfile, cfg: PlannerConfig,
) -> List[Dict[str, Any]]:  # fmt: skip
    """Simulate one trace; rows with the trace's facts."""
    horizon = int(round(hours * 3600 / step_s))
    segs = segments(sched, horizon)
    mean_down = sum((b - a) * len(f) for a, b, f in segs) / max(1, horizon)
    rows = simulate(segs, step_s, n, m, prof, cfg)
    for r in rows:
        r.update(trace=name, n=n, microbatches=m, events=len(sched.events), mean_down=mean_down)
    return rows


def planner_config(mtbf_h: float, mttr_h: float) -> PlannerConfig:
    """Default budgets, shrink allowed, the trace's rates."""
    return PlannerConfig(allow_shrink=True, mtbf_hours=mtbf_h, mttr_hours=mttr_h, rank_min=128,
                         rank_max=128)  # fmt: skip


def paper_table(calibrated: CostProfile, hours: float, seeds: List[int]) -> Dict[str, Any]:
    """LLaMA-7B, 32 replicas, high frequency, under each reading of the schedule."""
    n, m = 32, 32
    prof = llama7b_profile(calibrated, m)
    readings: Dict[str, List[Dict[str, Any]]] = {}

    def avg(rows_by_seed: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
        out = []
        for i, row in enumerate(rows_by_seed[0]):
            r = dict(row)
            for key in ("drop_pct", "samples_lost_pct", "takeover_share_pct",
                        "transition_time_pct", "limit_exact_drop_pct",
                        "limit_takeover_drop_pct", "degraded_time_pct", "mean_down"):  # fmt: skip
                r[key] = sum(rs[i][key] for rs in rows_by_seed) / len(rows_by_seed)
            out.append(r)
        return out

    cfg = planner_config(0.5 * n, 2.0)
    readings["literal: a failure every 0.5 h, each replica down 2 h"] = avg(
        [
            run_trace("high", *paper_trace("high", n, hours, s), hours, n, m, prof, cfg)
            for s in seeds
        ]
    )
    readings["a failure every 0.5 h, all repaired at each 2 h mark"] = avg(
        [run_trace("high-batch", *batch_recovery_trace(n, hours, s), hours, n, m, prof, cfg)
         for s in seeds]  # fmt: skip
    )
    # The outage length at which neighbor's drop is the paper's 4.18%, by bisection.
    lo, hi = 1.0, 7200.0
    for _ in range(30):
        mid = (lo + hi) / 2
        rows = run_trace("high-short", FailureSchedule.periodic(
            n, int(hours * 3600), 1800.0, mid, seeds[0], "short"), 1.0, hours, n, m, prof,
            planner_config(0.5 * n, mid / 3600))  # fmt: skip
        nb = next(r for r in rows if r["policy"] == "neighbor")["drop_pct"]
        lo, hi = (mid, hi) if nb < PAPER_DROP_PCT else (lo, mid)
    short = (lo + hi) / 2
    readings[f"a failure every 0.5 h, each down {short / 60:.1f} min (neighbor = 4.18%)"] = avg(
        [run_trace("high-short", FailureSchedule.periodic(n, int(hours * 3600), 1800.0, short, s,
                   "short"), 1.0, hours, n, m, prof, planner_config(0.5 * n, short / 3600))
         for s in seeds]  # fmt: skip
    )
    return {
        "profile": prof.to_json(),
        "c_no_recompute": prof.takeover_ms / prof.exact_ms,
        "c_recompute": prof.takeover_recompute_ms / prof.exact_ms,
        "neighbor_step_rel_one_failure": 2 * prof.takeover_ms / prof.exact_ms,
        "short_outage_min": short / 60,
        "readings": readings,
    }


def grid_states(prof: CostProfile, m: int = 4) -> List[Dict[str, Any]]:
    """Degraded states (k spaced replicas of n down): each fixed choice's amortised throughput
    (horizon at the paper's high rates) beside ``auto``'s, with its choice."""
    out = []
    for n in (4, 8, 32, 128):
        for k in (1, 2, 4):
            if k >= n:
                continue
            failed = frozenset(i * n // k for i in range(k))
            cfg = planner_config(0.5 * 32, 2.0)
            state = FailureState(n, failed, m)
            fixed = {p: fixed_decision(p, state, prof, cfg) for p in CHOICES}
            auto = plan_recovery(state, prof, cfg)
            lossless = max((d.throughput_rel, p) for p, d in fixed.items() if p != "drop")
            out.append(
                {
                    "n": n,
                    "k": k,
                    "fixed": {p: d.throughput_rel for p, d in fixed.items()},
                    "fixed_step_ms": {p: d.step_time_ms for p, d in fixed.items()},
                    "auto": auto.throughput_rel,
                    "auto_choice": f"{auto.policy}" + (" +recompute" if auto.recompute_ffn else ""),
                    "best_lossless_fixed": lossless[1],
                    "best_lossless_fixed_throughput": lossless[0],
                    "auto_minus_best_lossless": auto.throughput_rel - lossless[0],
                }
            )
    return out


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Flags; the defaults are what ``make bench`` runs."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default="results/planner_profile.json")
    p.add_argument("--n", type=int, nargs="+", default=[8, 32, 128, 512, 4096])
    p.add_argument("--days", type=float, default=30.0)
    p.add_argument("--gpus-per-replica", type=int, default=1)
    p.add_argument("--mttr-hours", type=float, default=2.0, help="poisson-meta repair time")
    p.add_argument("--trace", default=None, help="a JSON trace (replay format), also simulated")
    p.add_argument("--trace-step-s", type=float, default=10.0, help="seconds per trace iteration")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--output", default="results/cluster_sim.json")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Every (profile, trace, n); JSON, tables, one summary line."""
    args = parse_args(argv)
    started = time.perf_counter()
    calibrated = load_profile(args.profile)
    hours = args.days * 24
    rows: List[Dict[str, Any]] = []
    timings: Dict[str, float] = {}
    for n in args.n:
        t0 = time.perf_counter()
        m7 = max(1, 1024 // n)
        profiles = {"llama7b": llama7b_profile(calibrated, m7), "cpu-demo": calibrated}
        for pname, prof in profiles.items():
            m = m7 if pname == "llama7b" else 4
            traces = []
            for sc in ("low", "mid", "high"):
                every, rec = PAPER_SCENARIOS[sc]
                traces.append((sc, *paper_trace(sc, n, hours, args.seeds[0]),
                               planner_config(every * n, rec)))  # fmt: skip
            mtbf = META_GPU_HOURS_PER_FAILURE / args.gpus_per_replica
            traces.append(("poisson-meta", *poisson_meta_trace(
                n, hours, args.gpus_per_replica, args.mttr_hours, args.seeds[0]),
                planner_config(mtbf, args.mttr_hours)))  # fmt: skip
            if args.trace:
                sched = FailureSchedule.replay(args.trace, n, args.trace_step_s)
                traces.append(("json", sched, args.trace_step_s, planner_config(16.0, 2.0)))
            for name, sched, step_s, cfg in traces:
                for r in run_trace(name, sched, step_s, hours, n, m, prof, cfg):
                    r["profile"] = pname
                    rows.append(r)
        timings[str(n)] = time.perf_counter() - t0
    paper = paper_table(calibrated, hours, args.seeds)
    grid = grid_states(calibrated)
    result = {
        "benchmark": "cluster_sim",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "config": {
            "days": args.days,
            "gpus_per_replica": args.gpus_per_replica,
            "poisson_meta_gpu_hours_per_failure": META_GPU_HOURS_PER_FAILURE,
            "poisson_meta_mttr_h": args.mttr_hours,
            "seeds": args.seeds,
            "calibrated_profile": calibrated.to_json(),
            "paper_scenarios": "literal for the whole cluster",
        },
        "rows": rows,
        "paper_7b_high": paper,
        "grid_states_cpu_demo": grid,
        "paper_drop_pct": PAPER_DROP_PCT,
        "wall_time_s_per_n": timings,
        "wall_time_s": time.perf_counter() - started,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(format_tables(result))
    hi = {r["policy"]: r["drop_pct"] for r in
          next(iter(paper["readings"].values()))}  # fmt: skip
    print(
        "cluster_sim: LLaMA-7B n=32 high (literal) drop: "
        + " ".join(f"{p} {d:.2f}%" for p, d in hi.items())
        + f" | paper MeCeFO {PAPER_DROP_PCT}% | n=4096 30 days in "
        f"{timings.get('4096', math.nan):.1f} s"
    )
    return result


def format_tables(result: Dict[str, Any]) -> str:
    """README tables: the paper's setting under each reading, and the n x trace grid."""
    lines = ["LLaMA-7B, 32 replicas, high frequency: time-averaged throughput drop %",
             "| reading | mean down | " + " | ".join(POLICIES)
             + " | limit exact | limit takeover | paper MeCeFO |",
             "|---|---|" + "---|" * len(POLICIES) + "---|---|---|"]  # fmt: skip
    for reading, rows in result["paper_7b_high"]["readings"].items():
        d = {r["policy"]: r for r in rows}
        lines.append(
            f"| {reading} | {rows[0]['mean_down']:.2f} | "
            + " | ".join(f"{d[p]['drop_pct']:.2f}" for p in POLICIES)
            + f" | {rows[0]['limit_exact_drop_pct']:.2f} | {rows[0]['limit_takeover_drop_pct']:.2f}"
            f" | {PAPER_DROP_PCT} |"
        )
    lines += ["", "Grid (llama7b profile): drop % per policy; auto's lost samples are 0 by budget",
              "| n | trace | events | mean down | " + " | ".join(POLICIES)
              + " | drop: samples lost % | auto: takeover % | auto: transitions % |",
              "|---|---|---|---|" + "---|" * len(POLICIES) + "---|---|---|"]  # fmt: skip
    keyed: Dict[Tuple, Dict[str, Dict[str, Any]]] = {}
    for r in result["rows"]:
        keyed.setdefault((r["profile"], r["n"], r["trace"]), {})[r["policy"]] = r
    for (prof, n, trace), d in keyed.items():
        if prof != "llama7b":
            continue
        a = d["auto"]
        lines.append(
            f"| {n} | {trace} | {a['events']} | {a['mean_down']:.2f} | "
            + " | ".join(f"{d[p]['drop_pct']:.2f}" for p in POLICIES)
            + f" | {d['drop']['samples_lost_pct']:.2f} | {a['takeover_share_pct']:.2f} | "
            f"{a['transition_time_pct']:.3f} |"
        )
    lines += ["", "Grid states (cpu-demo profile, M = 4): amortised throughput / failure-free",
              "| n | k | " + " | ".join(CHOICES)
              + " | auto | auto's choice | best lossless fixed |",
              "|---|---|" + "---|" * len(CHOICES) + "---|---|---|"]  # fmt: skip
    for g in result["grid_states_cpu_demo"]:
        lines.append(
            f"| {g['n']} | {g['k']} | "
            + " | ".join(f"{g['fixed'][p]:.3f}" for p in CHOICES)
            + f" | {g['auto']:.3f} | {g['auto_choice']} | {g['best_lossless_fixed']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
