"""Promoted warm standbys run with their slot's ``LOCAL_RANK`` (so its device), under the
supervisor with real ranks. On a GPU node with 8 ranks, a replacement used to keep the
standby's ``LOCAL_RANK=0`` and bind to GPU 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import SMALL_MODEL, Job


@pytest.mark.slow
def test_promoted_standbys_run_with_their_slots_local_rank(tmp_path: Path, text_data: str):
    """4 slots on a node, DP4: ranks 2 and 3 are SIGKILLed at iterations 3 and 6 and replaced
    by the two warm standbys; each replacement finishes as its slot, with that slot's LOCAL_RANK."""
    args = SMALL_MODEL + [
        "--global-batch-size", "16", "--train-iters", "40", "--mecefo", "--data-path", text_data,
        "--mecefo-kill", "2:3:backward", "--mecefo-kill", "3:6:backward",
    ]  # fmt: skip
    job = Job(tmp_path, 4, args, supervisor_args=["--replace", "after:1", "--standby", "2"],
              MECEFO_TEST_STEP_SLEEP="0.2")  # fmt: skip
    try:
        assert job.start().wait() == [0], job.log()[-5000:]
    finally:
        job.stop()
    pids = job.rank_pids()
    standbys = {pid for (slot, _inc), pid in pids.items() if slot < 0}
    dumps = job.params()
    assert sorted(dumps) == [0, 1, 2, 3], sorted(dumps)
    for slot, dump in dumps.items():
        assert dump["local_rank"] == slot, (slot, dump["local_rank"])
        replaced = slot in (2, 3)
        assert (dump["pid"] in standbys) == replaced, (slot, dump["pid"], pids)
        assert (dump["pid"] != pids[(slot, 0)]) == replaced
