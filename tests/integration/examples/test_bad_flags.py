"""A bad flag combination stops the trainer at start-up with one line naming the flag."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TRAINER, child_env, free_port


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]


CASES = [
    # (world size, flags, text the error must contain)
    (4, ["--mock-data", "--global-batch-size", "6"], "--global-batch-size=6"),
    (1, [], "--data-path"),
    (1, ["--data-path", "/nonexistent/corpus"], "--data-path /nonexistent/corpus"),
    (2, ["--mock-data", "--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
         "--hidden-size", "96"], "--num-attention-heads=3"),
    (1, ["--mock-data", "--save-interval", "5"], "--save-interval=5"),
    (1, ["--mock-data", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-layers-per-virtual-pipeline-stage=1"),
    (1, ["--mock-data", "--bf16", "--fp16"], "--bf16"),
    (1, ["--mock-data", "--device", "cuda"], "--device=cuda"),
    (1, ["--mock-data", "--split", "100,0,0"], "--split=100,0,0"),
]  # fmt: skip


@pytest.mark.parametrize("world,flags,expected", CASES, ids=[c[2] for c in CASES])
def test_bad_flags_fail_fast_with_one_line(
    tmp_path: Path, world: int, flags: list[str], expected: str
) -> None:
    # WORLD_SIZE/RANK as torchrun sets them; validation runs before any process group exists.
    env = child_env(WORLD_SIZE=str(world), RANK="0")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(TRAINER), *flags],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert elapsed < 60, f"start-up check took {elapsed:.1f} s"


def test_world_size_not_divisible_under_torchrun(tmp_path: Path) -> None:
    """The real launcher: 3 ranks cannot hold TP2; only rank 0 prints, every rank exits 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3",
         f"--master_port={free_port()}", str(TRAINER), "--mock-data",
         "--tensor-model-parallel-size", "2"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "--tensor-model-parallel-size=2" in lines[0] and "world size 3" in lines[0]
