"""Megatron-LM's ``pretrain_gpt.py`` through ``patches/run_megatron_lm_cpu.py``, for the fail-slow
test: the launcher's own ``main()``, with three test aids around it.

* ``MECEFO_TEST_CPUS=0,1`` pins rank ``r`` to core ``cpus[r % len(cpus)]``;
* ``MECEFO_TEST_PIDS=DIR``: each rank writes its PID to ``DIR/rank<rank>.pid`` (the outside
  slowdown's target, and what the test kills);
* ``MECEFO_TEST_RECORDS=DIR``: after each training step (after fail-slow's exchange) each rank
  appends one JSON line to ``DIR/rank<rank>.jsonl``: the iteration, its replica, the plan's
  micro-batches per replica and sample counts (``MecefoController.record``), the sample
  indices its schedule took (``samples_consumed``), a CRC of the tokens of each micro-batch it
  ran with that micro-batch's sample indices, and the step's ``fail_slow`` fields.

Nothing of Megatron is replaced: the records come from the plugin's own objects.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "patches"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_megatron_lm_cpu  # noqa: E402
from failslow_rank_env import pin_and_record_pid  # noqa: E402

from megatron_mecefo.megatron_lm import training_hooks  # noqa: E402
from megatron_mecefo.takeover import data_remap  # noqa: E402

_rank = pin_and_record_pid()
_records = os.environ.get("MECEFO_TEST_RECORDS")

_ran: List[Any] = []
"""(sample indices, CRC of the tokens) of each micro-batch handed to the schedule this step."""


def _install_records(out: Path) -> None:
    next_microbatch = data_remap.ReplicaMicrobatches.__next__

    def __next__(self: Any) -> Any:
        batch = next_microbatch(self)
        if batch is not None:
            tokens = batch["tokens"].contiguous().cpu().numpy().tobytes()
            _ran.append([self.processed[-1], zlib.crc32(tokens)])
        return batch

    data_remap.ReplicaMicrobatches.__next__ = __next__  # type: ignore[method-assign]
    record = training_hooks.TrainingLoopHooks._fail_slow_record
    path = out / f"rank{_rank}.jsonl"

    def _fail_slow_record(self: Any, iteration: int, fields: Dict[str, Any]) -> None:
        record(self, iteration, fields)
        ctrl = self.controller
        line = {
            "iteration": iteration,
            "replica": ctrl.replica,
            "mecefo": ctrl.record(),
            "samples": {str(k): v for k, v in ctrl.samples_consumed().items()},
            "tokens_crc": list(_ran),
            "fail_slow": fields,
        }
        _ran.clear()
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    training_hooks.TrainingLoopHooks._fail_slow_record = _fail_slow_record  # type: ignore


if _records:
    _install_records(Path(_records))

if __name__ == "__main__":
    run_megatron_lm_cpu.main()
