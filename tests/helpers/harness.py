"""Launching the example trainer under the recovery supervisor(s), and ending it by PID."""

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
from typing import Any, Callable, Dict, List, Optional

import torch
from conftest import REPO
from conftest import child_env as env

from megatron_mecefo.data.sampler import samples_of_global_batch
from megatron_mecefo.takeover.data_remap import expand_ranges

DUMP_TRAINER = REPO / "tests" / "workers" / "dump_trainer.py"

# Ordered as RecoveryConfig requires; short enough that a test never waits long on a backstop.
TIMEOUTS = [
    "--heartbeat-interval", "0.5", "--heartbeat-timeout", "6",
    "--collective-timeout", "25", "--init-timeout", "50",
]  # fmt: skip

MICRO_BATCH = 2
"""SMALL_MODEL's micro-batch size (the sampler's order in :func:`check_every_sample_once`)."""

SMALL_MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", str(MICRO_BATCH), "--lr", "3e-3",
    "--lr-decay-style", "constant", "--split", "90,10,0", "--make-vocab-size-divisible-by",
    "256", "--eval-iters", "0", "--log-interval", "1", "--mecefo-rank", "16",
]  # fmt: skip


class Job:
    """One supervised training job (one supervisor per node), ended by PID in :meth:`stop`.

    ``launch(node, argv)``, if given, returns the argv that starts node ``node``'s supervisor
    (e.g. inside a network namespace, with flags of its own); it must exec the supervisor in
    the process it starts, so that the PID is the supervisor's."""

    def __init__(
        self,
        workdir: Path,
        nproc: int,
        trainer_args: List[str],
        nnodes: int = 1,
        supervisor_args: Optional[List[str]] = None,
        launch: Optional[Callable[[int, List[str]], List[str]]] = None,
        **extra_env: str,
    ) -> None:
        self.workdir = workdir
        self.nproc, self.nnodes = nproc, nnodes
        self.trainer_args = trainer_args
        self.supervisor_args = list(supervisor_args or [])
        self.dump = workdir / "dump"
        self.dump.mkdir(parents=True, exist_ok=True)
        self.metrics = workdir / "metrics.jsonl"
        self.records = workdir / "recovery.jsonl"
        self.pid_file = workdir / "pids.txt"
        self.procs: List[subprocess.Popen] = []
        self.logs: List[Path] = []
        self.extra_env = extra_env
        self.launch = launch

    def store_file(self, node: int) -> Path:
        """Where node ``node``'s supervisor writes its store address (node 0: its own; with
        ``--store-mode etcd`` nodes 0 and 1 both write the job's ``etcd://`` address)."""
        return self.workdir / f"store{node}.txt"

    def start(self) -> Job:
        for node in range(self.nnodes):
            self.start_node(node)
        return self

    def start_node(
        self, node: int, rejoin: bool = False, extra: Optional[List[str]] = None
    ) -> subprocess.Popen:
        """Start node ``node``'s supervisor (with ``extra`` supervisor flags); ``rejoin``: a
        node that replaces a lost one (a new node 0 reads node 1's store file: the lost node's
        own is gone with it on a real cluster; ``--store-mode etcd`` only)."""
        cmd = [
            sys.executable, "-m", "megatron_mecefo.recovery.supervisor",
            "--nproc-per-node", str(self.nproc), "--nnodes", str(self.nnodes),
            "--node-rank", str(node), "--pid-file", str(self.pid_file),
            "--records", str(self.records), *TIMEOUTS, *self.supervisor_args,
        ]  # fmt: skip
        source = 1 if rejoin and node == 0 else 0
        if node in (0, 1) and not rejoin:
            cmd += ["--store-file", str(self.store_file(node))]
        if node > 0 or rejoin:
            deadline = time.time() + 60
            while not self.store_file(source).exists() and time.time() < deadline:
                time.sleep(0.1)
            cmd += ["--store", self.store_file(source).read_text()]
        if rejoin:
            cmd += ["--rejoin", *(extra or [])]
        cmd += ["--", str(DUMP_TRAINER), *self.trainer_args, "--metrics-file",
                str(self.metrics)]  # fmt: skip
        if self.launch is not None:
            cmd = self.launch(node, cmd)
        log = self.workdir / (f"node{node}.log" if not rejoin else f"node{node}-rejoin.log")
        self.logs.append(log)
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env(MECEFO_TEST_DUMP=str(self.dump), **self.extra_env),
            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def wait(self, timeout: float = 400) -> List[int]:
        deadline = time.time() + timeout
        for p in self.procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
        return [p.returncode for p in self.procs]

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def rank_pids(self) -> Dict[tuple, int]:
        """(slot, incarnation) -> pid of every rank process started so far."""
        out = {}
        if self.pid_file.exists():
            for line in self.pid_file.read_text().splitlines():
                slot, inc, pid = (int(x) for x in line.split())
                out[(slot, inc)] = pid
        return out

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while text not in self.log():
            if time.time() > deadline or all(p.poll() is not None for p in self.procs):
                raise AssertionError(f"never saw {text!r}:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Kill every supervisor and every rank it started, by PID (also after a failure)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in self.rank_pids().values():
            for kill, target in ((os.killpg, pid), (os.kill, pid)):
                try:
                    kill(target, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # ------------------------------------------------------------------ results
    def records_of(self, kind: str) -> List[Dict[str, Any]]:
        if not self.metrics.exists():
            return []
        recs = [json.loads(line) for line in self.metrics.read_text().splitlines() if line]
        return [r for r in recs if r["type"] == kind]

    def params(self) -> Dict[int, Dict[str, Any]]:
        return {int(p.stem[4:]): torch.load(p) for p in self.dump.glob("slot*.pt")}


def run_torchrun(workdir: Path, nproc: int, args: List[str]) -> Dict[int, Dict[str, Any]]:
    """The same trainer under torchrun (no supervisor): the simulated-failure reference."""
    import socket

    dump = workdir / "dump"
    dump.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={port}", str(DUMP_TRAINER), *args,
           "--metrics-file", str(workdir / "metrics.jsonl")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env(MECEFO_TEST_DUMP=str(dump)),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {int(p.stem[4:]): torch.load(p) for p in dump.glob("slot*.pt")}


def train_records(metrics: Path) -> List[Dict[str, Any]]:
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    return [r for r in recs if r["type"] == "train"]


def check_every_sample_once(
    records: List[Dict[str, Any]], iters: int, gbs: int, replicas: int, mbs: int = MICRO_BATCH
) -> None:
    """Each iteration 1..iters logged once, and its global batch processed exactly once, by
    sample index: the indices the replicas processed (the ``samples`` of each ``train``
    record) are Megatron's sampler's micro-batches of that batch (``replicas`` data-parallel
    ranks of ``mbs`` samples), each replica's own ones in the sampler's order, every index
    of the batch once (none twice, none missing); nothing skipped."""
    assert [r["iteration"] for r in records] == list(range(1, iters + 1))
    for r in records:
        it, start = r["iteration"], (r["iteration"] - 1) * gbs
        assert r["consumed_samples"] == start + gbs, r
        assert r["mecefo"]["samples_processed"] == gbs, r
        assert r["mecefo"]["samples_skipped"] == 0, r
        assert "samples" in r, f"iteration {it}: no sample indices recorded"
        sampler = {
            tuple(mb): (source, index)
            for source in range(replicas)
            for index, mb in enumerate(samples_of_global_batch(start, gbs, mbs, replicas, source))
        }
        seen: Counter = Counter()
        for replica, runs in r["samples"].items():
            indices = expand_ranges(runs)
            batches = [tuple(indices[k : k + mbs]) for k in range(0, len(indices), mbs)]
            strange = [mb for mb in batches if mb not in sampler]
            assert (
                not strange
            ), f"iteration {it}: replica {replica} read {strange}, not the sampler's"
            own = [sampler[mb][1] for mb in batches if sampler[mb][0] == int(replica)]
            assert own == sorted(own), f"iteration {it}: replica {replica}'s order {own}"
            seen.update(indices)
        twice = sorted(i for i, n in seen.items() if n > 1)
        missing = [i for i in range(start, start + gbs) if i not in seen]
        assert (
            not twice and not missing
        ), f"iteration {it}: samples processed more than once {twice}, never {missing}"


def left_by_timeout(log: str) -> List[str]:
    """The ranks' "left generation" lines whose error is a collective timeout: a survivor that
    nothing released waited for the backstop (``--collective-timeout``)."""
    return [
        line
        for line in log.splitlines()
        if " left generation " in line and re.search(r"timed out|timeout", line, re.IGNORECASE)
    ]


def max_param_diff(real: Dict[int, Dict[str, Any]], sim: Dict[int, Dict[str, Any]]) -> float:
    """Largest |real - simulated| over every surviving rank's parameters; the simulated rank
    with the same (tp, pp) and replica 0 coordinates is the reference (replicas are equal)."""
    ref = {(d["tp"], d["pp"]): d for d in sim.values()}
    worst = 0.0
    for d in real.values():
        other = ref[(d["tp"], d["pp"])]
        assert d["iteration"] == other["iteration"]
        for name, value in d["params"].items():
            worst = max(worst, (value - other["params"][name]).abs().max().item())
    return worst
