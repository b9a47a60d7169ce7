"""grad_error_calibration.py on a fresh clone: the probes recorded in the committed result
(whose probe directories are not committed) are reused when the recipe and the phases match,
and a policy probed at two ranks gets a fitted rank exponent."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "examples" / "pretrain_gpt"))
import convergence  # noqa: E402
import grad_error_calibration as calibration  # noqa: E402


def argv(tmp_path: Path, *extra: str) -> List[str]:
    data = tmp_path / "data"
    data.with_suffix(".bin").write_bytes(b"")  # parse_args checks it exists; nothing reads it
    return [
        "--virtual-replicas", "8", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "40", "--start", "10", "--phase", "2", "--failed", "1", "2", "4",
        "--calibration-dir", str(tmp_path / "probes"), "--output", str(tmp_path / "calib.json"),
        "--data-path", str(data), *extra,
    ]  # fmt: skip


@pytest.fixture
def probed(monkeypatch) -> List[str]:
    """Stands in for the trainer: error = 0.5 * share**0.5 * (r / 32)**-0.25 per degraded
    iteration (k = 1, 2, 4 of 8 replicas down, one micro-batch each)."""
    names: List[str] = []

    def run_trainer(cmd: List[str], run_dir: Path) -> float:
        names.append(run_dir.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        rank = int(cmd[cmd.index("--mecefo-rank") + 1])
        lines = []
        for it, k in enumerate((1, 1, 2, 2, 4, 4), start=10):
            share = k / 8
            lines.append(
                {"type": "train", "iteration": it, "loss": 3.0,
                 "mecefo": {"microbatches_per_replica": [1] * 8, "takeover_microbatches": k,
                            "failed_replicas": list(range(k)),
                            "grad_rel_error": 0.5 * share**0.5 * (rank / 32) ** -0.25}}
            )  # fmt: skip
        Path(cmd[cmd.index("--metrics-file") + 1]).write_text(
            "".join(json.dumps(rec) + "\n" for rec in lines)
        )
        return 7.0

    monkeypatch.setattr(convergence, "run_trainer", run_trainer)
    return names


def test_probes_at_two_ranks_fit_the_rank_exponent_and_are_reused(tmp_path, probed) -> None:
    configs = ["--configs", "spread:32", "spread:8"]
    calibration.main(argv(tmp_path, *configs))
    assert probed == ["spread_r32", "spread_r8"]
    first = json.loads((tmp_path / "calib.json").read_text())
    fit = first["model"]["fits"]["spread"]
    assert (fit["c"], fit["gamma"], fit["delta"]) == pytest.approx((0.5, 0.5, 0.25), rel=1e-6)
    assert set(first["in_sample_by_rank"]) == {"spread:r8", "spread:r32"}
    assert first["rank_holdout"] == {}  # two ranks: none can be held out
    # A fresh clone: the result is committed, the probe directories are not.
    for d in (tmp_path / "probes").iterdir():
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    probed.clear()
    calibration.main(argv(tmp_path, *configs, "--master-port", "29999"))
    assert probed == []  # both reused
    second = json.loads((tmp_path / "calib.json").read_text())
    assert second["model"] == first["model"]
    assert second["observations"] == first["observations"]
    assert second["wall_s"] == first["wall_s"]
    # Other phases: the recorded probes are not the ones asked for, so they run again.
    calibration.main(argv(tmp_path, *configs, "spread:128", "--seed", "7"))
    assert probed == ["spread_r32", "spread_r8", "spread_r128"]
    third = json.loads((tmp_path / "calib.json").read_text())
    held = third["rank_holdout"]["spread:r32"]  # predicted from r = 8 and 128 alone
    assert held["fit_without"]["delta"] == pytest.approx(0.25, rel=1e-6)
    assert held["median_abs_rel_error"] == pytest.approx(0.0, abs=1e-9)
