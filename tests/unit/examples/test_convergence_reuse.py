"""convergence.py --reuse on a fresh clone: the runs recorded in the committed
``convergence.json`` (whose run directories are not committed) are reused when the recipe
matches, so only the missing runs train (examples/pretrain_gpt/convergence.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import List

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "examples" / "pretrain_gpt"))
import convergence  # noqa: E402


def study_argv(tmp_path: Path, *extra: str) -> List[str]:
    data = tmp_path / "data"
    data.with_suffix(".bin").write_bytes(b"")  # parse_args checks it exists; nothing reads it
    return [
        "--virtual-replicas", "4", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "20", "--seeds", "1", "2", "--scenarios", "high", "--jobs", "2",
        "--data-path", str(data), "--output-dir", str(tmp_path / "study"), "--reuse", *extra,
    ]  # fmt: skip


def fake_metrics(path: Path, ppl: float) -> None:
    """A metrics file that read_metrics reads: two training records and one evaluation."""
    lines = [
        {"type": "train", "iteration": i, "loss": 3.0, "mecefo": {"degraded": True}} for i in (1, 2)
    ] + [{"type": "eval", "iteration": 2, "loss": math.log(ppl), "ppl": ppl}]
    path.write_text("".join(json.dumps(rec) + "\n" for rec in lines))


def clear_run_dirs(study: Path) -> None:
    """What a fresh clone has of the study: the summary and traces, no run directories."""
    for run_dir in study.iterdir():
        if run_dir.is_dir():
            for f in run_dir.iterdir():
                f.unlink()
            run_dir.rmdir()


@pytest.fixture
def trained(monkeypatch) -> List[str]:
    """Stands in for the trainer: records each run it is asked for and writes its metrics."""
    names: List[str] = []

    def run_trainer(cmd: List[str], run_dir: Path) -> float:
        names.append(run_dir.name)
        metrics = Path(cmd[cmd.index("--metrics-file") + 1])
        fake_metrics(metrics, 10.0 if run_dir.name.endswith("failure-free") else 11.0)
        return 5.0

    monkeypatch.setattr(convergence, "run_trainer", run_trainer)
    return names


def test_a_fresh_clone_runs_only_the_runs_the_summary_lacks(tmp_path, trained) -> None:
    convergence.main(study_argv(tmp_path, "--policies", "neighbor"))
    assert sorted(trained) == [
        "seed1_failure-free", "seed1_high_neighbor", "seed2_failure-free", "seed2_high_neighbor",
    ]  # fmt: skip
    study = tmp_path / "study"
    first = json.loads((study / "convergence.json").read_text())
    assert first["runs"]["seed1_high_neighbor"]["wall_s"] == 5.0
    clear_run_dirs(study)
    trained.clear()
    # Another policy list, job count and port: the same recipe, so the 4 runs are reused.
    convergence.main(
        study_argv(tmp_path, "--policies", "neighbor", "drop", "--master-port", "29999")
    )
    assert sorted(trained) == ["seed1_high_drop", "seed2_high_drop"]
    second = json.loads((study / "convergence.json").read_text())
    assert set(second["runs"]) == set(first["runs"]) | {"seed1_high_drop", "seed2_high_drop"}
    for name, run in first["runs"].items():
        assert second["runs"][name] == run  # carried over as recorded
    assert second["summary"]["runs"]["high/drop"]["seeds"] == [1, 2]
    assert second["summary"]["runs"]["high/neighbor"]["ppl_gap_pct_mean"] == pytest.approx(10.0)


def test_another_recipe_or_trace_is_not_reused(tmp_path, trained) -> None:
    convergence.main(study_argv(tmp_path, "--policies", "neighbor"))
    study = tmp_path / "study"
    clear_run_dirs(study)
    trained.clear()
    convergence.main(study_argv(tmp_path, "--policies", "neighbor", "--lr", "1e-2"))
    assert len(trained) == 4  # another learning rate: nothing reused, every run again
    # The summary now records --lr 1e-2; one of its traces differs from the one replayed now.
    summary = json.loads((study / "convergence.json").read_text())
    summary["schedules"]["seed2_high"]["events"] = []
    (study / "convergence.json").write_text(json.dumps(summary))
    clear_run_dirs(study)
    trained.clear()
    convergence.main(study_argv(tmp_path, "--policies", "neighbor", "--lr", "1e-2"))
    assert sorted(trained) == ["seed2_high_neighbor"]  # its trace changed; the rest reused
