"""The fail-slow workers' start-up aids, read from the environment (both trainers' workers):
``MECEFO_TEST_CPUS=0,1`` pins rank ``r`` to core ``cpus[r % len(cpus)]``, and
``MECEFO_TEST_PIDS=DIR`` makes each rank write its PID to ``DIR/rank<rank>.pid`` (the outside
slowdown's target, and what the test kills)."""

from __future__ import annotations

import os
from pathlib import Path


def pin_and_record_pid() -> int:
    """Apply both aids to this process; returns its rank."""
    rank = int(os.environ.get("RANK", "0"))
    cpus = os.environ.get("MECEFO_TEST_CPUS")
    if cpus:
        cores = [int(c) for c in cpus.split(",")]
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    pids = os.environ.get("MECEFO_TEST_PIDS")
    if pids:
        (Path(pids) / f"rank{rank}.pid").write_text(str(os.getpid()))
    return rank
