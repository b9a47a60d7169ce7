"""The snapshot holder process for the tests: start it, and stop it by its process group (its
directory: the ``shm_dir`` fixture of tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import child_env


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
