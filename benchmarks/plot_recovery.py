"""One run's recovery records (``--records FILE``, JSONL) as a plot and a table.

* the plot (``--out``, PNG): one bar per recovery, at the iteration it happened; a failure's
  bar stacks detect, regroup and redo (kill -> redone), a rejoin's stacks the heal and the rest
  of the switch (boundary -> first step);
* the table (stdout): the same numbers per record, and the ``armed_cost`` and
  ``supervisor_cost`` records summed up, so the file can be read without matplotlib.

Usage (repo root): ``.venv/bin/python benchmarks/plot_recovery.py --records
results/demo/recovery.jsonl --out results/plots/recovery.png`` (the plot needs the ``plot``
extra: ``pip install -e .[plot]``; without ``--out`` only the table is printed). The fields:
docs/recovery-records.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# The parts of each bar: (record field, label, colour), per kind of record.
PARTS = {
    "failure": [
        ("detect_s", "detect", "tab:red"),
        ("regroup_s", "regroup", "tab:orange"),
        ("redo_s", "redo", "tab:blue"),
    ],
    "rejoin": [("heal_s", "heal", "tab:green"), ("switch_rest_s", "rest of the switch", "0.6")],
}


def load(path: str) -> List[Dict[str, Any]]:
    """Every record of the file, in order (a blank or torn last line is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill of the writer: the rest is whole
            continue
    return out


def bars(records: List[Dict[str, Any]]) -> List[Tuple[str, int, Dict[str, float]]]:
    """(kind, iteration, seconds per part) for each recovery record; an unknown phase is 0."""
    out = []
    for r in records:
        if r.get("type") != "recovery":
            continue
        parts = {key: float(r.get(key) or 0.0) for key, _, _ in PARTS["failure"]}
        if r["kind"] == "rejoin":
            heal = float(r.get("heal_s") or 0.0)
            rest = max(0.0, float(r.get("rejoin_s") or 0.0) - heal)
            parts = {"heal_s": heal, "switch_rest_s": rest}
        out.append((r["kind"], int(r["iteration"]), parts))
    return out


def table(records: List[Dict[str, Any]]) -> List[str]:
    """The lines printed to stdout."""
    lines = ["kind     gen  iteration  ranks          seconds (per part)"]
    for r in records:
        if r.get("type") != "recovery":
            continue
        ranks = r["ranks_lost"] if r["kind"] == "failure" else r["ranks_joined"]
        _, _, parts = bars([r])[0]
        seconds = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in parts.items())
        path = f" (recovery path {r['recovery_path']})" if r.get("recovery_path") else ""
        lines.append(
            f"{r['kind']:<8} {r['generation']:>3}  {r['iteration']:>9}  {str(ranks):<13}  "
            f"{seconds}{path}"
        )
    totals = [r["total_s"] for r in records if r.get("total_s") is not None]
    if totals:
        lines.append(
            f"kill -> redone: p50 {statistics.median(totals):.2f} s, max {max(totals):.2f} s "
            f"({len(totals)} failures)"
        )
    armed = [r for r in records if r.get("type") == "armed_cost"]
    if armed:
        cpu = sum(r["thread_cpu_s"] for r in armed)
        its = max(r["iterations"] for r in armed)
        lines.append(
            f"armed cost: {len(armed)} ranks, recovery threads {cpu:.2f} s CPU over {its} "
            "iterations"
        )
    for r in records:
        if r.get("type") == "supervisor_cost":
            lines.append(
                f"supervisor node {r['node']}: {r['cpu_s']:.2f} s CPU in {r['wall_s']:.1f} s"
            )
    return lines


def plot(records: List[Dict[str, Any]], out: str) -> None:
    """The stacked bars, one per recovery record, written to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    seen = set()
    for kind, iteration, parts in bars(records):
        bottom = 0.0
        for key, label, colour in PARTS[kind]:
            ax.bar(
                iteration,
                parts[key],
                bottom=bottom,
                color=colour,
                width=2.0,
                label=None if label in seen else label,
            )
            seen.add(label)
            bottom += parts[key]
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.set_title("recovery records: kill -> redone (failures), boundary -> first step (rejoins)")
    if seen:
        ax.legend()
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> None:
    """Print the table; write the plot when ``--out`` is given."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", required=True, help="the recovery records (JSONL)")
    p.add_argument("--out", default=None, help="PNG to write (needs matplotlib)")
    args = p.parse_args(argv)
    if not Path(args.records).is_file():
        p.error(f"--records {args.records}: no such file; pass the supervisor's --records FILE")
    records = load(args.records)
    print("\n".join(table(records)))
    if args.out:
        plot(records, args.out)
        print(f"plot_recovery: wrote {args.out}")


if __name__ == "__main__":
    main()
