"""Chaos in Megatron-LM's own ``pretrain_gpt.py`` (issue 44): seeded SIGKILLs of random
trainer processes, ranks and data-loader workers, at random moments, from outside.

Megatron-LM core_v0.16.1 (``mlm_runs``) runs DP4 under MeCeFO's recovery supervisor with
``--num-workers 1`` (a loader worker per rank) and two warm standbys (``--replace after:1
--standby 2``: each dead rank is replaced a second later, and the next event waits for the
world to be full again). The plan is the tails benchmark's (``chaos.plan``): four events, two
of them loader workers. Each kill must cost one failure generation that lost exactly that rank
(none without a lost rank, no rank left by a timeout) and one record of kill -> redone under
10 s; every sample is processed once, no checkpoint is read, and the run ends on the
parameters of its simulated twin (the same losses and rejoins replayed with ``--mecefo-fail``
under torchrun).

The takeover is exact here (``--no-mecefo-lowrank-ffn``): with the low-rank FFN weight
gradients the run ended 2.0e-3 and 4.8e-3 from its twin (losses equal up to the first failure
after two rejoins), and 3.5e-6 with exact takeovers. The likely cause (not yet confirmed):
each rank keeps the basis V of its own takeovers (computed at first use, refreshed every tau
steps from then); a heal gives a replacement the sender's basis and step, where the twin's
rank of that replica keeps its own.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List

import chaos
import pytest
from harness import left_by_timeout
from mlm_runs import MECEFO, check_against_simulated, recovery_records, supervised

KILLS, SPACING = 4, 30
"""Four events, one per 30 iterations (a warm replacement rejoins within ~8 here)."""


@pytest.mark.slow  # 93 s here (load 6-15): two Megatron-LM runs of 158 iterations
def test_chaos_kills_of_ranks_and_loader_workers(megatron_lm: Path, tmp_path: Path) -> None:
    plan = chaos.plan("megatron-lm", KILLS, SPACING)
    assert {ev["target"] for ev in plan} == {"rank", "worker"}, plan
    # Exact takeover (no low-rank FFN weight gradients): each rank's low-rank basis follows
    # its own history of takeovers, which a heal replaces by the sender's and the simulated
    # twin does not (measured with it: 2.0e-3 after a failure that follows two rejoins).
    argv = ["--train-iters", str(chaos.train_iters(KILLS, SPACING)), "--num-workers", "1",
            "--no-mecefo-lowrank-ffn"]  # fmt: skip
    save = tmp_path / "real"
    store_file = tmp_path / "store.txt"
    events: List[Dict[str, Any]] = []

    def act(proc: subprocess.Popen, log_path: Path) -> None:
        alive = lambda: proc.poll() is None  # noqa: E731
        events.extend(chaos.run(plan, tmp_path / "pids.txt", store_file, alive))

    t0, load = time.time(), os.getloadavg()[0]
    rc, real = supervised(
        megatron_lm, [*argv, *MECEFO, "--save", str(save)], tmp_path,
        supervisor=["--replace", "after:1", "--standby", "2", "--store-file", str(store_file)],
        act=act,
    )  # fmt: skip
    wall = time.time() - t0
    assert rc == 0, real[-6000:]
    assert len(events) == KILLS
    assert "loading checkpoint" not in real and "wait timeout" not in real, real[-6000:]
    assert not left_by_timeout(real), left_by_timeout(real)
    assert real.count("a data-loader worker died") == 2, real[-6000:]
    totals = chaos.check_records(events, recovery_records(tmp_path), real)
    schedule = check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert sorted(int(v.split(":")[0]) for v in schedule) == sorted(e["slot"] for e in events)
    print(f"chaos (Megatron-LM): records' kill -> redone {totals} s; from the test's kills "
          f"{[e['total_s'] for e in events]} s; run {wall:.0f} s; load {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
