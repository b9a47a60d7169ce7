"""A bad --mecefo-* flag end to end: the example trainer, started without torchrun, stops with
one line naming the flag."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from conftest import TRAINER, child_env


def test_bad_flag_end_to_end_without_torchrun(tmp_path: Path) -> None:
    """A new user's first try: one line naming --mecefo-rank, exit 2, before torch loads."""
    env = child_env(WORLD_SIZE="2")
    env.pop("RANK", None)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(TRAINER), "--mock-data", "--mecefo", "--mecefo-rank", "4096"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("pretrain_gpt.py: error: --mecefo-rank=4096")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert elapsed < 15, f"start-up check took {elapsed:.1f} s"
