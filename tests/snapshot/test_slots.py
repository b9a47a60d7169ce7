"""Snapshot slots, the two-slot protocol under SIGKILL, and the holder process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import child_env

WORKER = Path(__file__).with_name("snapshot_worker.py")


def start_holder(directory: Path) -> subprocess.Popen:
    """A snapshot holder process for ``directory``; returns once it has written its pid."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_mecefo.snapshot.holder", "--dir", str(directory)],
        env=child_env(),
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not (directory / "holder.pid").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("snapshot holder did not start")
        time.sleep(0.05)
    return proc


def stop_holder(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def shm_dir(tmp_path: Path):
    """A holder directory in shared memory (/dev/shm when present), removed afterwards."""
    import shutil
    import uuid

    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = root / f"mecefo-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


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


def test_corrupt_slot_is_not_used(tmp_path: Path) -> None:
    """A flipped byte in a sealed slot fails its CRC: the slot counts as empty."""
    from megatron_mecefo.snapshot.checksum import crc32
    from megatron_mecefo.snapshot.slots import Slot, copy_into, plan_layout

    tensors = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)}
    entries, nbytes = plan_layout(tensors)
    slot = Slot(0, str(tmp_path))
    buffer = slot.ensure(nbytes)
    copy_into(buffer, tensors, entries, non_blocking=False)
    layout = [[e.name, list(e.shape), e.dtype, e.offset, e.nbytes] for e in entries]
    header = {"iteration": 7, "nbytes": nbytes, "crc32": crc32(buffer[:nbytes]), "entries": layout}
    slot.seal(header)
    fresh = Slot(0, str(tmp_path))
    assert fresh.verify()["iteration"] == 7
    back = fresh.read(fresh.verify())
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    fresh.buffer[5] ^= 1
    assert Slot(0, str(tmp_path)).verify() is None
