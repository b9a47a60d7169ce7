"""ETTR at 1k, 16k and 100k GPUs from published recovery costs and failure rates (a model).

Pure computation, no run: each system's cost per failure at scale comes from a published
measurement (``SOURCES``), MeCeFO's from a stated model (detect + a NCCL communicator shrink or
rebuild at n + redo of one step, then the degraded throughput until the replacement rejoins,
and one more regroup when it does). Failure rates: Llama 3's report (419 unexpected
interruptions in 54 days on 16,384 H100s) and Meta's cluster study (MTTF 1.8 h at 16,384 GPUs;
7.9 h at 1,024). ETTR counts samples: a system that drops a replica's share (torchft) loses
those samples.

Per failure rate ``lam`` (per second, whole job) and system:

* checkpoint-restart: ``1 - save/tau - lam (tau/2 + restart)``, Young/Daly ``tau =
  sqrt(2 save / lam)``; a hot spare replaces the node (no repair wait);
* a fast whole-job restart without rollback (FlashRecovery, HyperPod checkpointless):
  ``1 - lam (restart + step)`` (the in-flight step is redone);
* torchft: ``(1 - lam (detect + 2 regroup + step)) (1 - lam (MTTR + heal) g / N)``: the job
  stalls for the detection, the new quorum's process-group reconfigure (at the failure and at
  the rejoin; the same communicator operation as MeCeFO's regroup, so the same input) and the
  failed step, which does not commit; the dead replica group's share (g of N GPUs) is dropped
  until its replacement is up and has healed (``heal``: the published recovery times);
* MeCeFO: ``(1 - lam (detect + 2 regroup + step)) x`` the time-averaged degraded throughput:
  the number of replicas down is Poisson with mean ``lam x MTTR``; ``neighbor`` runs at
  ``1/(1+c)`` whenever one is down, ``spread`` at ``1/(1 + c k/(n-k))``, ``auto`` at the
  better of the two (the planner picks the fastest lossless policy). Every sample is trained
  on.

Usage: ``python benchmarks/goodput_at_scale.py [--output results/goodput_at_scale.json]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
GPUS = (1024, 16384, 100_000)

SOURCES: Dict[str, Dict[str, Any]] = {
    "llama3_rate": {
        "value": 419 / (54 * 24 * 16384),
        "unit": "failures per GPU-hour",
        "what": "419 unexpected interruptions in 54 days on 16,384 H100 GPUs; > 90% effective "
        "training time",
        "cite": "Llama Team, The Llama 3 Herd of Models, arXiv 2407.21783, sec. 3.3.4",
    },
    "meta_rsc_16k_rate": {
        "value": 1 / (1.8 * 16384),
        "unit": "failures per GPU-hour",
        "what": "MTTF 1.8 h for 16,384-GPU jobs",
        "cite": "Kokolis et al., Revisiting Reliability in Large-Scale ML Research Clusters, "
        "arXiv 2410.21680",
    },
    "meta_rsc_1k_rate": {
        "value": 1 / (7.9 * 1024),
        "unit": "failures per GPU-hour",
        "what": "MTTF 7.9 h for 1,024-GPU jobs (scaled linearly: the pessimistic rate)",
        "cite": "Kokolis et al., arXiv 2410.21680",
    },
    "flashrecovery": {
        "value": 150.0,
        "unit": "s per failure",
        "what": "150 s recovery at 4,800 devices, about constant with scale, work lost <= 1 step",
        "cite": "FlashRecovery, arXiv 2509.03047",
    },
    "hyperpod": {
        "value": 120.0,
        "unit": "s per failure",
        "what": "checkpointless recovery under 2 min (from 15-30+ min)",
        "cite": "Amazon SageMaker HyperPod checkpointless training (AWS, 2025)",
    },
    "torchft_monarch": {
        "value": 17.0,
        "unit": "s per failure",
        "what": "Monarch on Kubernetes: ~17 s recovery reusing the host (53-115 s with a pod "
        "restart)",
        "cite": "torchft 0.3 / Monarch release notes (Nov 2026), /work/shared/docs/landscape.md E",
    },
    "torchft_user": {
        "value": 948.0,
        "unit": "s per failure",
        "what": "a torchft user's recovery at Llama-3-8B (healing ~800 s -> ~20 s once the "
        "InfiniBand addresses were advertised: torchft issue 329)",
        "cite": "as quoted in this project's issue 46; torchft issue #329",
    },
    "nccl_shrink": {
        "value": {"32": 1.53, "64": 1.38, "128": 1.44, "256": 1.67, "512": 2.03, "1024": 2.02},
        "unit": "s",
        "what": "ncclCommShrink latency by GPU count",
        "cite": "NVIDIA-NeMo/RL PR #3186 (NCCL >= 2.27 ncclCommShrink)",
    },
    "byterobust": {
        "value": 0.97,
        "unit": "ETTR",
        "what": "ETTR 97% over three months on 9,600 GPUs",
        "cite": "ByteRobust, SOSP'25, arXiv 2509.16293",
    },
}

# The stated inputs (not published for these systems at these scales: chosen, and varied in
# the sensitivity tables).
INPUTS: Dict[str, Any] = {
    "gpus_per_replica": 8,
    "step_s": 10.0,
    "c": 0.96,
    "mttr_s": 1800.0,
    "save_s": 30.0,
    "restart_s": 900.0,
    "detect_s": 1.0,
    "notes": {
        "gpus_per_replica": "one 8-GPU node per data-parallel replica (TP 8): a failure takes "
        "the node, so n = N/8 replicas",
        "step_s": "one global-batch step; the in-flight step is redone after a failure",
        "c": "takeover micro-batch cost over an exact one: 0.96 measured at llama-1b widths on "
        "an H200 (results/takeover_cost_llama-1b_h200.json; 0.68 at llama-7b)",
        "mttr_s": "until a replacement node has joined (hot spare or repaired): 30 min",
        "save_s": "blocking time of one checkpoint save (checkpoint-restart)",
        "restart_s": "checkpoint-restart's whole-job restart + reload: 15 min, the low end of "
        "HyperPod's stock 15-30+ min",
        "detect_s": "detection (MeCeFO and torchft): a missed heartbeat (1 s interval) or the "
        "collective's error; torchft 0.3's FSDP train_timeout defaults to 100 s",
        "regroup": "NCCL shrink at n GPUs: the PR #3186 table up to 1,024, then +0.3 s per "
        "doubling (an extrapolation); 'rebuild' variants in the sensitivity table",
    },
}


def shrink_s(gpus: int) -> float:
    """ncclCommShrink time at ``gpus``: the measured table, then +0.3 s per doubling."""
    table = {int(k): v for k, v in SOURCES["nccl_shrink"]["value"].items()}
    if gpus <= 1024:
        return table[min((k for k in table if k >= gpus), default=1024)]
    return table[1024] + 0.3 * math.log2(gpus / 1024)


def rate_per_s(source: str, gpus: int) -> float:
    """Whole-job failures per second at ``gpus`` from a per-GPU-hour rate."""
    return SOURCES[source]["value"] * gpus / 3600


def checkpoint_restart(lam: float, save: float, restart: float) -> float:
    tau = math.sqrt(2 * save / lam)
    return max(0.0, 1 - save / tau - lam * (tau / 2 + restart))


def fast_restart(lam: float, restart: float, step: float) -> float:
    return max(0.0, 1 - lam * (restart + step))


def torchft(
    lam: float, gpus: int, regroup: float, heal: float, inp: Dict[str, Any]
) -> Dict[str, float]:
    time_frac = max(0.0, 1 - lam * (inp["detect_s"] + 2 * regroup + inp["step_s"]))
    samples = max(0.0, 1 - lam * (inp["mttr_s"] + heal) * inp["gpus_per_replica"] / gpus)
    return {"ettr": time_frac * samples, "time": time_frac, "samples_trained": samples}


def mecefo(
    lam: float, gpus: int, regroup: float, inp: Dict[str, Any], policy: str = "auto"
) -> float:
    """MeCeFO's ETTR: per-failure pause times the time-averaged degraded throughput."""
    g, c = inp["gpus_per_replica"], inp["c"]
    n = gpus // g
    pause = 1 - lam * (inp["detect_s"] + 2 * regroup + inp["step_s"])
    down = lam * inp["mttr_s"]  # mean replicas down (M/G/inf)
    p0 = math.exp(-down)
    neighbor = p0 + (1 - p0) / (1 + c)
    k = min(max(down, 0.0), n - 1)
    spread = 1 / (1 + c * k / (n - k))
    tput = {"neighbor": neighbor, "spread": spread, "auto": max(neighbor, spread)}[policy]
    return max(0.0, pause * tput)


def table(inp: Dict[str, Any], regroup: Optional[float] = None) -> List[Dict[str, Any]]:
    """ETTR per system at 1k, 16k and 100k GPUs under each failure-rate source."""
    rows = []
    for source in ("llama3_rate", "meta_rsc_16k_rate", "meta_rsc_1k_rate"):
        for gpus in GPUS:
            lam = rate_per_s(source, gpus)
            rg = shrink_s(gpus) if regroup is None else regroup
            tft = torchft(lam, gpus, rg, SOURCES["torchft_monarch"]["value"], inp)
            tft_slow = torchft(lam, gpus, rg, SOURCES["torchft_user"]["value"], inp)
            rows.append({
                "rate": source,
                "gpus": gpus,
                "mtbf_h": 1 / lam / 3600,
                "regroup_s": rg,
                "checkpoint_restart": checkpoint_restart(lam, inp["save_s"], inp["restart_s"]),
                "flashrecovery": fast_restart(lam, SOURCES["flashrecovery"]["value"],
                                              inp["step_s"]),
                "hyperpod": fast_restart(lam, SOURCES["hyperpod"]["value"], inp["step_s"]),
                "torchft_17s": tft["ettr"],
                "torchft_948s": tft_slow["ettr"],
                "torchft_948s_samples_trained": tft_slow["samples_trained"],
                "mecefo_neighbor": mecefo(lam, gpus, rg, inp, "neighbor"),
                "mecefo_spread": mecefo(lam, gpus, rg, inp, "spread"),
                "mecefo_auto": mecefo(lam, gpus, rg, inp, "auto"),
            })  # fmt: skip
    return rows


def max_regroup_for(target: float, lam: float, gpus: int, inp: Dict[str, Any]) -> float:
    """The longest regroup at which MeCeFO ``auto`` still reaches ``target`` (bisection)."""
    if mecefo(lam, gpus, 0.0, inp) < target:
        return 0.0
    lo, hi = 0.0, 1e5
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mecefo(lam, gpus, mid, inp) >= target else (lo, mid)
    return lo


def sensitivity(inp: Dict[str, Any]) -> Dict[str, Any]:
    """At 16k GPUs: MeCeFO auto and torchft over the regroup time (torchft with its slow heal),
    the restart-bound systems over the restart time, and the largest regroup that keeps auto at
    >= 0.99."""
    gpus = 16384
    regroups = [2.0, 5.0, 15.0, 30.0, 60.0, 150.0, 300.0]
    restarts = [17.0, 120.0, 150.0, 300.0, 948.0, 1800.0]
    out: Dict[str, Any] = {"gpus": gpus, "mecefo_auto_by_regroup": [], "by_restart": []}
    for source in ("llama3_rate", "meta_rsc_16k_rate", "meta_rsc_1k_rate"):
        lam = rate_per_s(source, gpus)
        out["mecefo_auto_by_regroup"].append({
            "rate": source,
            "ettr": {str(r): mecefo(lam, gpus, r, inp) for r in regroups},
            "torchft_948s": {str(r): torchft(lam, gpus, r, SOURCES["torchft_user"]["value"],
                                             inp)["ettr"] for r in regroups},
            "max_regroup_s_for_0.99": max_regroup_for(0.99, lam, gpus, inp),
        })  # fmt: skip
        out["by_restart"].append({
            "rate": source,
            "checkpoint_restart": {str(r): checkpoint_restart(lam, inp["save_s"], r)
                                   for r in restarts},
            "fast_restart": {str(r): fast_restart(lam, r, inp["step_s"]) for r in restarts},
        })  # fmt: skip
    return out


def fmt(x: float) -> str:
    return f"{x:.4f}"


def markdown(result: Dict[str, Any]) -> str:
    """The tables of docs/results.md's at-scale part."""
    names = {"llama3_rate": "Llama 3", "meta_rsc_16k_rate": "Meta 16k",
             "meta_rsc_1k_rate": "Meta 1k"}  # fmt: skip
    lines = [
        "| failure rate | GPUs | MTBF h | checkpoint-restart | FlashRecovery | HyperPod | "
        "torchft (heal 17 s / 948 s) | MeCeFO neighbor | MeCeFO spread | MeCeFO auto |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {names[r['rate']]} | {r['gpus']:,} | {r['mtbf_h']:.2f} | "
            f"{fmt(r['checkpoint_restart'])} | {fmt(r['flashrecovery'])} | "
            f"{fmt(r['hyperpod'])} | {fmt(r['torchft_17s'])} / {fmt(r['torchft_948s'])} | "
            f"{fmt(r['mecefo_neighbor'])} | {fmt(r['mecefo_spread'])} | "
            f"{fmt(r['mecefo_auto'])} |"
        )
    s = result["sensitivity"]
    regroups = list(s["mecefo_auto_by_regroup"][0]["ettr"])
    lines += ["", "| MeCeFO auto at 16k, regroup s | " + " | ".join(regroups)
              + " | longest regroup for >= 0.99 |",
              "|---|" + "---|" * (len(regroups) + 1)]  # fmt: skip
    for row in s["mecefo_auto_by_regroup"]:
        lines.append(f"| {names[row['rate']]} | "
                     + " | ".join(fmt(v) for v in row["ettr"].values())
                     + f" | {row['max_regroup_s_for_0.99']:.1f} s |")  # fmt: skip
        tft = " | ".join(fmt(v) for v in row["torchft_948s"].values())
        lines.append(f"| {names[row['rate']]}: torchft, heal 948 s | {tft} | |")
    restarts = list(s["by_restart"][0]["checkpoint_restart"])
    lines += ["", "| at 16k, restart / heal s | " + " | ".join(restarts) + " |",
              "|---|" + "---|" * len(restarts)]  # fmt: skip
    for row in s["by_restart"]:
        for key, label in (("checkpoint_restart", "checkpoint-restart"),
                           ("fast_restart", "restart without rollback")):  # fmt: skip
            lines.append(f"| {names[row['rate']]}: {label} | "
                         + " | ".join(fmt(v) for v in row[key].values()) + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", default=str(REPO / "results" / "goodput_at_scale.json"))
    a = p.parse_args(argv)
    result = {
        "benchmark": "goodput_at_scale",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": __doc__.split("\n\n", 2)[1],
        "sources": SOURCES,
        "inputs": INPUTS,
        "rows": table(INPUTS),
        "sensitivity": sensitivity(INPUTS),
        "published": {
            "byterobust_9600": SOURCES["byterobust"]["value"],
            "llama3_16384_effective_time": "> 0.90",
        },
    }
    Path(a.output).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
