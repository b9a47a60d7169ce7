"""The example trainer with the final-parameter dump (``dump_trainer.py``), plus, for the
fail-slow tests and benchmark: ``MECEFO_TEST_PIDS=DIR`` makes each rank write its PID to
``DIR/rank<rank>.pid`` at start (the outside slowdown's target), and ``MECEFO_TEST_CPUS=0,1``
pins rank ``r`` to core ``cpus[r % len(cpus)]``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dump_trainer  # noqa: E402  (patches the trainer: the parameter dump)

_rank = int(os.environ.get("RANK", "0"))
_cpus = os.environ.get("MECEFO_TEST_CPUS")
if _cpus:
    cpus = [int(c) for c in _cpus.split(",")]
    os.sched_setaffinity(0, {cpus[_rank % len(cpus)]})
_pids = os.environ.get("MECEFO_TEST_PIDS")
if _pids:
    (Path(_pids) / f"rank{_rank}.pid").write_text(str(os.getpid()))

if __name__ == "__main__":
    dump_trainer.pretrain_gpt.main()
