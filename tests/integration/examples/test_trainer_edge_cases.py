"""Edge cases of the example trainer, end to end (torchrun, gloo, real processes; issue 12's
regressions): an iteration with every replica down is a skipped iteration, the process-group
timeout applies to the data-parallel group, a flag error is printed once under torchrun, a
negative replica is a value, a damaged checkpoint names the file, and the data build reports
its progress."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import TRAINER, child_env, free_port, run_trainer, train_records

SMALL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--mock-data", "--eval-iters", "0", "--log-interval", "1",
]  # fmt: skip


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("pretrain_gpt.py: error:")]


def _strict_json(line: str) -> dict:
    def no_nan(name: str) -> None:
        raise ValueError(f"{name} in the metrics file")

    return json.loads(line, parse_constant=no_nan)


def test_every_replica_down_is_a_skipped_iteration(tmp_path: Path) -> None:
    """Item 3: no update, no LR step, counted as skipped, logged without NaN."""
    args = (
        SMALL
        + ["--train-iters", "5", "--lr-decay-style", "cosine", "--mecefo", "--mecefo-rank", "16"]
        + ["--mecefo-fail=0:2:4", "--mecefo-fail=1:2:4"]
    )
    proc, _ = run_trainer(2, args, tmp_path)
    metrics = sorted(tmp_path.glob("metrics_*.jsonl"))[-1]
    records = train_records([_strict_json(line) for line in metrics.read_text().splitlines()])
    lr = [r["lr"] for r in records]
    assert [r["skipped"] for r in records] == [False, True, True, False, False]
    assert lr[1] == lr[2] == lr[0] > lr[3] > lr[4]  # the schedule waits while nothing updates
    for r in records[1:3]:
        assert r["loss"] is None and r["grad_norm"] is None and r["mecefo"]["no_update"]
    assert "nan" not in proc.stdout.lower()
    lines = [line for line in proc.stdout.splitlines() if "consumed samples:" in line]
    assert "number of skipped iterations:   1" in lines[1] and "lm loss" not in lines[1]


# Waits out a collective timeout (about 45 s): in make test-all, to keep .ci/run's time.
@pytest.mark.slow
def test_pg_timeout_applies_to_the_data_parallel_group(tmp_path: Path) -> None:
    """Item 6: with MECEFO_PG_TIMEOUT_MIN=0.1 and rank 1 stopped (SIGSTOP), rank 0 waits in
    the DP gradient all-reduce (a group initialize_model_parallel creates) and must time out
    after ~6 s, not after megatron-core's 30-minute default."""
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", str(TRAINER), *SMALL, "--train-iters", "100000",
           "--metrics-file", str(metrics)]  # fmt: skip
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=child_env(MECEFO_PG_TIMEOUT_MIN="0.1"), stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    stopped = None
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "did not start"
            time.sleep(0.5)
        ranks = {
            c.environ().get("RANK"): c for c in psutil.Process(proc.pid).children(recursive=True)
        }
        stopped = ranks["1"]
        stopped.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 still waits on the stopped rank after 120 s")
        waited = time.monotonic() - t0
        assert proc.returncode != 0
        output = (tmp_path / "log.txt").read_text()
        assert "timed out" in output.lower() or "timeout" in output.lower(), output[-3000:]
        assert waited < 100, waited
    finally:
        if stopped is not None and stopped.is_running():
            stopped.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_argparse_errors_once_without_usage_under_torchrun(tmp_path: Path) -> None:
    """Item 8: an argparse error used to print the usage text once per rank."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3",
         f"--master_port={free_port()}", str(TRAINER), "--mock-data", "--num-layers", "four"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    lines = _error_lines(output)
    assert len(lines) == 1, output[-3000:]
    assert "--num-layers" in lines[0] and "'four'" in lines[0]
    assert "usage:" not in output
    # What torchrun adds (README "Flag checking"): exit code 1 and its ChildFailedError block.
    assert proc.returncode == 1 and "ChildFailedError" in output


def test_negative_replica_is_a_value(tmp_path: Path) -> None:
    """Item 8: --mecefo-fail -1:5:10 used to fail as 'expected one argument'."""
    proc = subprocess.run(
        [sys.executable, str(TRAINER), "--mock-data", "--mecefo", "--mecefo-fail", "-1:5:10"],
        cwd=tmp_path, env=child_env(WORLD_SIZE="2", RANK="0"), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    (line,) = _error_lines(proc.stderr)
    assert proc.returncode == 2 and "replica -1" in line, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    run_trainer(1, SMALL + ["--train-iters", "2", "--save", str(root / "save")], root)
    return root / "save"


def _damaged_load(tmp_path: Path, checkpoint: Path, damage: str) -> tuple[str, str]:
    import shutil

    load = tmp_path / "load"
    shutil.copytree(checkpoint, load)
    tracker = load / "latest_checkpointed_iteration.txt"
    if damage == "garbage_tracker":
        tracker.write_text("\x00\x17garbage")
        expect = str(tracker)
    elif damage == "deleted_folder":
        shutil.rmtree(load / "iter_0000002")
        expect = str(load / "iter_0000002")
    else:
        shard = sorted((load / "iter_0000002").glob("*.distcp"))[-1]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
        expect = str(shard)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
         f"--master_port={free_port()}", str(TRAINER), *SMALL, "--train-iters", "3",
         "--override-opt-param-scheduler", "--load", str(load)],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return proc.stdout + proc.stderr, expect


@pytest.mark.parametrize("damage", ["garbage_tracker", "deleted_folder", "truncated_shard"])
def test_damaged_checkpoint_names_the_file(tmp_path: Path, checkpoint: Path, damage: str):
    """Item 9: these used to end in 'invalid literal for int()', a bare FileNotFoundError
    deep in dist_checkpointing, or an unpickling error."""
    output, expect = _damaged_load(tmp_path, checkpoint, damage)
    lines = _error_lines(output)
    assert len(lines) == 1, output[-4000:]
    assert expect in lines[0], lines[0]
    assert 'pretrain_gpt.py", line' not in output  # no traceback from the trainer itself


def test_data_build_reports_progress(tmp_path: Path) -> None:
    """Item 14: the data build used to run silently for 30-50 s on a loaded machine."""
    prepare = TRAINER.parent / "prepare_data.py"
    proc = subprocess.run(
        [sys.executable, str(prepare), "--output-prefix", str(tmp_path / "d"),
         "--max-bytes", "500000"],
        env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"building {tmp_path / 'd'}.bin/.idx"), lines
    assert any(line.strip().startswith("1,000 documents") for line in lines), lines
    assert lines[-1].startswith("wrote ")
