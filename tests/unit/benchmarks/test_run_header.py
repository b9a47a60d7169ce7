"""``benchmarks/run_header.py``: where a benchmark's plot goes."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

from run_header import plot_path  # noqa: E402


def test_a_run_written_outside_results_leaves_the_committed_plot_alone(tmp_path: Path) -> None:
    results = REPO / "results"
    assert plot_path(results / "recovery_scale.json") == results / "plots/recovery_scale.png"
    assert plot_path(results / "fail_slow.json") == results / "plots/fail_slow.png"
    assert plot_path(results / "goodput_quick.json") == results / "plots/goodput_quick.png"
    assert plot_path(results / "recovery_scale_link_probe.json") == (
        results / "plots/recovery_scale_link_probe.png"
    )
    assert plot_path(tmp_path / "trial.json") == tmp_path / "trial.png"
