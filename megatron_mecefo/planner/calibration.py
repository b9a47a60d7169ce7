"""Calibration of the recovery planner: a saved cost profile, and prediction-vs-measurement.

The planner's terms come from measurements already in ``results/``:

* ``benchmarks/takeover_cost.py`` (one process, the trainer's model shape): the exact and
  takeover micro-batch cost with FFN recomputation (mode ``all``) and without it (mode
  ``skip_lowrank``), the basis refresh, the activation bytes of each mode and the low-rank
  FLOP model (for the cost per unit of r);
* ``benchmarks/degraded_throughput.py`` (a real DP-4 run): the optimizer step and the gradient
  sync with the replica count it was measured at;
* ``benchmarks/recovery_latency.py`` (real rank deaths, DP 4): the regroup and the rejoin.

``python -m megatron_mecefo.planner.calibration`` writes them into one profile file
(``results/planner_profile.json``) that ``--mecefo-policy auto`` reads when
``--mecefo-planner-profile`` names it. Without that flag ``auto`` reads the profile shipped in
the package (:data:`PACKAGED_PROFILE`, a copy of the repository's measurement: the example
trainer's demo model on a CPU), whatever the working directory. :func:`prediction_report`
reads a run's metrics JSONL and reports how far the predicted step times were from the
measured ones.

No in-memory snapshot costs: the snapshot issue has not landed, so that recovery option is
not in the profile nor in the planner.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional

from megatron_mecefo.planner.recovery_planner import CostProfile

DEFAULT_PROFILE = "results/planner_profile.json"
"""Where the calibration writes (its ``--output``) by default."""

PACKAGED_PROFILE = str(Path(__file__).with_name("default_profile.json"))
"""The profile ``auto`` reads without ``--mecefo-planner-profile``: the repository's
``results/planner_profile.json``, shipped as package data."""


def resolve_profile(path: Optional[str]) -> str:
    """The profile file to read: ``path`` (``--mecefo-planner-profile``), else the packaged
    one (never the working directory's ``results/``: a run must not depend on where it was
    started)."""
    return path if path else PACKAGED_PROFILE


def describe_profile(path: Optional[str]) -> str:
    """Which profile a run reads, for its start-up line."""
    if path:
        return f"{path} (--mecefo-planner-profile)"
    return (
        f"{PACKAGED_PROFILE} (the packaged default, measured on a CPU with the example "
        "trainer's demo model; calibrate your own: docs/megatron-lm.md)"
    )


def _read(path: Optional[str]) -> Optional[Dict[str, Any]]:
    if path is None or not Path(path).exists():
        return None
    return json.loads(Path(path).read_text())


def profile_from_results(
    takeover_cost: str = "results/planner_takeover_cost.json",
    degraded_throughput: str = "results/degraded_throughput.json",
    recovery_latency: Optional[str] = "results/recovery_latency_dp4.json",
    in_flight: int = 1,
) -> CostProfile:
    """A :class:`CostProfile` in ms and bytes from the benchmark result files.

    Raises:
        FileNotFoundError: naming the benchmark to run when a required file is missing.
    """
    tc = _read(takeover_cost)
    if tc is None:
        raise FileNotFoundError(
            f"{takeover_cost} is missing: run `.venv/bin/python benchmarks/takeover_cost.py "
            f"--shape demo --rank 32 --output {takeover_cost}`"
        )
    dt = _read(degraded_throughput)
    if dt is None:
        raise FileNotFoundError(
            f"{degraded_throughput} is missing: run `.venv/bin/python "
            "benchmarks/degraded_throughput.py` (after takeover_cost.py)"
        )
    pm = tc["per_microbatch"]
    if "takeover_no_recompute_ms" not in pm:
        raise ValueError(
            f"{takeover_cost} has no skip_lowrank mode (takeover without FFN recomputation); "
            "re-run benchmarks/takeover_cost.py"
        )
    exact_ms = pm["exact_ms"]
    # The low-rank weight gradient per unit of r, from the FLOP model at the measured ratio of
    # time to FLOPs of an exact micro-batch.
    flops = tc["flop_model"]
    comp = flops["per_layer_components"]
    rank = tc["config"]["rank"]
    layers = tc["config"]["num_layers"]
    lowrank_flops = comp["lowrank_xv_fwd"] + comp["lowrank_gtxv"] + comp["lowrank_expand"]
    ms_per_flop = tc["modes"]["exact"]["time_ms_median"] / flops["flops"]["exact"]
    per_rank_ms = layers * lowrank_flops / rank * ms_per_flop
    # Bytes: saved tensors of each mode (fp32 here), and per unit of r the saved X V.
    saved = {m: tc["modes"][m]["saved_bytes"] for m in tc["modes"]}
    elem = 4 if tc["config"]["dtype"] == "float32" else 2
    tokens = tc["config"]["tokens_per_microbatch"]
    act_per_rank = layers * 2 * tokens * elem  # X V of fc1 and fc2
    fixed = dt["fixed_costs_cpu_s"]
    regroup_ms = rejoin_ms = 0.0
    rl = _read(recovery_latency)
    sources = [takeover_cost, degraded_throughput]
    if rl is not None:
        regroups = [v["regroup_s"]["p50"] for v in rl["table"].values() if v["regroup_s"]["n"]]
        rejoins = [v["rejoin_s"]["p50"] for v in rl["table"].values() if v["rejoin_s"]["n"]]
        regroup_ms = 1e3 * statistics.median(regroups) if regroups else 0.0
        rejoin_ms = 1e3 * statistics.median(rejoins) if rejoins else 0.0
        sources.append(recovery_latency)
    return CostProfile(
        exact_ms=exact_ms,
        takeover_ms=pm["takeover_no_recompute_ms"],
        takeover_recompute_ms=pm["takeover_ms"],
        optimizer_ms=1e3 * fixed["optimizer_s"],
        sync_ms=1e3 * fixed["sync_s"],
        sync_replicas=dt["config"]["validation"]["nproc"],
        profile_rank=rank,
        takeover_ms_per_rank=per_rank_ms,
        basis_refresh_ms=tc["basis"]["refresh_ms"],
        regroup_ms=regroup_ms,
        rejoin_ms=rejoin_ms,
        activation_exact_bytes=saved["exact"],
        activation_takeover_bytes=saved["skip_lowrank"],
        activation_takeover_recompute_bytes=saved["all"],
        activation_bytes_per_rank=act_per_rank,
        in_flight=in_flight,
        source=", ".join(sources),
    )


def save_profile(profile: CostProfile, path: str = DEFAULT_PROFILE) -> None:
    """Write ``profile`` as JSON."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(profile.to_json(), indent=1) + "\n")


def load_profile(path: str = DEFAULT_PROFILE) -> CostProfile:
    """Read a profile written by :func:`save_profile`; errors name the fix."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"planner profile {path} does not exist; write it with `.venv/bin/python -m "
            f"megatron_mecefo.planner.calibration --output {path}`"
        )
    fix = (
        f"rewrite it with `.venv/bin/python -m megatron_mecefo.planner.calibration --output {path}`"
    )
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"planner profile {path}: not a profile ({err}); {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"planner profile {path}: not a profile (a JSON object); {fix}")
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(CostProfile)}
    required = {
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    unknown, missing = sorted(set(data) - set(fields)), sorted(required - set(data))
    if unknown or missing:  # a profile of another megatron-mecefo version
        keys = [f"unknown key(s) {', '.join(unknown)}"] if unknown else []
        keys += [f"missing key(s) {', '.join(missing)}"] if missing else []
        raise ValueError(
            f"planner profile {path} was written by another version ({'; '.join(keys)}); {fix}"
        )
    try:
        return CostProfile(**data)
    except TypeError as err:
        raise ValueError(f"planner profile {path}: {err}; {fix}") from None


def prediction_report(records: List[Dict[str, Any]], skip_first: int = 1) -> Dict[str, Any]:
    """Predicted vs measured step time over a run's ``train`` records with a decision.

    The measured step is the critical path: the slowest rank's CPU ms of forward-backward
    plus optimizer (``mecefo.planner.measured_step_ms``, the example trainer), else the wall
    step time. Steps before the start-up calibration are left out when the run calibrated,
    and so are the first ``skip_first`` steps after each decision change (the transition:
    a basis computation).
    """
    plans = [
        (rec, (rec.get("mecefo") or {}).get("planner"))
        for rec in records
        if rec.get("type") == "train"
    ]
    plans = [(rec, p) for rec, p in plans if p]
    if any(p.get("calibration_factor") for _, p in plans):
        plans = [(rec, p) for rec, p in plans if p.get("calibration_factor")]
    rows = []
    last = None
    since = 0
    for rec, plan in plans:
        key = (plan.get("policy"), tuple(rec["mecefo"].get("failed_replicas", [])))
        since = since + 1 if key == last else 0
        last = key
        if since < skip_first:
            continue
        measured = plan.get("measured_step_ms", 1e3 * rec["step_time_s"])
        rows.append((plan["predicted_step_ms"], measured))
    if not rows:
        return {"steps": 0}
    errs = [m / p - 1.0 for p, m in rows]
    return {
        "steps": len(rows),
        "median_rel_error": statistics.median(errs),
        "median_abs_rel_error": statistics.median(abs(e) for e in errs),
        "max_abs_rel_error": max(abs(e) for e in errs),
        "predicted_ms_median": statistics.median(p for p, _ in rows),
        "measured_ms_median": statistics.median(m for _, m in rows),
    }


def main(argv: Optional[List[str]] = None) -> None:
    """Write the profile from the result files and print it."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--takeover-cost", default="results/planner_takeover_cost.json")
    p.add_argument("--degraded-throughput", default="results/degraded_throughput.json")
    p.add_argument("--recovery-latency", default="results/recovery_latency_dp4.json")
    p.add_argument("--in-flight", type=int, default=1, help="micro-batches in flight (PP)")
    p.add_argument("--output", default=DEFAULT_PROFILE)
    p.add_argument("--report", default=None, metavar="METRICS_JSONL", help="print the "
                   "prediction-vs-measurement report of a run instead")  # fmt: skip
    args = p.parse_args(argv)
    if args.report:
        recs = [json.loads(line) for line in Path(args.report).read_text().splitlines() if line]
        print(json.dumps(prediction_report(recs), indent=1))
        return
    prof = profile_from_results(
        args.takeover_cost, args.degraded_throughput, args.recovery_latency, args.in_flight
    )
    save_profile(prof, args.output)
    print(json.dumps(prof.to_json(), indent=1))


if __name__ == "__main__":
    main()
