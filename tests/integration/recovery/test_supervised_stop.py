"""A stop before the time limit (SIGTERM to every node's supervisor, as Slurm's ``--signal``)
with two supervisors: every node reports its ranks' save, whichever node's ranks end last.

Every test ends its processes by PID in ``finally`` (``Job.stop``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from harness import SMALL_MODEL, Job


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its stopped supervisor) has ended.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_a_stop_saves_on_every_node_when_the_leader_ends_first(
    tmp_path: Path, text_data: str
) -> None:
    """Node 1's supervisor is held (SIGSTOP) from the signal until node 0's supervisor has
    said that its ranks saved: node 0, which hosts the store, must stay up until node 1 has
    read that the save completed. Before the fix node 0 left at once and node 1's next store
    call failed: here node 1 exited 1 (a broken pipe); in test-slurm's time-limit part, once,
    node 4 said that its ranks "ended before their save completed"."""
    save = tmp_path / "save"
    args = SMALL_MODEL + [
        "--global-batch-size", "16", "--train-iters", "400", "--mecefo",
        "--data-path", text_data, "--exit-signal-handler", "--save", str(save),
    ]  # fmt: skip
    job = Job(tmp_path, 2, args, nnodes=2, MECEFO_TEST_STEP_SLEEP="0.05")
    leader, follower = None, None
    try:
        job.start()
        leader, follower = job.procs
        job.wait_for("iteration        3/")
        os.kill(follower.pid, signal.SIGSTOP)
        os.kill(leader.pid, signal.SIGTERM)
        os.kill(follower.pid, signal.SIGTERM)  # pending until SIGCONT, as a late delivery
        # Node 0's ranks' exit signal handler stops every rank at the same boundary (its vote
        # is a collective): node 1's ranks save and exit too, unseen by their supervisor.
        job.wait_for("ranks saved and exited", timeout=120)
        deadline = time.time() + 60
        while any(_alive(pid) for (slot, _), pid in job.rank_pids().items() if slot >= 2):
            assert time.time() < deadline, job.log()[-4000:]
            time.sleep(0.1)
        # The old leader exited within a second here; the new one waits for node 1.
        deadline = time.time() + 3
        while leader.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        os.kill(follower.pid, signal.SIGCONT)
        rc = job.wait(timeout=120)
    finally:
        if follower is not None and follower.poll() is None:
            os.kill(follower.pid, signal.SIGCONT)
        job.stop()
    log = job.log()
    assert rc == [0, 0], (rc, log[-4000:])
    assert log.count("ranks saved and exited (--exit-signal-handler)") == 2, log[-4000:]
    assert "before their save completed" not in log
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 400, saved
