"""Snapshots in the example trainer (DP2 on gloo, real processes, a real holder process):
after a SIGKILLed trainer and after a whole-job crash, the job restarted on the same node
resumes from the holder's memory and ends with the parameters of an uninterrupted run, bit
for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, TRAINER, child_env, free_port, run_trainer, train_records
from snapshot_holder import start_holder, stop_holder

# Replica 1 down for iterations 3..9, so the MeCeFO basis is part of the state that matters.
ARGS = TINY_MODEL + [
    "--train-iters", "10", "--eval-iters", "0", "--mecefo", "--mecefo-fail", "1:3:10",
    "--mecefo-rank", "8", "--mecefo-basis-interval", "4", "--use-distributed-optimizer",
    "--mecefo-snapshot-interval", "2",
]  # fmt: skip


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent.with_suffix(".pt")
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    # Flat keys: the model's weights and (unless kept per rank) the optimizer's moments.
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _launch(args: list[str], metrics: Path, workdir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", str(TRAINER), *args,
           "--metrics-file", str(metrics)]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=workdir, env=child_env(), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _wait_iteration(proc: subprocess.Popen, metrics: Path, iteration: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                r = json.loads(line)
                if r["type"] == "train" and r["iteration"] >= iteration:
                    return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no iteration {iteration} within 300 s")


def _last_per_iteration(metrics: Path) -> dict[int, dict]:
    out = {}
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if r["type"] == "train":
            out[r["iteration"]] = r  # a replayed iteration: its last record
    return out


@pytest.mark.slow
def test_killed_trainer_and_crashed_job_resume_from_holder(
    tmp_path: Path, text_data: str, shm_dir: Path
) -> None:
    base = ARGS + ["--data-path", text_data]
    _, ref = run_trainer(2, base + ["--save", str(tmp_path / "ref")], tmp_path)
    ref = {r["iteration"]: r for r in train_records(ref)}
    holder = start_holder(shm_dir)
    procs: list[subprocess.Popen] = []
    try:
        # 1. One trainer SIGKILLed after iteration 5: torchrun tears its sibling down (SIGTERM,
        #    maybe mid-copy) and exits; the job restarted on the same node resumes from the
        #    holder (snapshot of iteration 4 or 6), not from disk (no --load).
        args = base + ["--mecefo-snapshot-dir", str(shm_dir), "--save", str(tmp_path / "one")]
        metrics = tmp_path / "one.jsonl"
        procs.append(_launch(args, metrics, tmp_path))
        _wait_iteration(procs[-1], metrics, 5)
        workers = _children(procs[-1].pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        procs[-1].communicate(timeout=600)
        assert procs[-1].returncode != 0
        procs.append(_launch(args, metrics, tmp_path))
        out, _ = procs[-1].communicate(timeout=600)
        assert procs[-1].returncode == 0, out[-4000:]
        assert "recovery path local (holder memory)" in out, out[-4000:]
        runs = {"one": metrics}
        # 2. The whole job dies (every process SIGKILLed); the holder keeps the snapshots and
        #    the rerun job resumes from memory, not from disk (no --load).
        args = base + ["--mecefo-snapshot-dir", str(shm_dir), "--save", str(tmp_path / "two")]
        for name in os.listdir(shm_dir):  # start this run's snapshots from nothing
            if name.startswith("rank"):
                import shutil

                shutil.rmtree(shm_dir / name)
        metrics = tmp_path / "two.jsonl"
        procs.append(_launch(args, metrics, tmp_path))
        _wait_iteration(procs[-1], metrics, 7)
        os.killpg(procs[-1].pid, signal.SIGKILL)
        procs[-1].wait()
        procs.append(_launch(args, metrics, tmp_path))
        out, _ = procs[-1].communicate(timeout=600)
        assert procs[-1].returncode == 0, out[-4000:]
        assert "recovery path local (holder memory)" in out, out[-4000:]
        runs["two"] = metrics
        for name, path in runs.items():
            records = [json.loads(x) for x in path.read_text().splitlines()]
            (restore,) = [r for r in records if r["type"] == "snapshot_restore"]
            assert restore["iteration"] in (4, 6), restore
            got = _last_per_iteration(path)
            assert sorted(got) == list(range(1, 11)), name
            for it in range(1, 11):
                for key in ("loss", "grad_norm", "lr", "consumed_samples"):
                    assert got[it][key] == ref[it][key], (name, it, key)
            mine, want = _weights(tmp_path / name / "iter_0000010"), _weights(
                tmp_path / "ref" / "iter_0000010"
            )
            assert mine.keys() == want.keys()
            assert all(torch.equal(mine[k], want[k]) for k in want), name
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        stop_holder(holder)
