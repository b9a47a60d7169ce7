"""The results pages quote their JSON files: the goodput table and the MeCeFO recovery tail
(docs/results.md), the at-scale model (docs/goodput-method.md) and the n = 32 gaps
(docs/convergence.md) are recomputed from ``results/`` and must appear as written."""

from __future__ import annotations

import json
import statistics
from typing import Any, Dict

from conftest import REPO

PAGE = (REPO / "docs" / "results.md").read_text()
AT_SCALE = (REPO / "docs" / "goodput-method.md").read_text()
CONVERGENCE = (REPO / "docs" / "convergence.md").read_text()
SYSTEMS = {
    "checkpoint-restart": "| checkpoint-restart |",
    "torchft": "| torchft |",
    "mecefo-neighbor": "| MeCeFO `neighbor` |",
    "mecefo-spread": "| MeCeFO `spread` |",
    "mecefo-auto": "| MeCeFO `auto` |",
}


def _load(path: str) -> Dict[str, Any]:
    return json.loads((REPO / "results" / path).read_text())


def _row(prefix: str, page: str = PAGE) -> str:
    rows = [line for line in page.splitlines() if line.startswith(prefix)]
    assert len(rows) == 1, (prefix, rows)
    return rows[0]


def test_goodput_table_is_the_json_per_system() -> None:
    """Each system's samples per second under kills over the common reference (the headline)
    and its ETTR against its own failure-free run, mean ± 95% interval, its failure-free
    samples per second and its kills in the window, as in the JSON; torchft's failure-free runs
    at all four replicas; no run above 1 + its system's interval."""
    res = _load("goodput.json")
    assert res["emulated"]
    assert res["checks"]["torchft_failure_free_short"] == []
    for rows in res["table"].values():
        for system, prefix in SYSTEMS.items():
            got = rows[system]
            row = _row(prefix)
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert cells[1] == f"{got['common_mean']:.2f} ± {got['common_ci95']:.2f}", row
            assert cells[2] == f"{got['ettr_mean']:.2f} ± {got['ettr_ci95']:.2f}", row
            assert cells[3] == f"{got['ff_samples_per_s_mean']:.2f}", row
            assert cells[6] == ", ".join(str(k) for k in got["kills_in_window"]), row
            assert got["runs_above_1_plus_ci95"] == [], system


def test_at_scale_goal_inputs_are_the_json() -> None:
    """MeCeFO auto at 16k GPUs per failure rate and the longest regroup that keeps it at
    >= 0.99, as computed by benchmarks/goodput_at_scale.py."""
    res = _load("goodput_at_scale.json")
    names = {
        "llama3_rate": "Llama 3",
        "meta_rsc_16k_rate": "Meta 16k",
        "meta_rsc_1k_rate": "Meta 1k",
    }
    for row in res["sensitivity"]["mecefo_auto_by_regroup"]:
        line = _row(f"| {names[row['rate']]} | {row['ettr']['2.0']:.4f} |", AT_SCALE)
        assert f"{row['max_regroup_s_for_0.99']:.1f} s" in line, line
    for r in res["rows"]:
        if r["gpus"] == 16384:
            line = _row(f"| {names[r['rate']]} | 16,384 |", AT_SCALE)
            assert f"{r['mecefo_auto']:.4f}" in line and f"{r['checkpoint_restart']:.4f}" in line


def test_mecefo_kill_to_redone_median_and_tail_are_stated() -> None:
    """The goodput runs' kill → redone: median and max over every MeCeFO recovery."""
    runs = _load("goodput.json")["runs"]
    times = [t for r in runs if r["system"].startswith("mecefo-") for t in r["recovery_total_s"]]
    text = (
        f"median {statistics.median(times):.2f} s, max {max(times):.2f} s over {len(times)} kills"
    )
    assert text in PAGE, text


def test_n32_gaps_are_the_json_intervals() -> None:
    """Each n = 32 row's mean gap and 95% t interval, for both configurations."""
    for path in ("convergence_n32/gaps.json", "convergence_n32_m2/gaps.json"):
        for policy, got in _load(path)["gaps"].items():
            gap = got["gap"]
            text = f"{gap['mean']:+.2f} [{gap['t_low']:+.2f}, {gap['t_high']:+.2f}]"
            text = text.replace("-0.00", "−0.00").replace("+-", "−").replace("-", "−")
            alt = text.replace("−", "-")
            assert text in CONVERGENCE or alt in CONVERGENCE, (path, policy, text)
