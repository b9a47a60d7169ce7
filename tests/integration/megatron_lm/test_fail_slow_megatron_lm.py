"""Fail-slow in Megatron-LM's own ``pretrain_gpt.py`` (core_v0.16.1, patched) at DP2, with a
real slowdown: an outside process stops and continues rank 1 on a duty cycle (SIGSTOP/SIGCONT,
half of every 20 ms), the two ranks pinned to the two cores.

One run (``--mecefo --mecefo-fail-slow rebalance``) is slowed from iteration 3 until it has run
rebalanced for a few iterations, then let go; a second run of the same flags with
``--mecefo-fail-slow detect`` is never slowed (the reference). The ranks run
``tests/workers/megatron_lm_failslow.py`` (the CPU launcher plus per-rank step records).
Checked:

* detection: rank 0 logs replica 1 slow, after the slowdown started; every rank's records
  carry the same fail-slow fields and plan (the decision is identical on every rank);
* rebalancing: replica 1 then runs fewer than M micro-batches and replica 0 more; after the
  slowdown stops replica 1 is marked recovered and gets its micro-batches back;
* every sample once: each iteration's global batch, by sample index, is processed exactly once,
  and each micro-batch a replica ran has the tokens the reference run's sampler gave those
  indices (a moved micro-batch is read by index, not from the receiver's own loader);
* exactness: the same samples per step with the plan's weights make the same gradient, so every
  iteration's loss and the final parameters (the ``--save`` checkpoint) equal the reference's
  up to fp32 summation order (SGD: Adam's ``m / sqrt(v)`` would magnify that order on entries
  whose gradient is ~0).

Every rank is ended by PID, also on failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from conftest import REPO, free_port
from mlm_runs import CPU_GPT, MECEFO, final_params, max_difference, run_logged

from megatron_mecefo.failslow.duty_cycle import DutyCycle
from megatron_mecefo.takeover.data_remap import expand_ranges

WORKER = REPO / "tests" / "workers" / "megatron_lm_failslow.py"
GBS, MBS, ITERS, M = 16, 2, 30, 4
ARGS = [
    "--hidden-size", "128", "--seq-length", "256", "--max-position-embeddings", "256",
    "--optimizer", "sgd", "--lr", "0.05", "--train-iters", str(ITERS),
    *MECEFO, "--mecefo-fail-slow-threshold", "1.5", "--mecefo-fail-slow-window", "5",
]  # fmt: skip
SLOW_FROM = 3
"""Iteration after which the duty cycle starts."""
REBALANCED_FOR = 3
"""Rebalanced iterations to wait for before the duty cycle stops."""
PARAM_ATOL = 2e-5
"""Measured: the largest |difference| of a final parameter is ~1e-7 (fp32 reassociation of the
moved micro-batches' sums); a micro-batch lost or counted twice moves parameters by ~1e-3."""
LOSS_RTOL = 1e-5
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


class Run:
    """One torchrun launch of the worker at DP2; its per-rank records and PIDs."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.pids = work / "pids"
        self.records_dir = work / "records"
        self.save = work / "save"
        for d in (self.pids, self.records_dir):
            d.mkdir(parents=True)
        self.log = work / "log.txt"

    def start(self, tree: Path, mode: str, act: Any = None) -> int:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={free_port()}", str(WORKER), "--megatron-lm-dir", str(tree),
               *CPU_GPT, *ARGS, "--mecefo-fail-slow", mode, "--save", str(self.save)]  # fmt: skip
        try:
            return run_logged(
                cmd, self.log, timeout=300, act=act, MECEFO_TEST_PIDS=str(self.pids),
                MECEFO_TEST_RECORDS=str(self.records_dir), MECEFO_TEST_CPUS="0,1",
            )  # fmt: skip
        finally:
            self.kill_ranks()

    def kill_ranks(self) -> None:
        """SIGCONT and SIGKILL each rank still alive, by its PID: torchrun starts the ranks in
        sessions of their own, which killing the launcher's session does not reach. A PID is
        only signalled while it still leads its session and runs the worker (not reused)."""
        for path in self.pids.glob("rank*.pid"):
            text = path.read_text().strip()
            if not text:
                continue
            pid = int(text)
            try:
                if os.getsid(pid) != pid:
                    continue
                if WORKER.name not in Path(f"/proc/{pid}/cmdline").read_text():
                    continue
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                pass

    def rank_pid(self, rank: int, proc: subprocess.Popen, timeout: float = 120) -> int:
        path = self.pids / f"rank{rank}.pid"
        deadline = time.time() + timeout
        while not (path.exists() and path.read_text().strip()):
            self._check(proc, deadline, "the ranks' PIDs")
            time.sleep(0.1)
        return int(path.read_text())

    def records(self) -> Dict[int, List[Dict[str, Any]]]:
        """Rank -> its step records, in order (complete lines only)."""
        out: Dict[int, List[Dict[str, Any]]] = {}
        for path in self.records_dir.glob("rank*.jsonl"):
            lines = [x for x in path.read_text().splitlines() if x.strip().endswith("}")]
            out[int(path.stem[4:])] = [json.loads(x) for x in lines]
        return out

    def wait_until(self, proc: subprocess.Popen, what: str, pred: Any) -> int:
        """Wait until ``pred(rank 0's records)``; returns how many records there were."""
        deadline = time.time() + 240
        while True:
            recs = self.records().get(0, [])
            if pred(recs):
                return len(recs)
            self._check(proc, deadline, what)
            time.sleep(0.05)

    def _check(self, proc: subprocess.Popen, deadline: float, what: str) -> None:
        if proc.poll() is not None or time.time() > deadline:
            raise AssertionError(f"never saw {what}:\n{self.log.read_text()[-4000:]}")


def _rebalanced(r: Dict[str, Any]) -> bool:
    return bool(r["fail_slow"]["rebalanced"])


def _losses(log: str) -> List[Tuple[int, float]]:
    return [(int(i), float(v)) for i, v in LOSS.findall(log)]


@pytest.mark.slow  # two Megatron-LM runs at DP2: 30-55 s measured
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin ranks")
def test_slow_replica_is_rebalanced_exactly_and_given_back(
    megatron_lm: Path, tmp_path: Path
) -> None:
    started = time.time()
    slowed = Run(tmp_path / "slowed")
    let_go: List[int] = []

    def slow_down(proc: subprocess.Popen, _log: Path) -> None:
        pid = slowed.rank_pid(1, proc)
        slowed.wait_until(proc, f"iteration {SLOW_FROM}", lambda rs: len(rs) >= SLOW_FROM)
        duty = DutyCycle(pid, speed=0.5, period_ms=20)
        try:
            let_go.append(
                slowed.wait_until(
                    proc,
                    f"{REBALANCED_FOR} rebalanced iterations",
                    lambda rs: sum(_rebalanced(r) for r in rs) >= REBALANCED_FOR,
                )
            )
        finally:
            duty.stop()

    rc = slowed.start(megatron_lm, "rebalance", act=slow_down)
    log = slowed.log.read_text()
    assert rc == 0, log[-6000:]
    reference = Run(tmp_path / "reference")
    rc = reference.start(megatron_lm, "detect")
    ref_log = reference.log.read_text()
    assert rc == 0, ref_log[-6000:]

    by_rank = slowed.records()
    assert sorted(by_rank) == [0, 1]
    recs = by_rank[0]
    assert [r["iteration"] for r in recs] == list(range(1, ITERS + 1))
    # The same numbers reach every rank, so the same marks and plans on both.
    for a, b in zip(by_rank[0], by_rank[1], strict=True):
        assert a["fail_slow"] == b["fail_slow"], (a["iteration"], a["fail_slow"], b["fail_slow"])
        assert a["mecefo"]["microbatches_per_replica"] == b["mecefo"]["microbatches_per_replica"]

    # Detected, rebalanced, given back.
    fs = [r["fail_slow"] for r in recs]
    counts = [r["mecefo"]["microbatches_per_replica"] for r in recs]
    first_slow = next(i for i, f in enumerate(fs) if f["slow"] == [1])
    assert first_slow >= SLOW_FROM, "replica 1 marked slow before it was slowed"
    assert max(f["ratio"][1] for f in fs) > 1.6, "half speed shows as about 2x"
    reb = [i for i, f in enumerate(fs) if f["rebalanced"]]
    assert reb and reb[0] > first_slow, (first_slow, reb)
    for i in reb:  # replica 1 gives, replica 0 takes; the global batch stays 2 M
        assert counts[i][1] < M < counts[i][0] and sum(counts[i]) == 2 * M, counts[i]
        assert recs[i]["mecefo"]["policy"] == "rebalance", recs[i]["mecefo"]
    assert "replica 1 is slow" in log and "rebalancing from iteration" in log, log[-3000:]
    assert reb[-1] < ITERS - 1, f"still rebalanced at the end: {counts[-5:]}"
    assert "replica 1 recovered" in log and "micro-batches given back" in log, log[-3000:]
    assert all(c == [M, M] for c in counts[reb[-1] + 1 :])
    assert reb[-1] >= let_go[0] - 1
    assert fs[-1]["slow"] == []
    assert f"samples processed {GBS * ITERS} / skipped 0" in log
    assert "fail-slow rebalanced: " in log

    # Every sample once, and each micro-batch with the tokens the reference's sampler gave it.
    ref_recs = reference.records()
    ref_tokens = {
        tuple(idx): crc for rank in ref_recs.values() for r in rank for idx, crc in r["tokens_crc"]
    }
    assert len(ref_tokens) == GBS // MBS * ITERS
    assert all(
        r["mecefo"]["microbatches_per_replica"] == [M, M] for rs in ref_recs.values() for r in rs
    )
    for it in range(1, ITERS + 1):
        start = (it - 1) * GBS
        seen: Counter = Counter()
        for rank, rs in by_rank.items():
            r = rs[it - 1]
            assert r["iteration"] == it and r["replica"] == rank
            seen.update(expand_ranges(r["samples"][str(rank)]))
            for idx, crc in r["tokens_crc"]:
                assert ref_tokens[tuple(idx)] == crc, f"iteration {it}: samples {idx} differ"
            ran = sorted(i for idx, _ in r["tokens_crc"] for i in idx)
            assert ran == sorted(expand_ranges(r["samples"][str(rank)]))
        assert sorted(seen) == list(range(start, start + GBS)), (it, sorted(seen))
        assert max(seen.values()) == 1, (it, seen)

    # Exact: the unslowed run's losses and final parameters, to fp32 reassociation.
    losses, ref_losses = _losses(log), _losses(ref_log)
    assert [i for i, _ in losses] == [i for i, _ in ref_losses] == list(range(1, ITERS + 1))
    for (i, a), (_, b) in zip(losses, ref_losses, strict=True):
        assert a == pytest.approx(b, rel=LOSS_RTOL), (i, a, b)
    worst = max_difference(final_params(slowed.save), final_params(reference.save))
    print(
        f"slow at iteration {first_slow + 1}, rebalanced iterations "
        f"{[i + 1 for i in reb]} (counts {counts[reb[0]]}), let go after {let_go[0]}; "
        f"max |param diff| vs unslowed {worst:.3g}; test {time.time() - started:.0f} s"
    )
    assert worst < PARAM_ATOL, worst
