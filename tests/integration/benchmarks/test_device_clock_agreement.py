"""The device clock on the example trainer: with ``--device-clock`` the failure-free step time at
4 ranks and at 3 ranks on the shared cores agree within 2%, and the CPU work of the phases fits
inside their emulated times (emulated figures). The runs are ``benchmarks/device_clock_check.py``,
which writes the same comparison, with the per-phase overruns, to
``results/device_clock_check.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import device_clock_check  # noqa: E402

ITERS = 8


@pytest.mark.slow
def test_four_and_three_ranks_step_alike_under_the_clock(tmp_path: Path, text_data: str) -> None:
    """Marked slow (two short torchrun runs, about 60 s; ``make test-goodput`` runs it).
    Without the clock the 3-rank run steps faster on the shared cores (less CPU work in
    total); with it, both last the emulated step: 2 x (forward + backward) + optimizer."""
    out = tmp_path / "check.json"
    res = device_clock_check.main(
        ["--output", str(out), "--workdir", str(tmp_path / "w"), "--data-path", text_data,
         "--iters", str(ITERS)]
    )  # fmt: skip
    assert json.loads(out.read_text())["runs"] == json.loads(json.dumps(res["runs"]))
    four, three = res["runs"]
    for run in res["runs"]:
        assert run["rc"] == 0, run["log_tail"]
        assert run["clock_logs"] == run["ranks"]
        assert len(run["step_times_s"]) == ITERS - 1
    emulated = device_clock_check.emulated_step()
    m4, m3 = four["step_mean_s"], three["step_mean_s"]
    assert abs(m4 - m3) / m3 < 0.02, (four["step_times_s"], three["step_times_s"])
    assert abs(m4 - emulated) / emulated < 0.02, (m4, emulated)
    for run in res["runs"]:
        over, ranks = run["overruns"], run["ranks"]
        # Every rank logs 5 phases per step: 2 forwards, 2 backwards and the optimizer.
        assert over["phases"] == 5 * ITERS * ranks, over
        per = over["per_phase"]
        assert {k: v["phases"] for k, v in per.items()} == {
            "forward": 2 * ITERS * ranks, "backward": 2 * ITERS * ranks,
            "optimizer": ITERS * ranks,
        }  # fmt: skip
        assert sum(v["overruns"] for v in per.values()) == over["overruns"]
        # The first step builds what later steps reuse and may overrun; later ones must fit.
        assert over["overruns"] <= 5 * ranks, over
    assert all(res["goals"].values()), res["goals"]
