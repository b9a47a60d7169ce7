"""Fail-slow in the example trainer at DP2, with a real slowdown: an outside process stops and
continues rank 1 on a duty cycle (SIGSTOP/SIGCONT, half of every 20 ms), the ranks pinned to
the two cores.

One run is slowed from iteration 3 until it has run rebalanced for a few iterations, then let
go; a second run of the same flags is never slowed (the reference). Checked:

* detection and rebalancing: rank 1's replica is marked slow, then runs fewer micro-batches
  than M while replica 0 runs more; after the slowdown stops it is marked recovered and gets
  its micro-batches back (the last iterations run M each);
* every sample of every global batch is processed exactly once (by sample index);
* exactness: the same global batch per step makes the same gradient, so every iteration's loss
  and the final parameters equal the reference's up to fp32 summation order. Plain SGD keeps
  that difference at the size of the reassociation (Adam's ``m / sqrt(v)`` would magnify it
  on entries whose gradient is ~0);
* the summary's measured step times: the mean over the steps run slow and not rebalanced (the
  window that marked replica 1 slow) and over the steps run rebalanced, each equal to the mean
  of the step times logged for those iterations, beside the prediction.

Every process is ended by PID, also on failure.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from conftest import REPO, child_env, free_port
from harness import check_every_sample_once

from megatron_mecefo.failslow.duty_cycle import DutyCycle

WORKER = REPO / "tests" / "workers" / "failslow_trainer.py"
GBS, MBS, ITERS, M, WINDOW = 16, 2, 30, 4, 3
ARGS = [
    "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "256", "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS),
    "--optimizer", "sgd", "--lr", "0.05", "--lr-decay-style", "constant", "--split", "90,10,0",
    "--make-vocab-size-divisible-by", "256", "--eval-iters", "0", "--log-interval", "1",
    "--train-iters", str(ITERS), "--mecefo", "--mecefo-fail-slow-window", str(WINDOW),
]  # fmt: skip
SLOW_FROM = 3
"""Iteration after which the duty cycle starts."""
REBALANCED_FOR = 3
"""Rebalanced iterations to wait for before the duty cycle stops."""

# Measured: the largest |difference| of a final parameter is ~1e-7 (fp32 reassociation of the
# moved micro-batches' sums); a micro-batch lost or counted twice moves parameters by ~1e-3.
PARAM_ATOL = 2e-5
LOSS_RTOL = 1e-5


def _records(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip().endswith("}")]


class Run:
    """One torchrun launch of the worker, ended by PID in :meth:`stop`."""

    def __init__(self, workdir: Path, data: str, mode: str = "rebalance") -> None:
        self.workdir = workdir
        self.metrics = workdir / "metrics.jsonl"
        self.pids = workdir / "pids"
        self.dump = workdir / "dump"
        self.pids.mkdir(parents=True)
        self.dump.mkdir()
        self.log = workdir / "log.txt"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            f"--master_port={free_port()}", str(WORKER), *ARGS, "--mecefo-fail-slow", mode,
            "--data-path", data,
            "--metrics-file", str(self.metrics),
        ]  # fmt: skip
        env = child_env(
            MECEFO_TEST_DUMP=str(self.dump), MECEFO_TEST_PIDS=str(self.pids), MECEFO_TEST_CPUS="0,1"
        )
        self.proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def records(self) -> List[Dict[str, Any]]:
        return [r for r in _records(self.metrics) if r["type"] == "train"]

    def rank_pid(self, rank: int, timeout: float = 120) -> int:
        path = self.pids / f"rank{rank}.pid"
        deadline = time.time() + timeout
        while not path.exists() or not path.read_text():
            self._check_alive(deadline)
            time.sleep(0.1)
        return int(path.read_text())

    def wait_until(self, what: str, pred: Any, timeout: float = 240) -> List[Dict[str, Any]]:
        deadline = time.time() + timeout
        while True:
            recs = self.records()
            if pred(recs):
                return recs
            self._check_alive(deadline, what)
            time.sleep(0.05)

    def _check_alive(self, deadline: float, what: str = "the ranks' PIDs") -> None:
        if self.proc.poll() is not None or time.time() > deadline:
            raise AssertionError(f"never saw {what}:\n{self.log.read_text()[-4000:]}")

    def wait(self, timeout: float = 300) -> None:
        rc = self.proc.wait(timeout=timeout)
        assert rc == 0, self.log.read_text()[-4000:]

    def params(self) -> Dict[int, Dict[str, Any]]:
        return {int(p.stem[4:]): torch.load(p) for p in self.dump.glob("slot*.pt")}

    def stop(self) -> None:
        """Kill the launcher's session and every rank, by PID (also after a failure)."""
        pids = [int(p.read_text()) for p in self.pids.glob("*.pid") if p.read_text()]
        for pid in pids:  # a rank left stopped by a failed test would never die
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def _rebalanced(r: Dict[str, Any]) -> bool:
    return bool(r.get("fail_slow", {}).get("rebalanced"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin ranks")
def test_slow_replica_is_rebalanced_exactly_and_given_back(tmp_path: Path, text_data: str):
    started = time.time()
    slowed = Run(tmp_path / "slowed", text_data)
    duty = None
    try:
        pid = slowed.rank_pid(1)
        slowed.wait_until(f"iteration {SLOW_FROM}", lambda rs: len(rs) >= SLOW_FROM)
        duty = DutyCycle(pid, speed=0.5, period_ms=20)
        recs = slowed.wait_until(
            f"{REBALANCED_FOR} rebalanced iterations",
            lambda rs: sum(_rebalanced(r) for r in rs) >= REBALANCED_FOR,
        )
        duty.stop()
        let_go = len(recs)
        slowed.wait()
    finally:
        if duty is not None:
            duty.stop()
        slowed.stop()
    # The unslowed run: detection only, every replica its own M micro-batches.
    reference = Run(tmp_path / "reference", text_data, mode="detect")
    try:
        reference.wait()
    finally:
        reference.stop()

    recs = slowed.records()
    log = slowed.log.read_text()
    assert len(recs) == ITERS
    fs = [r["fail_slow"] for r in recs]
    counts = [r["mecefo"]["microbatches_per_replica"] for r in recs]
    first_slow = next(i for i, f in enumerate(fs) if f["slow"] == [1])
    assert first_slow >= SLOW_FROM, "replica 1 marked slow before it was slowed"
    assert max(f["ratio"][1] for f in fs) > 1.6, "half speed shows as about 2x"
    reb = [i for i, f in enumerate(fs) if f["rebalanced"]]
    assert reb and reb[0] > first_slow, (first_slow, reb)
    for i in reb:  # replica 1 gives, replica 0 takes; the global batch stays 2 M
        assert counts[i][1] < M < counts[i][0] and sum(counts[i]) == 2 * M, counts[i]
    assert "replica 1 is slow" in log and "rebalancing from iteration" in log, log[-3000:]
    # Given back after the slowdown stopped, and not taken again.
    assert reb[-1] < ITERS - 1, f"still rebalanced at the end: {counts[-5:]}"
    assert "replica 1 recovered" in log and "micro-batches given back" in log
    assert all(c == [M, M] for c in counts[reb[-1] + 1 :])
    assert reb[-1] >= let_go - 1
    assert fs[-1]["slow"] == []

    check_every_sample_once(recs, ITERS, GBS, 2, MBS)

    # The measured step times, from the records alone: the window of steps that marked a
    # replica slow and any marked step run balanced (not rebalanced), the rebalanced steps.
    onsets = [i for i, f in enumerate(fs) if f["slow"] and (i == 0 or not fs[i - 1]["slow"])]
    before = {j for i in onsets for j in range(max(0, i - WINDOW + 1), i + 1)}
    before |= {i for i, f in enumerate(fs) if f["slow"]}
    before = {i for i in before if not fs[i]["rebalanced"]}
    measured = fs[-1]["measured"]
    assert measured["not_rebalanced_steps"] == len(before) >= WINDOW, (measured, sorted(before))
    assert measured["rebalanced_steps"] == len(reb)
    mean_before = statistics.fmean(recs[i]["step_time_s"] for i in before)
    mean_after = statistics.fmean(recs[i]["step_time_s"] for i in reb)
    assert measured["not_rebalanced_mean_step_s"] == pytest.approx(mean_before, abs=1e-6)
    assert measured["rebalanced_mean_step_s"] == pytest.approx(mean_after, abs=1e-6)
    ms_before, ms_after = (1e3 * measured[k] for k in ("not_rebalanced_mean_step_s",
                                                         "rebalanced_mean_step_s"))  # fmt: skip
    summary = next(ln for ln in log.splitlines() if "fail-slow measured" in ln)
    assert (
        f"mean step {ms_before:.1f} ms over {len(before)} step(s) slow, not rebalanced; "
        f"{ms_after:.1f} ms over {len(reb)} step(s) rebalanced" in summary
    ), summary
    assert "predicted x" in next(ln for ln in log.splitlines() if "fail-slow rebalanced" in ln)
    print(f"measured: {ms_before:.1f} ms slow, not rebalanced ({len(before)} steps), "
          f"{ms_after:.1f} ms rebalanced ({len(reb)} steps)")  # fmt: skip

    ref = reference.records()
    assert all(r["mecefo"]["microbatches_per_replica"] == [M, M] for r in ref)
    for a, b in zip(recs, ref, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), (a["iteration"], a, b)
    mine, theirs = slowed.params(), reference.params()
    assert sorted(mine) == sorted(theirs) == [0, 1]
    worst = max(
        (v - theirs[slot]["params"][name]).abs().max().item()
        for slot in mine
        for name, v in mine[slot]["params"].items()
    )
    print(f"max |param diff| vs unslowed: {worst:.3g}; rebalanced iterations {len(reb)}; "
          f"test {time.time() - started:.0f} s")  # fmt: skip
    assert worst < PARAM_ATOL, worst
