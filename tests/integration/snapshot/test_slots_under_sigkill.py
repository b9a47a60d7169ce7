"""The two-slot protocol under SIGKILL, with a real holder process: the previous snapshot
survives a trainer killed mid-copy and restores in a fresh process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from conftest import REPO, child_env
from snapshot_holder import start_holder, stop_holder

WORKER = REPO / "tests" / "workers" / "snapshot_worker.py"


def test_sigkill_during_copy_keeps_previous_snapshot(tmp_path: Path, shm_dir: Path) -> None:
    holder = start_holder(shm_dir)
    try:
        first = tmp_path / "first.json"
        proc = subprocess.run(
            [sys.executable, str(WORKER), "write-and-die", str(shm_dir), str(first)],
            env=child_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        rank = shm_dir / "rank0"
        # Iteration 1 sealed in slot 0; iteration 2 was being copied into slot 1: no header.
        assert json.loads((rank / "slot0.json").read_text())["iteration"] == 1
        assert not (rank / "slot1.json").exists()
        assert (rank / "slot1.bin").stat().st_size > 100 << 20  # the half-written slot
        assert holder.poll() is None  # the holder outlived the trainer
        status = subprocess.run(
            [sys.executable, "-m", "megatron_mecefo.snapshot.holder", "--dir", str(shm_dir),
             "--status"], env=child_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert "rank0: slots 1 -" in status.stdout
        out = tmp_path / "restored.json"
        proc = subprocess.run(
            [sys.executable, str(WORKER), "restore", str(shm_dir), str(out)],
            env=child_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        restored = json.loads(out.read_text())
        assert restored["served"]["iteration"] == 1 and restored["served"]["path"] == "local"
        assert restored["counters"] == {"iteration": 1, "consumed_samples": 8}
        # Parameters and both Adam moments equal, bit for bit, the state snapshotted.
        assert restored["crc"] == json.loads(first.read_text())["crc"]
    finally:
        stop_holder(holder)
    assert not shm_dir.exists()  # the holder removes its directory when the job ends
