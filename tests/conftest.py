"""Shared fixtures: a small real-text dataset, and launching the example trainer.

The tests are in ``unit/`` (one process, seconds) and ``integration/`` (real processes:
torchrun, the recovery supervisor, spawned ranks, subprocesses), each mirroring the package's
subsystems. The scripts those tests start as processes are in ``workers/``; the modules they
share (``from harness import Job``) are in ``helpers/``, which this file puts on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt.py"
WORKERS = REPO / "tests" / "workers"
sys.path.insert(0, str(REPO / "tests" / "helpers"))

# Integration twins marked slow here rather than in their files (files other work edits often):
# make test keeps one test of each kind, make test-slow and make test-all run these too. Each
# id names the twin that stays in make test. tests/unit/test_slow_twins.py checks the names.
SLOW_TWINS = {
    "tests/integration/recovery/test_etcd_mode.py::test_leader_node_sigkilled_matches_simulated": (
        "test_leader_lost_twice_with_a_rejoin (the leader SIGKILLed, twice, and a rejoin)"
    ),
}


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Mark the SLOW_TWINS slow."""
    for item in items:
        if item.nodeid.split("[")[0] in SLOW_TWINS:
            item.add_marker(pytest.mark.slow)


# A tiny LLaMA-style model that still has every parallel dimension to split.
TINY_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--lr-decay-style", "constant", "--split", "90,10,0",
    # 258 tokens pad to 512 at TP1 and TP2 alike, so the layouts build the same model.
    "--make-vocab-size-divisible-by", "256",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run_failure_cases(
    nproc: int, cases: list, out: Path, reference: bool = False, timeout: float = 900
) -> None:
    """Run ``tests/workers/failure_training_worker.py`` on ``nproc`` torchrun ranks over the
    training ``cases`` (written to ``out``; each case's results land there too)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cases{'_ref' if reference else ''}.json"
    path.write_text(json.dumps(cases))
    worker = WORKERS / "failure_training_worker.py"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", str(worker), "--cases", str(path), "--out", str(out),
    ] + (["--reference"] if reference else [])  # fmt: skip
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stderr[-8000:]}")


def run_worker(worker: Path, out: Path, layout: str, ranks: int, scenarios: list[str]) -> dict:
    """Run ``worker out layout *scenarios`` on ``ranks`` torchrun ranks; its JSON results,
    with any scenario that recorded an error reported as the failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
           f"--master-port={free_port()}", str(worker), str(out), layout, *scenarios]  # fmt: skip
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / f"{layout}.json").read_text())
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
    return results


def run_trainer(
    nproc: int, args: list[str], workdir: Path, timeout: int = 600, **env: str
) -> tuple[subprocess.CompletedProcess, list[dict[str, Any]]]:
    """torchrun the example trainer as a user would; returns the process and its metrics."""
    metrics = workdir / f"metrics_{len(list(workdir.glob('metrics_*')))}.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", str(TRAINER), *args, "--metrics-file", str(metrics),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=workdir, env=child_env(**env), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return proc, records


def train_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["type"] == "train"]


def max_down(schedule: Any) -> int:
    """Most replicas down at once, by a sweep over the [fail, recover) intervals."""
    points = []
    for e in schedule.events:
        points += [(e.fail_iteration, 1), (e.recover_iteration, -1)]
    points.sort()  # at one iteration, recoveries (-1) before failures (+1): [fail, recover)
    down = most = 0
    for _, delta in points:
        down += delta
        most = max(most, down)
    return most


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Megatron-LM core_v0.16.1's tree, unpacked and patched once per test module
    (``MEGATRON_LM_DIR`` names a checkout instead); skips the test without the tarball."""
    from mlm_runs import unpack_megatron_lm

    tree = unpack_megatron_lm(tmp_path_factory.mktemp("megatron_lm"))
    if tree is None:
        pytest.skip("no Megatron-LM tarball at ../shared/megatron-lm (set MEGATRON_LM_DIR)")
    return tree


@pytest.fixture(scope="session")
def text_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small Megatron indexed dataset of real text (stdlib docstrings), built once."""
    from megatron_mecefo.data import prepare_stdlib_dataset

    prefix = tmp_path_factory.mktemp("data") / "stdlib_text_document"
    prepare_stdlib_dataset(str(prefix), max_bytes=400_000)
    return str(prefix)


@pytest.fixture
def store():
    """``HOST:PORT`` of a fresh in-process TCPStore (the membership store of one test)."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)  # fmt: skip
    yield f"127.0.0.1:{server.port}"
    del server


@pytest.fixture(scope="module")
def trainer_args():
    """examples/pretrain_gpt/arguments.py, loaded as the trainer loads it (a module of its own
    per test module, so one module's flag parsing state never leaks into another's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "pretrain_gpt_arguments_under_test", REPO / "examples" / "pretrain_gpt" / "arguments.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def shm_dir(tmp_path: Path):
    """A holder directory in shared memory (/dev/shm when present), removed afterwards."""
    import shutil
    import uuid

    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = root / f"mecefo-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)
