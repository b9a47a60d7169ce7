"""The n = 32 convergence study end to end at toy size (slow: 8 training runs, 209 s
on the shared 2 cores): convergence.py --quick with --reuse, then the report's gap table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

EXAMPLES = REPO / "examples" / "pretrain_gpt"


@pytest.mark.slow
def test_quick_study_and_report(tmp_path) -> None:
    data = REPO / "data" / "stdlib_text_document"
    if not data.with_suffix(".bin").exists():
        pytest.skip("no data/stdlib_text_document: run `make data`")
    out = tmp_path / "study"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    study = [
        sys.executable, str(EXAMPLES / "convergence.py"), "--virtual-replicas", "8",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--quick", "--seeds", "1", "2",
        "--scenarios", "high", "--policies", "neighbor", "spread", "auto", "--reuse",
        "--master-port", "29597", "--output-dir", str(out), "--data-path", str(data),
    ]  # fmt: skip
    subprocess.run(study, check=True, env=env, cwd=REPO, timeout=600)
    conv = json.loads((out / "convergence.json").read_text())
    assert conv["config"]["train_iters"] == 60 and conv["config"]["seeds"] == [1, 2]
    assert all((out / name / "done").exists() for name in conv["runs"])
    assert conv["runs"]["seed1_high_auto"]["planner"][-1]["grad_error"] is not None
    report = [
        sys.executable, str(EXAMPLES / "convergence_report.py"), "--dir", str(out),
        "--plot", str(tmp_path / "plot.png"),
    ]  # fmt: skip
    subprocess.run(report, check=True, env=env, cwd=REPO, timeout=300)
    gaps = json.loads((out / "gaps.json").read_text())
    assert set(gaps["gaps"]) == {"neighbor", "spread", "auto"}
    for row in gaps["gaps"].values():
        assert row["gap"]["t_low"] <= row["gap"]["mean"] <= row["gap"]["t_high"]
    assert (tmp_path / "plot.png").stat().st_size > 10_000
