"""ETTR at 1k, 16k and 100k GPUs from published recovery costs and failure rates (a model).

Pure computation, no run. Each system's cost per failure at scale comes from a published
measurement (``SOURCES``: cited), this project's measurements (``results/*.json``: measured),
an extrapolation of them (extrapolated), a calibration against a published figure (derived), or
a stated choice (``INPUTS`` with ``kind: assumed``). Failure rates: Llama 3's report (419
unexpected interruptions in 54 days on 16,384 H100s, split by root cause into what a
neighbour can absorb and what needs a restart) and Meta's cluster study (MTTF 1.8 h at 16,384
GPUs, a fitted projection; 7.9 h at 1,024). ETTR counts samples: a system that drops a
replica's share (torchft) loses those samples.

Per failure rate ``lam`` (per second, whole job; ``lam_a`` the part neighbours absorb,
``lam_r`` the part that needs a restart) and system:

* checkpoint-restart: ``1 - save/tau - lam (tau/2 + restart)``, Young/Daly ``tau =
  sqrt(2 save / lam)``; ``restart`` derived so that its ETTR at 16k GPUs and Llama 3's rate is
  Llama 3's published 90%;
* a fast whole-job restart without rollback (FlashRecovery, HyperPod checkpointless):
  ``1 - lam (restart + step)`` for every failure (the in-flight step is redone);
* torchft: ``(1 - lam_a (detect + shrink + grow + step)) (1 - lam_a (MTTR + heal) g / N)`` for
  the absorbed failures (the quorum's process-group reconfigure at the failure and at the
  rejoin: the communicator shrink and grow), times checkpoint-restart's factor at ``lam_r``;
* MeCeFO: ``(1 - lam_a (detect + regroup_fail + regroup_rejoin + step)) x`` the time-averaged
  degraded throughput, times checkpoint-restart's factor at ``lam_r``. The replicas down are
  Poisson with mean ``lam_a MTTR``; with k of n down and M micro-batches per replica,
  ``spread`` deals the k M orphaned micro-batches round-robin, so one survivor runs
  ``M + c ceil(k M / (n - k))`` (whole micro-batches: at least ``M + c``): throughput
  ``M / (M + c ceil(k M/(n-k)))``; ``neighbor`` runs ``M + c M``: ``1/(1 + c)``; ``auto`` the
  better of the two at each k. The regroup is either the code as it is (a world rebuild at the
  failure and at the rejoin) or ``shrink_group`` (a communicator shrink, then a grow).

Usage: ``python benchmarks/goodput_at_scale.py [--micro-batches M] [--output
results/goodput_at_scale.json]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
GPUS = (1024, 16384, 100_000)
M_TABLE = (4, 8, 16, 32)
RATES = ("llama3_rate", "meta_rsc_16k_rate", "meta_rsc_1k_rate")

# Llama 3's Table 5: root causes of the 419 unexpected interruptions in 54 days on 16,384 H100s
# (count, the percentage as printed), and the class each is put in here. The class is assumed:
# "absorb" = one node (one data-parallel replica) is lost and its neighbours can take its work
# over; "restart" = the job as a whole has to restart (a software bug or a dependency recurs
# on every replica, an unplanned host maintenance or an NCCL watchdog timeout stops the job).
LLAMA3_TABLE5: List[Tuple[str, int, float, str]] = [
    ("Faulty GPU", 148, 30.1, "absorb"),
    ("GPU HBM3 memory", 72, 17.2, "absorb"),
    ("Software bug", 54, 12.9, "restart"),
    ("Network switch/cable", 35, 8.4, "absorb"),
    ("Host maintenance", 32, 7.6, "restart"),
    ("GPU SRAM memory", 19, 4.5, "absorb"),
    ("GPU system processor", 17, 4.1, "absorb"),
    ("NIC", 7, 1.7, "absorb"),
    ("NCCL watchdog timeouts", 7, 1.7, "restart"),
    ("Silent data corruption", 6, 1.4, "absorb"),
    ("GPU thermal interface + sensor", 6, 1.4, "absorb"),
    ("SSD", 3, 0.7, "absorb"),
    ("Power supply", 3, 0.7, "absorb"),
    ("Server chassis", 2, 0.5, "absorb"),
    ("IO expansion board", 2, 0.5, "absorb"),
    ("Dependency", 2, 0.5, "restart"),
    ("CPU", 2, 0.5, "absorb"),
    ("System memory", 2, 0.5, "absorb"),
]
LLAMA3_CITE = "Llama Team, The Llama 3 Herd of Models, arXiv 2407.21783, sec. 3.3.4, Table 5"

SOURCES: Dict[str, Dict[str, Any]] = {
    "llama3_rate": {
        "value": 419 / (54 * 24 * 16384),
        "unit": "failures per GPU-hour",
        "kind": "cited",
        "what": "419 unexpected interruptions in 54 days on 16,384 H100 GPUs (Table 5 by root "
        "cause: llama3_table5); > 90% effective training time",
        "cite": LLAMA3_CITE,
    },
    "llama3_table5": {
        "value": [{"cause": c, "count": n, "printed_pct": p} for c, n, p, _ in LLAMA3_TABLE5],
        "unit": "interruptions in 54 days",
        "kind": "cited",
        "what": "root causes of the 419 unexpected interruptions (the printed percentages are "
        "the paper's; 148 / 419 is 35.3%, printed 30.1%)",
        "cite": LLAMA3_CITE,
    },
    "llama3_effective_time": {
        "value": 0.90,
        "unit": "ETTR",
        "kind": "cited",
        "what": "> 90% effective training time on 16,384 GPUs over the 54 days",
        "cite": LLAMA3_CITE,
    },
    "meta_rsc_16k_rate": {
        "value": 1 / (1.8 * 16384),
        "unit": "failures per GPU-hour",
        "kind": "fitted projection",
        "what": "MTTF 1.8 h for 16,384-GPU jobs: a projection of the study's fitted failure "
        "model, not a measured MTTF of such jobs",
        "cite": "Kokolis et al., Revisiting Reliability in Large-Scale ML Research Clusters, "
        "arXiv 2410.21680",
    },
    "meta_rsc_1k_rate": {
        "value": 1 / (7.9 * 1024),
        "unit": "failures per GPU-hour",
        "kind": "cited",
        "what": "MTTF 7.9 h for 1,024-GPU jobs (scaled linearly: the pessimistic rate)",
        "cite": "Kokolis et al., arXiv 2410.21680",
    },
    "flashrecovery": {
        "value": 150.0,
        "unit": "s per failure",
        "kind": "cited",
        "what": "150 s recovery at 4,800 devices, about constant with scale, work lost <= 1 step",
        "cite": "FlashRecovery, arXiv 2509.03047",
    },
    "hyperpod": {
        "value": 120.0,
        "unit": "s per failure",
        "kind": "cited",
        "what": "checkpointless recovery under 2 min (from 15-30+ min)",
        "cite": "Amazon SageMaker HyperPod checkpointless training (AWS, 2025)",
    },
    "torchft_monarch": {
        "value": 17.0,
        "unit": "s per failure",
        "kind": "cited",
        "what": "Monarch on Kubernetes: ~17 s recovery reusing the host (53-115 s with a pod "
        "restart)",
        "cite": "torchft 0.3 / Monarch release notes (Nov 2026), /work/shared/docs/landscape.md E",
    },
    "torchft_user": {
        "value": 948.0,
        "unit": "s per failure",
        "kind": "cited",
        "what": "a torchft user's recovery at Llama-3-8B (healing ~800 s -> ~20 s once the "
        "InfiniBand addresses were advertised: torchft issue 329)",
        "cite": "torchft issue #329",
    },
    "nccl_shrink_grow_1024": {
        "value": {"shrink": 3.79, "grow": 4.19},
        "unit": "s at 1,024 GPUs",
        "kind": "cited",
        "what": "ncclCommShrink and ncclCommGrow at 1,024 GPUs, the follow-up measurement of "
        "the NeMo-RL shrink demo (whose early figure was 2.02 s shrink)",
        "cite": "follow-up to NVIDIA-NeMo/RL PR #3186 (NCCL >= 2.27 ncclCommShrink / Grow)",
    },
    "byterobust": {
        "value": 0.97,
        "unit": "ETTR",
        "kind": "cited",
        "what": "ETTR 97% over three months on 9,600 GPUs",
        "cite": "ByteRobust, SOSP'25, arXiv 2509.16293",
    },
}


def _input(value: Any, kind: str, note: str) -> Dict[str, Any]:
    return {"value": value, "kind": kind, "note": note}


# Every input that is not a cited figure, with its kind: assumed (a stated choice), measured
# (this project's results/), extrapolated (from measured points), derived (calibrated).
INPUTS: Dict[str, Dict[str, Any]] = {
    "gpus_per_replica": _input(
        8,
        "assumed",
        "one 8-GPU node per data-parallel replica (TP 8): "
        "a failure takes the node, so n = N/8 replicas",
    ),
    "step_s": _input(
        10.0, "assumed", "one global-batch step; the in-flight step is redone " "after a failure"
    ),
    "microbatches": _input(
        8,
        "assumed",
        "M, micro-batches per replica per step for the main "
        "table; the M table covers 4, 8, 16, 32",
    ),
    "c": _input(
        0.96,
        "measured",
        "takeover micro-batch cost over an exact one at llama-1b "
        "widths on an H200 (results/takeover_cost_llama-1b_h200.json; 0.68 at "
        "llama-7b)",
    ),
    "mttr_s": _input(
        1800.0, "assumed", "until a replacement node has joined (hot spare or " "repaired): 30 min"
    ),
    "save_s": _input(30.0, "assumed", "blocking time of one checkpoint save"),
    "detect_s": _input(
        1.0,
        "assumed",
        "detection (MeCeFO and torchft): a missed heartbeat "
        "(1 s interval) or the collective's error",
    ),
    "failure_split": _input(
        None,
        "assumed",
        "which Table 5 root causes a neighbour absorbs "
        "and which need a whole-job restart: llama3_table5 in the JSON "
        "gives each cause's class; the other rates are split in the same "
        "proportion",
    ),
    "restart_class_recovery": _input(
        "checkpoint-restart",
        "assumed",
        "a failure that needs a "
        "restart costs MeCeFO and torchft what it costs "
        "checkpoint-restart (Young/Daly at that rate, the derived "
        "restart); the factors multiply",
    ),
    "restart_class_fast_s": _input(
        120.0,
        "assumed",
        "the variant in which MeCeFO's "
        "restart-class failures cost a restart without rollback at "
        "HyperPod's published 120 s (an in-process restart this "
        "project does not have) instead of checkpoint-restart",
    ),
    "fast_restart_covers_all": _input(
        True,
        "assumed",
        "FlashRecovery and HyperPod pay their "
        "published restart for every failure, of either class",
    ),
    "shrink_grow_growth_s_per_doubling": _input(
        0.3,
        "assumed",
        "beyond 1,024 GPUs the shrink "
        "and the grow each grow by 0.3 s per doubling "
        "of the GPU count (extrapolated)",
    ),
    "rebuild_store_ops_per_rank": _input(
        4,
        "assumed",
        "store requests each rank makes in a "
        "world rebuild (rendezvous and init_process_group's "
        "store barrier), served by one store",
    ),
    "rebuild_communicator_at_least_shrink": _input(
        True,
        "assumed",
        "a world rebuild's new "
        "NCCL communicator costs at least a shrink "
        "of the same size (a lower bound: no "
        "communicator init is measured here)",
    ),
}


def value(name: str, inp: Optional[Dict[str, Dict[str, Any]]] = None) -> Any:
    """The value of input ``name``."""
    return (inp or INPUTS)[name]["value"]


# ----------------------------------------------------------------- measured regroup points


def _read(path: str) -> Dict[str, Any]:
    return json.loads((REPO / path).read_text())


def measured_points() -> Dict[str, Any]:
    """The regroup figures this project measured (CPU, gloo) that the rebuild extrapolation
    uses: the largest world-rebuild regroup of ``results/recovery_scale.json`` (the model
    rebuild grows with the state; the N-independent part), the p50 regroup and its steps of
    ``results/recovery_latency_dp4.json``, and the store's CPU per request of
    ``results/commit_at_scale.json`` (the N-dependent part: every rank's requests to one
    store)."""
    scale = _read("results/recovery_scale.json")
    # Per configuration: the median over its runs (recovery_scale.py --reps), or its one run.
    rows = scale.get("cross_size", {}).get("configs") or scale["runs"]
    regroups = {
        f"{r['trainer']} dp{r['dp']} {r['size_gib']} GiB": r["regroup_s"]
        for r in rows
        if r.get("regroup_s") is not None
    }
    lat = _read("results/recovery_latency_dp4.json")
    p50 = [v["regroup_s"]["p50"] for v in lat["table"].values() if v["regroup_s"]["n"]]
    steps: Dict[str, List[float]] = {}
    for run in lat["runs"]:
        for rec in run["records"]:
            if rec.get("kind") == "failure":
                for k, v in rec.get("regroup_steps_s", {}).items():
                    if "." not in k:
                        steps.setdefault(k, []).append(v)
    commit = _read("results/commit_at_scale.json")["per_rank_extrapolated"]
    return {
        "recovery_scale_regroup_s": regroups,
        "fixed_s": max(regroups.values()),
        "fixed_from": max(regroups, key=regroups.get),
        "recovery_latency_dp4_regroup_p50_s": statistics.median(p50),
        "recovery_latency_dp4_steps_p50_s": {k: statistics.median(v) for k, v in steps.items()},
        "store_ms_per_request": commit["server_cpu_ms_per_vote"],
        "sources": [
            "results/recovery_scale.json",
            "results/recovery_latency_dp4.json",
            "results/commit_at_scale.json",
        ],
    }


MEASURED = measured_points()


def shrink_grow_s(gpus: int, inp: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, float]:
    """``shrink_group``: the cited shrink and grow at 1,024 GPUs, then + the assumed growth
    per doubling (extrapolated); below 1,024 the 1,024 figures."""
    base = SOURCES["nccl_shrink_grow_1024"]["value"]
    extra = value("shrink_grow_growth_s_per_doubling", inp) * max(0.0, math.log2(gpus / 1024))
    return {"shrink": base["shrink"] + extra, "grow": base["grow"] + extra}


def rebuild_s(gpus: int, inp: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, float]:
    """The code as it is: a world rebuild (``init_process_group`` and a model rebuild), at
    the failure and again at the rejoin. Extrapolated: the measured N-independent part (the
    largest measured regroup: release, model rebuild, restore) + every rank's store requests
    to one store at the measured CPU per request + a new communicator, at least a shrink."""
    fixed = MEASURED["fixed_s"]
    store = gpus * value("rebuild_store_ops_per_rank", inp) * MEASURED["store_ms_per_request"]
    comm = shrink_grow_s(gpus, inp)["shrink"]
    total = fixed + store / 1e3 + comm
    return {"fixed": fixed, "store": store / 1e3, "communicator": comm, "total": total}


def regroup_pair(gpus: int, variant: str, inp: Optional[Dict[str, Dict[str, Any]]] = None) -> float:
    """Seconds of regroup per absorbed failure: at the failure plus at the rejoin."""
    if variant == "rebuild":
        return 2 * rebuild_s(gpus, inp)["total"]
    sg = shrink_grow_s(gpus, inp)
    return sg["shrink"] + sg["grow"]


# ----------------------------------------------------------------- rates and the split


def split() -> Dict[str, Any]:
    """Llama 3's 419 interruptions by class, each cause with its cited count."""
    out: Dict[str, Any] = {"absorb": [], "restart": []}
    for cause, n, pct, cls in LLAMA3_TABLE5:
        out[cls].append({"cause": cause, "count": n, "printed_pct": pct})
    total = sum(n for _, n, _, _ in LLAMA3_TABLE5)
    out["absorb_count"] = sum(c["count"] for c in out["absorb"])
    out["restart_count"] = sum(c["count"] for c in out["restart"])
    out["total"] = total
    out["restart_share"] = out["restart_count"] / total
    return out


SPLIT = split()


def rate_per_s(source: str, gpus: int) -> float:
    """Whole-job failures per second at ``gpus`` from a per-GPU-hour rate."""
    return SOURCES[source]["value"] * gpus / 3600


def rates(source: str, gpus: int, absorb_all: bool = False) -> Tuple[float, float]:
    """(absorbed, restart) failures per second; ``absorb_all``: every failure absorbed."""
    lam = rate_per_s(source, gpus)
    share = 0.0 if absorb_all else SPLIT["restart_share"]
    return lam * (1 - share), lam * share


# ----------------------------------------------------------------- systems


def checkpoint_restart(lam: float, save: float, restart: float) -> float:
    """Young/Daly checkpoint-restart: ``1 - save/tau - lam (tau/2 + restart)``."""
    if lam <= 0:
        return 1.0
    tau = math.sqrt(2 * save / lam)
    return max(0.0, 1 - save / tau - lam * (tau / 2 + restart))


def calibrate_restart(target: float, lam: float, save: float) -> float:
    """The restart time at which checkpoint-restart's ETTR is ``target`` (closed form)."""
    tau = math.sqrt(2 * save / lam)
    return (1 - target - save / tau - lam * tau / 2) / lam


RESTART_S = calibrate_restart(
    SOURCES["llama3_effective_time"]["value"],
    rate_per_s("llama3_rate", 16384),
    INPUTS["save_s"]["value"],
)
INPUTS["restart_s"] = _input(
    RESTART_S, "derived", "checkpoint-restart's whole-job restart + reload, derived so that its "
    "ETTR at 16,384 GPUs and Llama 3's rate is Llama 3's published 90% (> 90%: an upper bound on "
    "the restart); depends on the assumed save_s",
)  # fmt: skip


def fast_restart(lam: float, restart: float, step: float) -> float:
    """A restart without rollback: ``1 - lam (restart + step)``."""
    return max(0.0, 1 - lam * (restart + step))


def torchft(
    lam_a: float, lam_r: float, gpus: int, heal: float, inp: Dict[str, Dict[str, Any]]
) -> Dict[str, float]:
    """torchft: the quorum's shrink and grow per absorbed failure, the dead replica group's
    share dropped until it has healed; restart-class failures as checkpoint-restart."""
    regroup = regroup_pair(gpus, "shrink_group", inp)
    time_frac = max(0.0, 1 - lam_a * (value("detect_s", inp) + regroup + value("step_s", inp)))
    g = value("gpus_per_replica", inp)
    samples = max(0.0, 1 - lam_a * (value("mttr_s", inp) + heal) * g / gpus)
    restart = checkpoint_restart(lam_r, value("save_s", inp), value("restart_s", inp))
    return {"ettr": time_frac * samples * restart, "time": time_frac, "samples_trained": samples}


def degraded_throughput(k: int, n: int, m: int, c: float) -> Dict[str, float]:
    """Throughput with k of n replicas down, whole micro-batches: ``spread``'s critical path
    is ``M + c ceil(k M / (n - k))``, ``neighbor``'s ``M + c M``."""
    if k == 0:
        return {"neighbor": 1.0, "spread": 1.0, "auto": 1.0}
    if k >= n:
        return {"neighbor": 0.0, "spread": 0.0, "auto": 0.0}
    spread = m / (m + c * math.ceil(k * m / (n - k)))
    neighbor = 1 / (1 + c) if k <= n - k else 1 / (1 + c * math.ceil(k / (n - k)))
    return {"neighbor": neighbor, "spread": spread, "auto": max(neighbor, spread)}


def mean_throughput(down: float, n: int, m: int, c: float, policy: str) -> float:
    """The time average over k ~ Poisson(``down``) replicas down (M/G/inf)."""
    total, p, k = 0.0, math.exp(-down), 0
    mass = 0.0
    while k < n and (mass < 1 - 1e-12 or k <= down):
        total += p * degraded_throughput(k, n, m, c)[policy]
        mass += p
        k += 1
        p *= down / k
    return total


def mecefo(
    lam_a: float,
    lam_r: float,
    gpus: int,
    inp: Dict[str, Dict[str, Any]],
    policy: str = "auto",
    variant: str = "rebuild",
    m: Optional[int] = None,
    regroup: Optional[float] = None,
    restart_class: str = "checkpoint",
) -> float:
    """MeCeFO's ETTR: the per-failure pause, the time-averaged degraded throughput (whole
    micro-batches, M = ``m``), the restart-class failures as checkpoint-restart (or, with
    ``restart_class="fast"``, as a restart without rollback). ``regroup``: seconds per absorbed
    failure (failure + rejoin) instead of ``variant``'s."""
    g, c = value("gpus_per_replica", inp), value("c", inp)
    n = gpus // g
    m = m or value("microbatches", inp)
    rg = regroup_pair(gpus, variant, inp) if regroup is None else regroup
    pause = 1 - lam_a * (value("detect_s", inp) + rg + value("step_s", inp))
    tput = mean_throughput(lam_a * value("mttr_s", inp), n, m, c, policy)
    if restart_class == "fast":
        restart = fast_restart(lam_r, value("restart_class_fast_s", inp), value("step_s", inp))
    else:
        restart = checkpoint_restart(lam_r, value("save_s", inp), value("restart_s", inp))
    return max(0.0, pause * tput * restart)


# ----------------------------------------------------------------- tables


def table(inp: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """ETTR per system at 1k, 16k and 100k GPUs under each failure-rate source (M from the
    inputs; the failure split applied)."""
    rows = []
    for source in RATES:
        for gpus in GPUS:
            lam = rate_per_s(source, gpus)
            lam_a, lam_r = rates(source, gpus)
            tft = torchft(lam_a, lam_r, gpus, SOURCES["torchft_monarch"]["value"], inp)
            tft_slow = torchft(lam_a, lam_r, gpus, SOURCES["torchft_user"]["value"], inp)
            rows.append({
                "rate": source,
                "gpus": gpus,
                "mtbf_h": 1 / lam / 3600,
                "regroup_rebuild_s": rebuild_s(gpus, inp)["total"],
                "regroup_shrink_s": shrink_grow_s(gpus, inp)["shrink"],
                "checkpoint_restart": checkpoint_restart(lam, value("save_s", inp),
                                                         value("restart_s", inp)),
                "flashrecovery": fast_restart(lam, SOURCES["flashrecovery"]["value"],
                                              value("step_s", inp)),
                "hyperpod": fast_restart(lam, SOURCES["hyperpod"]["value"],
                                         value("step_s", inp)),
                "torchft_17s": tft["ettr"],
                "torchft_948s": tft_slow["ettr"],
                "torchft_948s_samples_trained": tft_slow["samples_trained"],
                "mecefo_neighbor": mecefo(lam_a, lam_r, gpus, inp, "neighbor"),
                "mecefo_spread": mecefo(lam_a, lam_r, gpus, inp, "spread"),
                "mecefo_auto": mecefo(lam_a, lam_r, gpus, inp, "auto"),
                "mecefo_auto_shrink_group": mecefo(lam_a, lam_r, gpus, inp, "auto",
                                                   "shrink_group"),
                "mecefo_auto_all_absorbed": mecefo(lam, 0.0, gpus, inp, "auto"),
            })  # fmt: skip
    return rows


def m_table(inp: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """MeCeFO ``auto`` (and ``spread``'s degraded throughput with one replica down) over M, at
    every scale and rate: the code as it is, with ``shrink_group``, and with every failure
    absorbed (the old assumption)."""
    out = []
    for source in RATES:
        for gpus in GPUS:
            lam = rate_per_s(source, gpus)
            lam_a, lam_r = rates(source, gpus)
            for m in M_TABLE:
                out.append({
                    "rate": source,
                    "gpus": gpus,
                    "M": m,
                    "spread_one_down": (m / (m + value("c", inp))),
                    "auto_rebuild": mecefo(lam_a, lam_r, gpus, inp, "auto", "rebuild", m),
                    "auto_shrink_group": mecefo(lam_a, lam_r, gpus, inp, "auto",
                                                "shrink_group", m),
                    "auto_rebuild_fast_restart_class": mecefo(lam_a, lam_r, gpus, inp, "auto",
                                                              "rebuild", m, None, "fast"),
                    "auto_all_absorbed_rebuild": mecefo(lam, 0.0, gpus, inp, "auto", "rebuild",
                                                        m),
                })  # fmt: skip
    return out


def smallest_m(inp: Dict[str, Dict[str, Any]], gpus: int = 16384) -> Dict[str, Any]:
    """The smallest M (1..256) at which MeCeFO ``auto`` beats FlashRecovery and HyperPod at
    ``gpus`` and Llama 3's rate, per regroup variant and failure split (None: no M does)."""
    lam = rate_per_s("llama3_rate", gpus)
    lam_a, lam_r = rates("llama3_rate", gpus)
    step = value("step_s", inp)
    targets = {
        "flashrecovery": fast_restart(lam, SOURCES["flashrecovery"]["value"], step),
        "hyperpod": fast_restart(lam, SOURCES["hyperpod"]["value"], step),
    }
    out: Dict[str, Any] = {"gpus": gpus, "rate": "llama3_rate", "targets": targets}
    cases = {
        "rebuild": (lam_a, lam_r, "rebuild", "checkpoint"),
        "shrink_group": (lam_a, lam_r, "shrink_group", "checkpoint"),
        "rebuild_fast_restart_class": (lam_a, lam_r, "rebuild", "fast"),
        "shrink_group_fast_restart_class": (lam_a, lam_r, "shrink_group", "fast"),
        "rebuild_all_absorbed": (lam, 0.0, "rebuild", "checkpoint"),
    }
    for case, (la, lr, variant, rc) in cases.items():
        out[case] = {}
        for name, target in targets.items():
            out[case][name] = next(
                (
                    m
                    for m in range(1, 257)
                    if mecefo(la, lr, gpus, inp, "auto", variant, m, None, rc) > target
                ),
                None,
            )
    return out


def max_regroup_for(
    target: float, lam_a: float, lam_r: float, gpus: int, inp: Dict[str, Dict[str, Any]]
) -> float:
    """The longest regroup (failure + rejoin) at which MeCeFO ``auto`` still reaches
    ``target`` (bisection; 0 when even none does)."""
    if mecefo(lam_a, lam_r, gpus, inp, regroup=0.0) < target:
        return 0.0
    lo, hi = 0.0, 1e5
    for _ in range(100):
        mid = (lo + hi) / 2
        ok = mecefo(lam_a, lam_r, gpus, inp, regroup=mid) >= target
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


def sensitivity(inp: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """At 16k GPUs: MeCeFO auto and torchft over the regroup time (failure + rejoin), the
    restart-bound systems over the restart time, and the longest regroup that keeps auto at
    >= 0.99."""
    gpus = 16384
    regroups = [2.0, 5.0, 15.0, 30.0, 60.0, 150.0, 300.0]
    restarts = [17.0, 120.0, 150.0, 300.0, 948.0, 1800.0]
    out: Dict[str, Any] = {"gpus": gpus, "mecefo_auto_by_regroup": [], "by_restart": []}
    for source in RATES:
        lam = rate_per_s(source, gpus)
        lam_a, lam_r = rates(source, gpus)
        out["mecefo_auto_by_regroup"].append({
            "rate": source,
            "ettr": {str(r): mecefo(lam_a, lam_r, gpus, inp, regroup=r) for r in regroups},
            "max_regroup_s_for_0.99": max_regroup_for(0.99, lam_a, lam_r, gpus, inp),
        })  # fmt: skip
        out["by_restart"].append({
            "rate": source,
            "checkpoint_restart": {str(r): checkpoint_restart(lam, value("save_s", inp), r)
                                   for r in restarts},
            "fast_restart": {str(r): fast_restart(lam, r, value("step_s", inp))
                             for r in restarts},
        })  # fmt: skip
    return out


def fmt(x: float) -> str:
    return f"{x:.4f}"


NAMES = {"llama3_rate": "Llama 3", "meta_rsc_16k_rate": "Meta 16k", "meta_rsc_1k_rate": "Meta 1k"}


def markdown(result: Dict[str, Any]) -> str:
    """The tables of docs/goodput-method.md's at-scale part."""
    lines = [
        "| failure rate | GPUs | MTBF h | checkpoint-restart | FlashRecovery | HyperPod | "
        "torchft (heal 17 s / 948 s) | MeCeFO neighbor | MeCeFO spread | MeCeFO auto | "
        "auto with shrink_group | auto, all absorbed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {NAMES[r['rate']]} | {r['gpus']:,} | {r['mtbf_h']:.2f} | "
            f"{fmt(r['checkpoint_restart'])} | {fmt(r['flashrecovery'])} | "
            f"{fmt(r['hyperpod'])} | {fmt(r['torchft_17s'])} / {fmt(r['torchft_948s'])} | "
            f"{fmt(r['mecefo_neighbor'])} | {fmt(r['mecefo_spread'])} | "
            f"{fmt(r['mecefo_auto'])} | {fmt(r['mecefo_auto_shrink_group'])} | "
            f"{fmt(r['mecefo_auto_all_absorbed'])} |"
        )
    lines += ["", "| MeCeFO auto at 16k, Llama 3's rate | "
              + " | ".join(f"M = {m}" for m in M_TABLE) + " |",
              "|---|" + "---|" * len(M_TABLE)]  # fmt: skip
    at16 = [r for r in result["m_table"] if r["gpus"] == 16384 and r["rate"] == "llama3_rate"]
    for key, label in (
        ("spread_one_down", "spread, one replica down: M / (M + c)"),
        ("auto_rebuild", "auto, the code as it is (world rebuild)"),
        ("auto_shrink_group", "auto with shrink_group"),
        ("auto_rebuild_fast_restart_class", "auto, world rebuild, restart class at 120 s"),
        ("auto_all_absorbed_rebuild", "auto, world rebuild, every failure absorbed"),
    ):
        lines.append(f"| {label} | " + " | ".join(fmt(r[key]) for r in at16) + " |")
    s = result["sensitivity"]
    regroups = list(s["mecefo_auto_by_regroup"][0]["ettr"])
    lines += ["", "| MeCeFO auto at 16k, regroup s (failure + rejoin) | " + " | ".join(regroups)
              + " | longest regroup for >= 0.99 |",
              "|---|" + "---|" * (len(regroups) + 1)]  # fmt: skip
    for row in s["mecefo_auto_by_regroup"]:
        lines.append(f"| {NAMES[row['rate']]} | "
                     + " | ".join(fmt(v) for v in row["ettr"].values())
                     + f" | {row['max_regroup_s_for_0.99']:.1f} s |")  # fmt: skip
    restarts = list(s["by_restart"][0]["checkpoint_restart"])
    lines += ["", "| at 16k, restart / heal s | " + " | ".join(restarts) + " |",
              "|---|" + "---|" * len(restarts)]  # fmt: skip
    for row in s["by_restart"]:
        for key, label in (("checkpoint_restart", "checkpoint-restart"),
                           ("fast_restart", "restart without rollback")):  # fmt: skip
            lines.append(f"| {NAMES[row['rate']]}: {label} | "
                         + " | ".join(fmt(v) for v in row[key].values()) + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", default=str(REPO / "results" / "goodput_at_scale.json"))
    p.add_argument("--micro-batches", type=int, default=INPUTS["microbatches"]["value"],
                   help="M, micro-batches per replica per step of the main table")  # fmt: skip
    a = p.parse_args(argv)
    if a.micro_batches < 1:
        raise SystemExit(f"goodput_at_scale: --micro-batches {a.micro_batches}: must be >= 1")
    inp = {k: dict(v) for k, v in INPUTS.items()}
    inp["microbatches"]["value"] = a.micro_batches
    regroup = {
        str(g): {"rebuild": rebuild_s(g, inp), "shrink_group": shrink_grow_s(g, inp)} for g in GPUS
    }
    result = {
        "benchmark": "goodput_at_scale",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": __doc__.split("\n\n", 2)[1] + "\n\n" + __doc__.split("\n\n", 3)[2],
        "sources": SOURCES,
        "inputs": inp,
        "assumed": sorted(k for k, v in inp.items() if v["kind"] == "assumed"),
        "failure_split": SPLIT,
        "measured_regroup_points": MEASURED,
        "regroup_s": regroup,
        "regroup_note": "rebuild: the code as it is (init_process_group + a model rebuild at "
        "the failure and again at the rejoin), extrapolated from the measured points "
        "(measured_regroup_points) with the assumed store requests and communicator; "
        "shrink_group: the cited shrink and grow at 1,024 GPUs, extrapolated beyond",
        "rows": table(inp),
        "m_table": m_table(inp),
        "smallest_m_beating": smallest_m(inp),
        "sensitivity": sensitivity(inp),
        "published": {
            "byterobust_9600": SOURCES["byterobust"]["value"],
            "llama3_16384_effective_time": "> 0.90 (checkpoint-restart is calibrated to it)",
        },
    }
    Path(a.output).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    sm = result["smallest_m_beating"]
    print(
        f"goodput_at_scale: restart {RESTART_S:.0f} s (derived); restart share "
        f"{SPLIT['restart_share']:.3f} ({SPLIT['restart_count']} of {SPLIT['total']}); "
        f"smallest M at which auto beats FlashRecovery / HyperPod at 16k (Llama 3): world "
        f"rebuild {sm['rebuild']['flashrecovery']} / {sm['rebuild']['hyperpod']}, shrink_group "
        f"{sm['shrink_group']['flashrecovery']} / {sm['shrink_group']['hyperpod']}, restart "
        f"class at 120 s {sm['rebuild_fast_restart_class']['flashrecovery']} / "
        f"{sm['rebuild_fast_restart_class']['hyperpod']} (shrink_group "
        f"{sm['shrink_group_fast_restart_class']['flashrecovery']} / "
        f"{sm['shrink_group_fast_restart_class']['hyperpod']}), every "
        f"failure absorbed {sm['rebuild_all_absorbed']['flashrecovery']} / "
        f"{sm['rebuild_all_absorbed']['hyperpod']}; wrote {a.output}"
    )
    return result


if __name__ == "__main__":
    main()
