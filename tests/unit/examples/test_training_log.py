"""The example trainer's metrics file: which train records it holds already (a new logging
rank's late records are written once, not again after a cut-off writer's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from conftest import REPO

sys.path.insert(0, str(REPO / "examples" / "pretrain_gpt"))
from reporting import TrainingLog  # noqa: E402


def _log(path: Path) -> TrainingLog:
    log = TrainingLog(rank=0)
    log.open(SimpleNamespace(metrics_file=str(path), tensorboard_dir=None), "w")
    return log


def test_no_records_yet(tmp_path: Path) -> None:
    assert _log(tmp_path / "m.jsonl").train_iterations_from(1) == set()
    assert TrainingLog(rank=0).train_iterations_from(1) == set()  # no --metrics-file


def test_train_iterations_from_the_tail_of_a_long_file(tmp_path: Path) -> None:
    """Records over many 64 KiB chunks, other record types between them, and a last record
    cut short by its writer's death (no record)."""
    path = tmp_path / "m.jsonl"
    log = _log(path)
    for it in range(1, 3001):
        log.emit({"type": "train", "iteration": it, "pad": "x" * 200})
        if it % 7 == 0:
            log.emit({"type": "dp_weight_check", "iteration": it, "identical": True})
    log.metrics_file.write(json.dumps({"type": "train", "iteration": 3001})[:20])
    log.metrics_file.flush()
    assert path.stat().st_size > 10 * (1 << 16)
    assert log.train_iterations_from(2996) == {2996, 2997, 2998, 2999, 3000}
    assert log.train_iterations_from(3001) == set()
    assert log.train_iterations_from(1) == set(range(1, 3001))
