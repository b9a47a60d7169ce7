"""Calibrate the planner's gradient-error model on probe runs at n = 32 simulated replicas.

Each probe run trains the study's recipe failure-free to ``--start`` (mid-run), then
holds k = 1, 2, 4, 8 replicas down for ``--phase`` iterations each (replicas 1, 5, 9, ...: no
two share a ring neighbour, so ``neighbor`` never falls back) and logs the gradient relative
error on every degraded iteration (``--mecefo-grad-error-interval 1``). One run per
(policy, r) of ``--configs``. The fit
(:func:`megatron_mecefo.planner.gradient_error_model.fit`) is written with its observations
and its in-sample accuracy to ``--output``; the study's logged errors
(``examples/pretrain_gpt/convergence_report.py``) check it out of sample.

The trainer flags of the study (model, batch, recipe) are passed through: every flag this
script does not know goes to :func:`convergence.parse_args`.

Usage (repo root): ``.venv/bin/python examples/pretrain_gpt/grad_error_calibration.py
--virtual-replicas 32 --micro-batch-size 1 --global-batch-size 32 --train-iters 400 ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convergence  # noqa: E402

from megatron_mecefo.planner.gradient_error_model import (  # noqa: E402
    Observation,
    accuracy,
    fit,
)

DONE = convergence.DONE


def parse_args(argv: Optional[List[str]] = None) -> Tuple[argparse.Namespace, Any]:
    """This script's flags, and the study's (``convergence.parse_args``) of the rest."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--configs",
        nargs="+",
        default=[
            "neighbor:32",
            "spread:32",
            "drop:32",
            "neighbor:16",
            "spread:16",
            "neighbor:64",
            "spread:64",
        ],
        metavar="POLICY:R",
        help="one probe run per policy and low-rank r (two or more r of a policy fit its rank "
        "exponent; drop has none)",
    )
    p.add_argument("--start", type=int, default=200, help="first degraded iteration (mid-run)")
    p.add_argument("--phase", type=int, default=8, help="iterations per failed-set size")
    p.add_argument("--failed", type=int, nargs="+", default=[1, 2, 4, 8], help="k per phase")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--calibration-dir", default="results/convergence_n32/calibration")
    p.add_argument("--output", default="results/convergence_n32/grad_error_calibration.json")
    own, rest = p.parse_known_args(argv)
    study = convergence.parse_args(rest + ["--seeds", str(own.seed)])
    n = convergence.num_replicas(study)
    stride = n // max(own.failed)
    if stride < 2:
        p.error(f"--failed up to {max(own.failed)} of {n} replicas: need at most n / 2")
    return own, study


def fail_flags(own: argparse.Namespace, n: int) -> List[str]:
    """``--mecefo-fail`` of every phase: replica ``i * stride`` is down from the first phase
    with more than ``i`` failures to the end of the probe."""
    stride = n // max(own.failed)
    end = own.start + own.phase * len(own.failed)
    flags = []
    for i in range(max(own.failed)):
        phase = next(j for j, k in enumerate(own.failed) if k > i)
        flags += ["--mecefo-fail", f"{1 + i * stride}:{own.start + phase * own.phase}:{end}"]
    return flags


def observations(metrics: Path, policy: str, rank: int, n: int) -> List[Observation]:
    """Every logged error of one run with its plan's shares."""
    out = []
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        m = rec.get("mecefo", {})
        if rec["type"] != "train" or "grad_rel_error" not in m:
            continue
        total = sum(m["microbatches_per_replica"]) + m.get("microbatches_skipped", 0)
        total = total or n
        out.append(
            Observation(
                policy,
                m["takeover_microbatches"] / total,
                m.get("microbatches_skipped", 0) / total,
                rank,
                m["grad_rel_error"],
                {"iteration": rec["iteration"], "failed": len(m["failed_replicas"])},
            )
        )
    return out


PROBE_KEYS = ("start", "phase", "failed", "seed")
"""This script's flags that change what a probe run computes (with the study's recipe)."""


def probe_config(own: argparse.Namespace, study: argparse.Namespace) -> Dict[str, Any]:
    """What a probe run depends on: the study's recipe and the probe's phases."""
    return {
        "probe": {k: getattr(own, k) for k in PROBE_KEYS},
        "study_recipe": convergence.recipe(vars(study)),
    }


def recorded_probes(
    own: argparse.Namespace, study: argparse.Namespace
) -> Tuple[Dict[str, List[Dict[str, Any]]], Dict[str, float]]:
    """The probes already in ``--output`` (per run name: its observations; and their wall
    seconds), when they were taken under this recipe and these phases: a fresh clone has the
    committed result but not the probe directories. Nothing otherwise."""
    path = Path(own.output)
    if not path.exists():
        return {}, {}
    try:
        old = json.loads(path.read_text())
        same = old["config"].get("probe_config") == json.loads(json.dumps(probe_config(own, study)))
        rows, walls = old["observations"], old["wall_s"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}, {}
    if not same:
        return {}, {}
    by_run: Dict[str, List[Dict[str, Any]]] = {}
    for row in rows:
        by_run.setdefault(row["run"], []).append(row)
    return by_run, {k: v for k, v in walls.items() if k in by_run}


def rank_holdout(obs: List[Observation], reference_rank: int) -> Dict[str, Any]:
    """Per (policy, r) of a policy probed at three or more ranks: the accuracy on that rank's
    probes of the model fitted without them (its c, gamma, delta too)."""
    out: Dict[str, Any] = {}
    for policy in sorted({o.policy for o in obs}):
        ranks = sorted({o.rank for o in obs if o.policy == policy})
        if len(ranks) < 3:
            continue
        for rank in ranks:
            rest = [o for o in obs if o.policy == policy and o.rank != rank]
            held = [o for o in obs if o.policy == policy and o.rank == rank]
            model = fit(rest, reference_rank=reference_rank)
            out[f"{policy}:r{rank}"] = {
                "fit_without": model.to_json()["fits"][policy],
                **accuracy(model, held)[policy],
            }
    return out


def main(argv: Optional[List[str]] = None) -> None:
    """Run the probes (skipping finished or recorded ones), fit, write the result."""
    own, study = parse_args(argv)
    n = convergence.num_replicas(study)
    out_dir = Path(own.calibration_dir)
    end = own.start + own.phase * len(own.failed)
    recorded, recorded_walls = recorded_probes(own, study)
    obs: List[Observation] = []
    walls: Dict[str, float] = {}
    for cfg in own.configs:
        policy, rank = cfg.split(":")[0], int(cfg.split(":")[1])
        run_dir = out_dir / f"{policy}_r{rank}"
        metrics = run_dir / "metrics.jsonl"
        if not (run_dir / DONE).exists() and run_dir.name in recorded:
            # From the committed result (its probe directory is gone).
            walls[run_dir.name] = recorded_walls.get(run_dir.name, float("nan"))
            obs += [
                Observation(o["policy"], o["takeover_share"], o["samples_lost_share"],
                            o["rank"], o["error"],
                            {"run": o["run"], "iteration": o["iteration"], "failed": o["failed"]})
                for o in recorded[run_dir.name]
            ]  # fmt: skip
            print(f"{run_dir.name}: from {own.output}", flush=True)
            continue
        if not (run_dir / DONE).exists():
            metrics.unlink(missing_ok=True)
            cmd = convergence.trainer_command(study, own.seed, metrics, study.master_port) + [
                "--exit-interval", str(end - 1), "--mecefo", "--mecefo-policy", policy,
                "--mecefo-rank", str(rank), "--mecefo-grad-error-interval", "1",
                *fail_flags(own, n),
            ]  # fmt: skip
            wall = convergence.run_trainer(cmd, run_dir)
            (run_dir / DONE).write_text(f"{wall:.1f}\n")
            print(f"{run_dir.name}: {wall:.0f} s", flush=True)
        walls[run_dir.name] = float((run_dir / DONE).read_text())
        obs += [
            Observation(o.policy, o.takeover_share, o.samples_lost_share, o.rank, o.error,
                        {"run": run_dir.name, **o.tags})
            for o in observations(metrics, policy, rank, n)
        ]  # fmt: skip
    model = fit(obs, reference_rank=study.mecefo_rank, source=own.output)
    result = {
        "benchmark": "grad_error_calibration",
        "config": {
            **{k: v for k, v in vars(own).items()},
            "probe_config": probe_config(own, study),
            "train_iters": study.train_iters,
            "replicas": n,
            "recipe": {k: getattr(study, k) for k in ("lr", "min_lr", "lr_warmup_iters",
                                                       "adam_beta2", "clip_grad")},
        },  # fmt: skip
        "model": model.to_json(),
        "in_sample": accuracy(model, obs),
        # Out of sample for r: each rank of a policy probed at 3 or more, predicted by the fit
        # of the other ranks' probes.
        "rank_holdout": rank_holdout(obs, study.mecefo_rank),
        # Predicted against measured per (policy, r): the rank exponent's check.
        "in_sample_by_rank": {
            f"{policy}:r{rank}": accuracy(
                model, [o for o in obs if o.policy == policy and o.rank == rank]
            )[policy]
            for policy, rank in sorted({(o.policy, o.rank) for o in obs if o.error > 0})
        },
        "observations": [
            {"policy": o.policy, "takeover_share": o.takeover_share,
             "samples_lost_share": o.samples_lost_share, "rank": o.rank, "error": o.error,
             "predicted": model.predict(o.policy, o.takeover_share, o.samples_lost_share, o.rank),
             **o.tags}
            for o in obs
        ],  # fmt: skip
        "wall_s": walls,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(own.output).write_text(json.dumps(result, indent=1) + "\n")
    for policy, f in model.to_json()["fits"].items():
        acc = result["in_sample"][policy]
        print(
            f"grad error model: {policy}: c={f['c']:.3f} gamma={f['gamma']:.3f} "
            f"delta={f['delta']:.3f}; in sample n={acc['n']} measured {acc['measured_mean']:.3f}"
            f" predicted {acc['predicted_mean']:.3f} median |rel err| "
            f"{acc['median_abs_rel_error']:.2f}"
        )
    for key, acc in result["rank_holdout"].items():
        print(
            f"  held out {key}: measured {acc['measured_mean']:.3f} predicted by the other "
            f"ranks' fit {acc['predicted_mean']:.3f} median |rel err| "
            f"{acc['median_abs_rel_error']:.2f}"
        )
    for key, acc in result["in_sample_by_rank"].items():
        print(
            f"  {key}: n={acc['n']} measured {acc['measured_mean']:.3f} predicted "
            f"{acc['predicted_mean']:.3f} median |rel err| {acc['median_abs_rel_error']:.2f}"
        )


if __name__ == "__main__":
    main()
