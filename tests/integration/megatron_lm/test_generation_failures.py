"""A failure inside a generation of Megatron-LM's ``pretrain_gpt.py`` is that generation's.

Megatron-Core's dataset builder catches the barrier's collective error and raises a plain
``Exception("MockGPTDataset failed to build as a mock data generator")`` from it: the ranks
in that barrier must leave the generation, not exit (an exit is counted as a death, and the
survivors of a replica were lost with it). And a world in which no member holds trained
state (every rank that trained has died) stops the job with one line naming the last
checkpoint, instead of forming generation after generation of joiners.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mlm_runs import MECEFO, check_against_simulated, recovery_records, supervised

GENERATION = re.compile(r"\[coordinator\] generation (\d+) ")


@pytest.mark.slow
def test_death_in_the_rejoin_dataset_build_ends_only_the_generation(
    megatron_lm: Path, tmp_path: Path
) -> None:
    """DP4: rank 1 dies in iteration 3; its standby rejoins; rank 2 dies as the rejoined
    world's re-entered ``pretrain()`` builds its datasets, while the others wait in the
    builder's barrier. They leave that generation with their state (before: they exited 1,
    and the job never finished), and the run equals its simulated twin."""
    argv = ["--train-iters", "40"]
    save = tmp_path / "real"
    kills = ["--mecefo-kill", "1:3:backward", "--mecefo-kill", "2:4:dataset-build"]
    rc, real = supervised(
        megatron_lm, [*argv, *MECEFO, *kills, "--save", str(save)], tmp_path,
        supervisor=["--replace", "after:1", "--standby", "1", "--replace-ranks", "1"],
        timeout=300,
    )  # fmt: skip
    assert rc == 0, real[-6000:]
    left = [line for line in real.splitlines() if " left generation " in line]
    # The wrapped error is what the ranks in the barrier saw, and it ended their generation.
    wrapped = [line for line in left if "MockGPTDataset failed to build" in line]
    assert wrapped, "\n".join(left) or real[-6000:]
    assert all("(from " in line for line in wrapped), wrapped
    assert "exit code 1" not in real, real[-6000:]
    # Rank 2 died in generation 2, the rejoin (which never committed an iteration: no record
    # of its own); generation 3 went on without it, the joiner with its healed state.
    assert "[coordinator] generation 2 (rejoin, " in real, real[-6000:]
    records = recovery_records(tmp_path)
    assert [(r["generation"], r["ranks_lost"]) for r in records] == [(1, [1]), (3, [2])], records
    schedule = check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert sorted(v.split(":")[0] for v in schedule) == ["1", "2"], schedule


@pytest.mark.slow
def test_no_member_with_trained_state_stops_at_once(megatron_lm: Path, tmp_path: Path) -> None:
    """DP2, a checkpoint every 2 iterations: rank 1 dies in iteration 3; its standby rejoins;
    rank 0, the last rank that trained, dies as the rejoined world is built, before the
    joiner is healed. The joiner alone holds no trained state: the job stops in that
    generation with one line naming the last checkpoint and a non-zero exit (before: a new
    generation of the same joiner after every heartbeat timeout, until killed). Rank 0 dies
    before the heal, not at ``dataset-build``: after the heal the joiner holds the trained
    state and goes on alone, as the first test's members do."""
    argv = ["--train-iters", "40", "--global-batch-size", "8", "--save-interval", "2"]
    save = tmp_path / "real"
    kills = ["--mecefo-kill", "1:3:backward", "--mecefo-kill", "0:4:groups"]
    rc, out = supervised(
        megatron_lm, [*argv, *MECEFO, *kills, "--save", str(save)], tmp_path, nproc=2,
        supervisor=["--replace", "after:1", "--standby", "1", "--replace-ranks", "1"],
        timeout=300,
    )  # fmt: skip
    assert rc == 1, out[-6000:]  # -999: still running at the timeout
    # Failure (rank 1), rejoin, failure (rank 0): the joiner's world is the last one.
    generations = sorted({int(n) for n in GENERATION.findall(out)})
    assert generations == [1, 2, 3], out[-6000:]
    iteration = (save / "latest_checkpointed_iteration.txt").read_text().strip()
    # One line, the supervisor's, naming the checkpoint the tracker file names; the rank that
    # stopped the job is no death to report.
    (said,) = [line for line in out.splitlines() if "no member holds trained state" in line]
    assert said.startswith("[supervisor node 0] training aborted: "), said
    assert "died: exit code" not in out, out[-6000:]
    assert "the members left (slot 1) are joiners" in said, said
    assert said.endswith(
        f"last checkpoint: iteration {iteration} in {save}; resume with --load {save}"
    ), said
