"""The README's plots (PNG) from the benchmark JSON files under ``results/``.

* ``convergence_loss.png``: training loss vs step per policy (columns) and scenario (rows),
  beside the failure-free run of the same seed, failure windows shaded (darker: more replicas
  down), validation losses as markers;
* ``throughput_vs_n.png``: degraded samples/s vs n per policy, k = 1, 2, 4, with the limit
  curves of an exact and of a takeover method;
* ``grad_rel_error.png``: the logged gradient relative error vs step, per scenario and policy;
* ``failure_trace.png``: time-averaged throughput drop at n = 32 per scenario and policy, with
  the paper's LLaMA-7B high-frequency numbers.

Usage (repo root): ``.venv/bin/python benchmarks/plots.py [--results results]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

POLICY_COLORS = {
    "neighbor": "tab:blue",
    "spread": "tab:green",
    "exact": "tab:orange",
    "drop": "tab:red",
}


def smooth(values: List[float], window: int = 10) -> List[float]:
    """Trailing moving average (the first points average what there is)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def shade_failures(ax: Any, failed: List[List[int]]) -> None:
    """Shade every run of iterations with the same number of replicas down."""
    start, level = None, 0
    for it, f in enumerate(failed + [[]], start=1):
        if len(f) != level:
            if level:
                ax.axvspan(start - 0.5, it - 0.5, color="grey", alpha=0.12 * level, lw=0)
            start, level = it, len(f)


def plot_convergence(conv: Dict[str, Any], out: Path) -> None:
    """Loss vs step, one panel per (scenario, policy), first seed."""
    cfg = conv["config"]
    seed = cfg["seeds"][0]
    runs = conv["runs"]
    ff = runs[f"seed{seed}_failure-free"]
    scenarios, policies = cfg["scenarios"], cfg["policies"]
    fig, axes = plt.subplots(
        len(scenarios),
        len(policies),
        figsize=(4 * len(policies), 3 * len(scenarios)),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    low = min(min(r["loss"]) for r in runs.values())
    for i, scenario in enumerate(scenarios):
        for j, policy in enumerate(policies):
            ax = axes[i][j]
            run = runs[f"seed{seed}_{scenario}_{policy}"]
            shade_failures(ax, run["failed_replicas"])
            steps = range(1, len(ff["loss"]) + 1)
            ax.plot(steps, smooth(ff["loss"]), color="black", lw=1, label="failure-free")
            ax.plot(steps, smooth(run["loss"]), color=POLICY_COLORS[policy], lw=1, label=policy)
            for r, color in ((ff, "black"), (run, POLICY_COLORS[policy])):
                its, vals = zip(*r["valid"], strict=True)
                ax.plot(its, vals, "o", ms=3, color=color)
            gap = 100 * (run["final_valid_ppl"] / ff["final_valid_ppl"] - 1)
            ax.set_title(f"{scenario} / {policy}: ppl gap {gap:+.2f}%", fontsize=9)
            ax.set_ylim(low - 0.1, 3.6)
            if i == len(scenarios) - 1:
                ax.set_xlabel("iteration")
            if j == 0:
                ax.set_ylabel("lm loss (10-step mean; dots: valid)")
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.suptitle(
        f"Convergence, DP{cfg['nproc']} on CPU, seed {seed}: shaded = replicas down "
        "(darker = more)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_throughput(dt: Dict[str, Any], out: Path) -> None:
    """Samples/s vs n per policy, with the limit curves, one panel per k."""
    c = dt["model"]["c"]
    ks = sorted({r["k"] for r in dt["grid"]})
    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 3.6), squeeze=False)
    for ax, k in zip(axes[0], ks, strict=True):
        rows = [r for r in dt["grid"] if r["k"] == k and r["n"] > k]
        for policy, color in POLICY_COLORS.items():
            pts = sorted((r["n"], r["samples_per_s_rel"]) for r in rows if r["policy"] == policy)
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", color=color, label=policy, ms=4)
        ns = [n for n in range(k + 1, 129)]
        ax.plot(ns, [(n - k) / n for n in ns], "k--", lw=1, label="exact limit (n-k)/n")
        ax.plot(
            ns,
            [1 / (1 + c * k / (n - k)) for n in ns],
            "k:",
            lw=1.2,
            label=f"takeover limit, c={c:.2f}",
        )
        ax.set_xscale("log", base=2)
        ax.set_title(f"k = {k} replicas down", fontsize=10)
        ax.set_xlabel("n (DP replicas)")
        ax.set_ylabel("samples/s vs failure-free")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"Degraded-step throughput (model, {dt['config']['grid_microbatches_per_replica']} "
        f"micro-batches per replica, costs from shape {dt['config']['cost_shape']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_grad_error(conv: Dict[str, Any], out: Path) -> None:
    """Gradient relative error vs step, one panel per scenario, first seed."""
    cfg = conv["config"]
    seed = cfg["seeds"][0]
    scenarios = cfg["scenarios"]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.5 * len(scenarios), 3.4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        for policy in cfg["policies"]:
            errors = conv["runs"][f"seed{seed}_{scenario}_{policy}"]["grad_rel_error"]
            if errors:
                ax.plot(
                    *zip(*errors, strict=True),
                    "o-",
                    ms=3,
                    lw=0.8,
                    color=POLICY_COLORS[policy],
                    label=policy,
                )
        ax.axhline(0.6, color="black", ls="--", lw=1, label="paper: < 0.6")
        ax.set_title(f"{scenario}", fontsize=10)
        ax.set_xlabel("iteration")
        ax.set_ylabel("||g_hat - g|| / ||g||")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Gradient relative error on degraded iterations (seed {seed})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_trace(ft: Dict[str, Any], out: Path) -> None:
    """Time-averaged drop at n = 32 per scenario and policy, beside the paper's 7B numbers."""
    rows = [r for r in ft["rows"] if r["n"] == 32 and r["rate"] == "per-replica"]
    scenarios = ["low", "mid", "high", "poisson"]
    policies = list(POLICY_COLORS)
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    width = 0.8 / len(policies)
    for j, policy in enumerate(policies):
        vals = [
            next(r["drop_pct"] for r in rows if r["scenario"] == s and r["policy"] == policy)
            for s in scenarios
        ]
        xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(scenarios))]
        ax.bar(xs, vals, width, color=POLICY_COLORS[policy], label=policy)
    for (name, value), ls in zip(
        ft["paper_7b_high_drop_pct"].items(), (":", "--", "-."), strict=True
    ):
        ax.axhline(value, color="black", ls=ls, lw=1, label=f"{name}, 7B high: {value}%")
    top = max(r["drop_pct"] for r in rows)
    ax.set_ylim(0, 1.45 * top)  # room for the legend above the bars
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set_ylabel("time-averaged throughput drop (%)")
    ax.set_title(
        "Failure traces at n = 32 (model; drop counts skipped samples as lost)", fontsize=10
    )
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> None:
    """Every plot whose input exists; prints what it wrote and what it skipped."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default="results")
    args = p.parse_args(argv)
    res = Path(args.results)
    out = res / "plots"
    out.mkdir(parents=True, exist_ok=True)
    jobs = [
        ("convergence/convergence.json", plot_convergence, "convergence_loss.png"),
        ("degraded_throughput.json", plot_throughput, "throughput_vs_n.png"),
        ("convergence/convergence.json", plot_grad_error, "grad_rel_error.png"),
        ("failure_trace.json", plot_trace, "failure_trace.png"),
    ]
    written, missing = [], []
    for src, fn, name in jobs:
        path = res / src
        if not path.exists():
            missing.append(str(path))
            continue
        fn(json.loads(path.read_text()), out / name)
        written.append(str(out / name))
    print(
        f"plots: wrote {len(written)} ({', '.join(written)})"
        + (f"; missing inputs: {', '.join(missing)}" if missing else "")
    )
    if missing:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
