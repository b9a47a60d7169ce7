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
    """The --quick mode end to end (kills at steps 4 and 8, one round, 12 batches; the stock
    DP4 reference, checkpoint-restart, torchft where .venv-tft exists, MeCeFO auto; each with
    its own failure-free run, under the device clock): every run was measured, each
    failure-free run trained every sample at the emulated step time (torchft's with all four
    replicas in every step and at the evaluation), every system took the same kills inside its
    window, a MeCeFO run that finished skipped no sample, the common-reference column and ETTR
    are in samples, and no process is left.

    Marked slow (several minutes); ``make test-goodput`` runs it, and ``.ci/run`` with it.
    Whether checkpoint-restart finishes depends on its restarts: at T = 10 s they can outlast
    the kill interval."""
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
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "goodput (DP4" in proc.stdout.splitlines()[-1]
    res = json.loads(out.read_text())
    assert res["emulated"] and res["config"]["emulated_step_s"] > 1.0
    iters, gbs = res["config"]["global_batches"], res["config"]["global_batch_size"]
    systems = {r["system"] for r in res["runs"]}
    assert {"megatron-core-dp4", "checkpoint-restart", "mecefo-auto"} <= systems
    ref = next(r for r in res["runs"] if r["system"] == "megatron-core-dp4")
    assert ref["failure_free"] and ref["committed"] == iters and ref["samples_per_s"] > 0
    assert res["checks"]["torchft_failure_free_short"] == []
    assert all(k["equal"] for k in res["checks"]["kills_in_window"].values())
    for system in systems - {"megatron-core-dp4"}:
        pair = {r["failure_free"]: r for r in res["runs"] if r["system"] == system}
        ff, run = pair[True], pair[False]
        assert ff["rc"] == 0 and ff["committed"] == iters
        assert ff["samples_trained"] == iters * gbs, system
        if system == "torchft":
            assert (ff["rank_steps"], ff["eval_replicas"]) == (4 * iters, 4)
        # Kills at steps 4 and 8 of 12; a run stopped early took only the steps it reached.
        assert run["kills_in_window"] == 2 or (
            run["committed"] < iters and run["kills_in_window"] < 2
        ), system
        assert (
            abs(run["common_ratio"] - (run["samples_per_s"] or 0.0) / ref["samples_per_s"]) < 1e-3
        )
        assert ff["device_clock"]["phases"] > 0, system
        # Steps 2..N at no faster than the emulated step (the clock pads every phase).
        emulated = res["config"]["emulated_step_s"] * (iters - 1)
        assert ff["window_s"] >= 0.98 * emulated, (system, ff["window_s"], emulated)
        assert run["loadavg_start_end"] and 0.0 <= run["ettr"], system
        expect = (run["samples_per_s"] or 0.0) / ff["samples_per_s"]
        assert abs(run["ettr"] - expect) < 1e-3, system
        if run["rc"] == 0:
            assert run["committed"] == iters, system
            if system.startswith("mecefo"):
                assert run["skipped_samples"] == 0, system
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout
