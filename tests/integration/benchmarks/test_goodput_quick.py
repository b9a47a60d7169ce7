"""``benchmarks/goodput.py --quick`` end to end (the unit tests of its accounting are
``tests/unit/benchmarks/test_goodput.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO


@pytest.mark.slow
def test_quick_run(tmp_path: Path, text_data: str) -> None:
    """The --quick mode end to end (one setting, one round), torchft where .venv-tft exists:
    every system ran and was measured, a MeCeFO run that finished skipped no sample, and no
    process is left.

    Marked slow (4 min 8 s at load 10 and 5 min 50 s beside a CI run, load 14, over the
    4-minute share of ``make test``); ``make test-goodput`` runs it, and ``.ci/run`` with it.
    Whether a run finishes depends on where the first kill (20 s after the launch) lands:
    checkpoint-restart's restarts can outlast the kill interval."""
    out = tmp_path / "goodput.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "goodput.py"),
            "--quick",
            "--workdir",
            str(tmp_path / "work"),
            "--output",
            str(out),
            "--plot",
            str(tmp_path / "g.png"),
            "--data-path",
            text_data,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "goodput (DP4" in proc.stdout.splitlines()[-1]
    res = json.loads(out.read_text())
    runs = {r["system"]: r for r in res["runs"]}
    assert runs["failure-free"]["ettr"] == 1.0
    assert {"failure-free", "checkpoint-restart", "mecefo-neighbor"} <= set(runs)
    for name, run in runs.items():
        assert run["loadavg_start_end"] and 0.0 <= run["ettr"] <= 1.5
        if run["rc"] == 0:
            assert run["committed"] == res["config"]["global_batches"], name
            if name.startswith("mecefo"):
                assert run["skipped_samples"] == 0, name
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout
