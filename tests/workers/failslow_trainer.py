"""The example trainer with the final-parameter dump (``dump_trainer.py``), plus, for the
fail-slow tests and benchmark: ``MECEFO_TEST_PIDS=DIR`` makes each rank write its PID to
``DIR/rank<rank>.pid`` at start (the outside slowdown's target), and ``MECEFO_TEST_CPUS=0,1``
pins rank ``r`` to core ``cpus[r % len(cpus)]``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dump_trainer  # noqa: E402  (patches the trainer: the parameter dump)
from failslow_rank_env import pin_and_record_pid  # noqa: E402

pin_and_record_pid()

if __name__ == "__main__":
    dump_trainer.pretrain_gpt.main()
