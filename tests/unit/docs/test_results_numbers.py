"""docs/results.md quotes its JSON files (issue 45): the goodput table, the MeCeFO recovery
tail and the n = 32 gaps are recomputed from ``results/`` and must appear as written."""

from __future__ import annotations

import json
import statistics
from typing import Any, Dict

from conftest import REPO

PAGE = (REPO / "docs" / "results.md").read_text()
SYSTEMS = {
    "checkpoint-restart": "| checkpoint-restart |",
    "torchft": "| torchft |",
    "mecefo-neighbor": "| MeCeFO `neighbor` |",
    "mecefo-spread": "| MeCeFO `spread` |",
    "mecefo-auto": "| MeCeFO `auto` |",
}


def _load(path: str) -> Dict[str, Any]:
    return json.loads((REPO / "results" / path).read_text())


def _row(prefix: str) -> str:
    rows = [line for line in PAGE.splitlines() if line.startswith(prefix)]
    assert len(rows) == 1, (prefix, rows)
    return rows[0]


def test_goodput_table_is_the_json_per_policy_and_setting() -> None:
    """Each system's ETTR mean (min–max) per setting is the JSON's, for every policy."""
    table = _load("goodput.json")["table"]
    for system, prefix in SYSTEMS.items():
        row = _row(prefix)
        for setting in ("T40_R15", "T20_R10"):
            got = table[setting][system]
            mean = f"{got['ettr_mean']:.2f}"
            spread = f"({got['ettr_min']:.2f}–{got['ettr_max']:.2f})"
            assert mean in row, (system, setting, mean, row)
            if got["ettr_max"] > 0:
                assert spread in row, (system, setting, spread, row)


def test_best_round_ratio_names_the_policy_that_made_it() -> None:
    """Round 0 at T = 40 s: the largest ratio over torchft, and which policy reached it."""
    runs = _load("goodput.json")["runs"]
    r0 = {r["system"]: r["ettr"] for r in runs if r["setting"] == "T40_R15" and r["round"] == 0}
    mecefo = {k: v for k, v in r0.items() if k.startswith("mecefo-")}
    best = max(mecefo, key=mecefo.get)
    ratio = f"{mecefo[best] / r0['torchft']:.2f}"
    policy = best.removeprefix("mecefo-")
    assert f"{ratio} (round 0, T = 40 s), was `{policy}`'s" in PAGE, (ratio, policy)


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
            assert text in PAGE or alt in PAGE, (path, policy, text)
