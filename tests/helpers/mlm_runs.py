"""Running Megatron-LM's own ``pretrain_gpt.py`` (core_v0.16.1) on CPU ranks, for the tests.

The tree comes from ``../shared/megatron-lm/Megatron-LM-core_v0.16.1.tar.gz`` (Megatron-LM at
core_v0.16.1 without ``megatron/core``; the wheel provides that), unpacked into a temporary
folder and patched with ``patches/megatron-lm-core_v0.16.1.patch``. ``MEGATRON_LM_DIR`` points
at another checkout of that tag instead. Every run happens in its own process session and is
killed with all its processes if it fails or hangs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from conftest import REPO, child_env, free_port

from megatron_mecefo.runtime.megatron_lm_cpu import CPU_FLAGS

PATCHES = REPO / "patches"
TARBALL = REPO.parent / "shared" / "megatron-lm" / "Megatron-LM-core_v0.16.1.tar.gz"
LAUNCHER = PATCHES / "run_megatron_lm_cpu.py"

# Megatron-LM on CPU ranks over gloo: no fused kernels, the local spec; a tiny GPT (global
# batch 16). Every run of the Megatron-LM tests starts from these flags.
CPU_TINY_GPT = [
    *CPU_FLAGS,
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "16",
]  # fmt: skip
# The recovery runs: dropout off (a replica that recomputes another's micro-batch draws its own
# dropout masks), mock data, logging every iteration, a final torch-format checkpoint.
CPU_GPT = CPU_TINY_GPT + [
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--lr", "1e-3", "--lr-decay-style", "constant",
    "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--seed", "1234",
    "--ckpt-format", "torch", "--save-interval", "100000",
]  # fmt: skip
MECEFO = ["--mecefo", "--mecefo-rank", "16"]
TOLERANCE = 5e-5
"""Bound on |real - simulated| per parameter (5% of one Adam step at lr 1e-3). The survivors'
gradient all-reduce sums over the members only, where the simulated run adds the failed
replica's zero gradient too: the same numbers summed in another order, which differ in the
last bits, and Adam's m / (sqrt(v) + eps) grows them where v is small. Measured: 1.4e-7 to
5.3e-7 after 6-8 iterations, 3.0e-6 after 40, 4.7e-6 after 60, and 0 (bitwise) where two
members are left; the logged grad norms agree to every digit."""

LOST = re.compile(r"replica (\d+) lost; failed from iteration (\d+) on")
REJOINED = re.compile(r"replica (\d+) rejoined at iteration (\d+)")
SAMPLES = re.compile(r"MeCeFO summary: .*samples processed (\d+) / skipped (\d+)")


def unpack_megatron_lm(root: Path) -> Optional[Path]:
    """The patched Megatron-LM tree under ``root``, or None without the tarball."""
    checkout = os.environ.get("MEGATRON_LM_DIR")
    if checkout:
        return Path(checkout)
    if not TARBALL.is_file():
        return None
    with tarfile.open(TARBALL) as tar:
        tar.extractall(root, filter="data")
    tree = root / "Megatron-LM-core_v0.16.1"
    patch = PATCHES / "megatron-lm-core_v0.16.1.patch"
    # Inside another git work tree, `git apply` would apply nothing and exit 0: stop at root.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root))
    subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True, env=env)
    assert "megatron_mecefo" in (tree / "pretrain_gpt.py").read_text(), "the patch did not apply"
    return tree


def run_logged(
    cmd: List[str],
    log_path: Path,
    timeout: float = 600,
    act: Optional[Callable[[subprocess.Popen, Path], None]] = None,
    **env: str,
) -> int:
    """Run ``cmd`` in its own session, output to ``log_path``, with ``act(proc, log_path)``
    done to it from outside while it runs; kill the session at the end (also when ``act``
    fails)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=child_env(**env), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=log_path.parent,
        )  # fmt: skip
        try:
            if act is not None:
                act(proc, log_path)
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return -999
        finally:
            try:  # the launcher and whatever it left behind (ranks, standbys)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def torchrun(tree: Path, argv: List[str], work: Path, nproc: int = 4) -> Tuple[int, str]:
    """Megatron-LM under torchrun (no supervisor): stock, or a simulated failure."""
    log = work / f"torchrun_{len(list(work.glob('torchrun_*')))}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", str(LAUNCHER), "--megatron-lm-dir", str(tree),
           *CPU_GPT, *argv]  # fmt: skip
    rc = run_logged(cmd, log)
    return rc, log.read_text()


def supervised(
    tree: Path,
    argv: List[str],
    work: Path,
    nproc: int = 4,
    supervisor: Optional[List[str]] = None,
    timeout: float = 600,
    act: Optional[Callable[[subprocess.Popen, Path], None]] = None,
) -> Tuple[int, str]:
    """Megatron-LM under MeCeFO's recovery supervisor (records in ``work/records.jsonl``,
    pids in ``work/pids.txt``), with ``act`` (see :func:`run_logged`) done to it."""
    log = work / f"supervised_{len(list(work.glob('supervised_*')))}.log"
    cmd = [sys.executable, "-m", "megatron_mecefo.recovery.supervisor",
           f"--nproc-per-node={nproc}", "--records", str(work / "records.jsonl"),
           "--pid-file", str(work / "pids.txt"),
           *(supervisor if supervisor is not None else ["--replace", "never"]),
           "--", str(LAUNCHER), "--megatron-lm-dir", str(tree), *CPU_GPT, *argv]  # fmt: skip
    try:
        rc = run_logged(cmd, log, timeout=timeout, act=act)
    finally:  # the supervisor's session is gone; its ranks and standbys lead their own
        kill_pid_file(work / "pids.txt")
    return rc, log.read_text()


def kill_pid_file(pid_file: Path) -> None:
    """SIGKILL every process of a supervisor's ``--pid-file`` and its process group (ranks and
    standbys lead their own sessions; their data-loader workers are in them)."""
    lines = pid_file.read_text().splitlines() if pid_file.exists() else []
    for pid in (int(line.split()[2]) for line in lines):
        for kill, target in ((os.killpg, pid), (os.kill, pid)):
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def supervised_nodes(
    tree: Path,
    argv: List[str],
    work: Path,
    supervisor: List[str],
    act: Callable[[List[subprocess.Popen], List[Path]], None],
    nnodes: int = 2,
    nproc: int = 2,
    timeout: float = 600,
    node_env: Optional[Dict[int, Dict[str, str]]] = None,
) -> Tuple[List[Optional[int]], str]:
    """Megatron-LM under ``nnodes`` supervisors (one per stand-in node, ``nproc`` ranks each,
    one pid file; ``node_env``: more environment for some nodes), with ``act(procs, logs)``
    done to them; every supervisor's session and every rank is killed at the end, by PID.
    Returns the exit codes and the logs, joined."""
    procs: List[subprocess.Popen] = []
    logs = [work / f"node{k}.log" for k in range(nnodes)]
    store_file = work / "store0.txt"
    try:
        for node in range(nnodes):
            cmd = [sys.executable, "-m", "megatron_mecefo.recovery.supervisor",
                   f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--node-rank={node}",
                   "--records", str(work / "records.jsonl"), "--pid-file",
                   str(work / "pids.txt"), *supervisor]  # fmt: skip
            if node == 0:
                cmd += ["--store-file", str(store_file)]
            else:
                while not (store_file.exists() and store_file.read_text().strip()):
                    time.sleep(0.05)
                cmd += ["--store", store_file.read_text().strip()]
            cmd += ["--", str(LAUNCHER), "--megatron-lm-dir", str(tree), *CPU_GPT, *argv]
            procs.append(subprocess.Popen(
                cmd, env=child_env(**(node_env or {}).get(node, {})),
                stdout=open(logs[node], "w"), stderr=subprocess.STDOUT,
                start_new_session=True, cwd=work,
            ))  # fmt: skip
        act(procs, logs)
        deadline = time.time() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in procs], "\n".join(p.read_text() for p in logs)
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        kill_pid_file(work / "pids.txt")


def final_params(save_dir: Path) -> Dict[str, torch.Tensor]:
    """The model tensors of the newest ``--ckpt-format torch`` checkpoint in ``save_dir``,
    keyed ``<mp_rank folder>/<name>`` (every pipeline stage)."""
    iteration = (save_dir / "latest_checkpointed_iteration.txt").read_text().strip()
    out: Dict[str, torch.Tensor] = {}
    for path in sorted(
        (save_dir / f"iter_{int(iteration):07d}").glob("mp_rank_*/model_optim_rng.pt")
    ):
        state = torch.load(path, map_location="cpu", weights_only=False)
        for name, value in state["model"].items():
            if isinstance(value, torch.Tensor):
                out[f"{path.parent.name}/{name}"] = value
    return out


def max_difference(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two parameter sets with the same keys."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def failures_from_log(output: str) -> List[str]:
    """``--mecefo-fail`` values that simulate the real losses and rejoins of a supervised run:
    ``R:F`` (down from F to the end) or ``R:F:T`` (back at T)."""
    events: Dict[int, List[int]] = {}
    for replica, start in LOST.findall(output):
        events.setdefault(int(replica), []).append(int(start))
    values = []
    for replica, back in REJOINED.findall(output):
        start = events[int(replica)].pop(0)
        values.append(f"{replica}:{start}:{back}")
    values += [f"{r}:{s}" for r, starts in events.items() for s in starts]
    return values


def check_against_simulated(
    tree: Path, real: str, save: Path, work: Path, argv: List[str], nproc: int = 4
) -> List[str]:
    """The simulated run of the real run's schedule ends on the same parameters; returns
    the schedule."""
    schedule = failures_from_log(real)
    fails = [a for v in schedule for a in ("--mecefo-fail", v)]
    rc, sim = torchrun(tree, [*argv, *MECEFO, *fails, "--save", str(work / "sim")], work, nproc)
    assert rc == 0, sim[-4000:]
    diff = max_difference(final_params(save), final_params(work / "sim"))
    print(f"real vs simulated {schedule}: max |difference| {diff:.3g}")
    assert diff <= TOLERANCE, (schedule, diff)
    # Every sample of every global batch processed exactly once, in both runs.
    assert SAMPLES.findall(real)[-1] == SAMPLES.findall(sim)[-1]
    processed, skipped = SAMPLES.findall(real)[-1]
    iterations = int(argv[argv.index("--train-iters") + 1])
    assert (int(processed), int(skipped)) == (16 * iterations, 0)
    return schedule


def recovery_records(work: Path) -> List[dict]:
    """The recovery records of a supervised run (``work/records.jsonl``)."""
    path = work / "records.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r.get("type") == "recovery"]
