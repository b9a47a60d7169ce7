"""Goodput (ETTR) under real rank deaths: checkpoint-restart, torchft and MeCeFO side by side.

One workload for every system: the example trainer's small GPT (the demo's model and data,
``data/stdlib_text_document``) at DP4 (TP1 PP1) on 4 CPU ranks (gloo), ``--iters`` global
batches of 16 sequences. One seeded schedule of real ``SIGKILL`` s, sent by this benchmark
from outside: every ``T`` seconds of wall time (counted from the launch) one random rank is
killed by PID, and the dead rank comes back after ``R`` seconds as a new process. The
schedule of a (setting, repeat) is the same for every system (same times, same victim draw;
a drawn victim that is down already passes the kill to the next live rank).

Systems:

* ``failure-free``: ``torchrun`` and the example trainer, no kill (the reference);
* ``checkpoint-restart``: the example trainer without ``--mecefo`` under
  ``torchrun --max-restarts`` (c10d rendezvous at a fixed port,
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: pytorch issue 135712), ``--save D --load D
  --save-interval K`` with K the Young/Daly interval ``sqrt(2 * save_time * T)`` over the
  failure-free step time; the save time is measured first (two short runs, with and without
  a save every 3 iterations). The agent restarts every worker; the dead rank's new process
  waits until its ``R`` seconds are over (a shim, :func:`delayed_exec`);
* ``torchft``: torchft 0.2.0's Lighthouse, Manager, ``ProcessGroupGloo`` and DDP around the
  same GPTModel (``benchmarks/goodput_torchft.py``, one replica group per process, run by the
  ``.venv-tft`` interpreter); a killed replica is started again after ``R`` s and heals from a
  peer; the shares of replicas outside a step's quorum are dropped and counted;
* ``mecefo-neighbor``, ``mecefo-spread``, ``mecefo-auto``: the example trainer with
  ``--mecefo --mecefo-policy P`` under ``python -m megatron_mecefo.recovery.supervisor
  --replace after:R --standby 1``: the survivors take the dead replica's micro-batches over,
  and the replacement rejoins and is healed from a peer.

Per run: wall time (launch to the last process's exit); ETTR = failure-free seconds per
global batch (the same round's failure-free run, its wall over its batches) x global batches
committed / wall time; the samples of the ``iters x 16`` that entered a committed update
exactly once, that were skipped (never), and the samples whose computation was repeated
(redone iterations); the final validation loss and perplexity against failure-free. Runs of a
setting go round-robin (one run of every system per round, ``--repeats`` rounds), and ratios
are taken within a round. The load average is recorded at the start and end of every run.

Usage: ``.venv/bin/python benchmarks/goodput.py [--quick]``; writes ``results/goodput.json``,
``results/plots/goodput.png`` and prints one summary line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from recovery_latency import _children  # noqa: E402  (a sibling script; /proc children)

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt.py"
TFT_TRAINER = REPO / "benchmarks" / "goodput_torchft.py"
TFT_PYTHON = REPO / ".venv-tft" / "bin" / "python"
GBS = 16
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    str(GBS),
    "--lr",
    "3e-3",
    "--lr-decay-style",
    "constant",
    "--split",
    "90,10,0",
    "--make-vocab-size-divisible-by",
    "256",
    "--eval-iters",
    "10",
    "--eval-interval",
    "100000",
    "--log-interval",
    "50",
]
SUPERVISOR_TIMEOUTS = [
    "--heartbeat-interval",
    "1",
    "--heartbeat-timeout",
    "10",
    "--collective-timeout",
    "30",
    "--init-timeout",
    "60",
]
SYSTEMS = (
    "failure-free",
    "checkpoint-restart",
    "torchft",
    "mecefo-neighbor",
    "mecefo-spread",
    "mecefo-auto",
)
# Kill every T s, back after R s. The runs last about 80 s failure-free here (400 batches plus
# start-up), so T = 40 s gives 2 kills a run and T = 20 s 4; T = 60 s would give at most one.
SETTINGS = {"T40_R15": (40.0, 15.0), "T20_R10": (20.0, 10.0)}


def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_jsonl(path: Path) -> List[Dict[str, Any]]:
    """The complete JSON lines of ``path`` (a rank killed mid-write leaves a torn one)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> List[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _environ_int(pid: int, key: str) -> Optional[int]:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(key.encode() + b"="):
            return int(item.split(b"=", 1)[1])
    return None


def _kill(pids: List[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Killer:
    """The seeded kill schedule of one run: kill ``k`` is due ``k * T`` s after the launch."""

    def __init__(self, t0: float, period: float, repair: float, seed: int) -> None:
        self.t0, self.period, self.repair = t0, period, repair
        self.rng = random.Random(seed)
        self.next_k = 1
        self.events: List[Dict[str, Any]] = []

    def due(self) -> bool:
        return time.time() >= self.t0 + self.next_k * self.period

    def fire(self, live: Dict[int, int], on_kill: Callable[[int, float], None]) -> None:
        """Kill the drawn rank (or the next live one) among ``live`` (slot -> pid)."""
        drawn = self.rng.randrange(4)
        self.next_k += 1
        slot = next((s % 4 for s in range(drawn, drawn + 4) if s % 4 in live), None)
        event: Dict[str, Any] = {"k": self.next_k - 1, "drawn": drawn, "slot": slot}
        if slot is not None:
            t = time.time()
            _kill([live[slot]])
            event.update(pid=live[slot], t=round(t - self.t0, 3))
            on_kill(slot, t)
        self.events.append(event)


def _wait(
    proc: subprocess.Popen,
    killer: Optional[Killer],
    live: Callable[[], Dict[int, int]],
    on_kill: Callable[[int, float], None],
    deadline: float,
    tick: Callable[[], None] = lambda: None,
) -> Optional[int]:
    """Run the kill schedule until ``proc`` ends or the deadline passes (then None)."""
    while proc.poll() is None:
        if time.time() > deadline:
            return None
        if killer is not None and killer.due():
            killer.fire(live(), on_kill)
        tick()
        time.sleep(0.05)
    return proc.returncode


def _start(cmd: List[str], log: Path, **env: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env=_env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _session_members(sids: set) -> List[int]:
    """Processes of this interpreter in the sessions ``sids``: a rank killed while saving
    leaves dist_checkpointing's helper processes behind, re-parented to init but still in the
    rank's session (torchrun and the supervisor start each rank as a session leader)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            sid = int((d / "stat").read_text().rsplit(") ", 1)[1].split()[3])
            cmd = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if sid in sids and cmd == sys.executable:
            found.append(int(d.name))
    return found


def _stop(proc: subprocess.Popen, pids: List[int]) -> None:
    """End ``proc``'s process group, every PID in ``pids`` and whatever is left in their
    sessions, by PID, and reap ``proc``."""
    pids = list(pids) + _descendants(proc.pid)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _kill(pids)
    proc.wait()
    _kill(_session_members({proc.pid, *pids}))


def _example_result(metrics: Path) -> Dict[str, Any]:
    """Train records (the last one of each iteration) and the final eval of a metrics file."""
    recs = _read_jsonl(metrics)
    train = [r for r in recs if r.get("type") == "train"]
    evals = [r for r in recs if r.get("type") == "eval"]
    last: Dict[int, Dict[str, Any]] = {}
    for r in train:
        last[r["iteration"]] = r
    return {"logged": len(train), "last": last, "eval": evals[-1] if evals else None}


def _trainer_args(iters: int, metrics: Path, data: str) -> List[str]:
    return [
        str(TRAINER),
        *MODEL,
        "--data-path",
        data,
        "--train-iters",
        str(iters),
        "--metrics-file",
        str(metrics),
    ]


def _torchrun(port: int, restarts: int, run_id: str) -> List[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "--max-restarts",
        str(restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
    ]


def _finish(run: Dict[str, Any], t0: float, load0: Tuple[float, ...]) -> Dict[str, Any]:
    run["wall_s"] = round(time.time() - t0, 2)
    run["loadavg_start_end"] = [list(load0), list(os.getloadavg())]
    return run


# ---------------------------------------------------------------- the systems


def run_failure_free(run_dir: Path, iters: int, data: str, save_every: int = 0) -> Dict:
    """The reference: torchrun, no kill (``save_every``: the save-time calibration)."""
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    args = _trainer_args(iters, metrics, data)
    if save_every:
        ckpt = run_dir / "ckpt"
        subprocess.run(["rm", "-rf", str(ckpt)], check=True)
        args += ["--save", str(ckpt), "--save-interval", str(save_every)]
    load0, t0 = os.getloadavg(), time.time()
    proc = _start(
        [*_torchrun(_free_port(), 0, "ff"), *args],
        run_dir / "log.txt",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    try:
        rc = _wait(proc, None, dict, lambda s, t: None, t0 + 60 + iters * 3)
    finally:
        _stop(proc, [])
    res = _example_result(metrics)
    done = len(res["last"]) if rc == 0 else 0
    return _finish(
        {
            "system": "failure-free",
            "rc": rc,
            "committed": done,
            "logged_iterations": res["logged"],
            "repeated_samples": 0,
            "skipped_samples": iters * GBS - done * GBS,
            "redone_iterations": 0,
            "eval": res["eval"],
            "kills": [],
        },
        t0,
        load0,
    )


def delayed_exec(back_dir: str, argv: List[str]) -> None:
    """The checkpoint-restart shim: a worker whose rank is still 'down' waits until its
    repair time is over (``back_dir/back_<LOCAL_RANK>`` holds it), then becomes the trainer."""
    f = Path(back_dir) / f"back_{os.environ.get('LOCAL_RANK', '0')}"
    if f.exists():
        wait = float(f.read_text()) - time.time()
        if wait > 0:
            time.sleep(wait)
    os.execv(sys.executable, [sys.executable, *argv])


def run_checkpoint_restart(
    run_dir: Path,
    iters: int,
    data: str,
    period: float,
    repair: float,
    seed: int,
    k: int,
    budget: float,
) -> Dict:
    """Stock checkpoint-restart under torchrun, killed on the schedule."""
    metrics, ckpt = run_dir / "metrics.jsonl", run_dir / "ckpt"
    metrics.unlink(missing_ok=True)
    subprocess.run(["rm", "-rf", str(ckpt)], check=True)
    for f in run_dir.glob("back_*"):
        f.unlink()
    cmd = [
        *_torchrun(_free_port(), 1000, "cr"),
        str(Path(__file__).resolve()),
        "--delayed-exec",
        str(run_dir),
        "--",
        *_trainer_args(iters, metrics, data),
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
        "--save-interval",
        str(k),
    ]
    load0, t0 = os.getloadavg(), time.time()
    # LOGLEVEL=INFO: the agent's restart lines. TORCH_DISABLE_SHARE_RDZV_TCP_STORE: without it
    # the restarted gloo ranks read the dead attempt's addresses and fail or hang in init.
    proc = _start(cmd, run_dir / "log.txt", LOGLEVEL="INFO", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    killer = Killer(t0, period, repair, seed)
    seen: set = set()

    def live() -> Dict[int, int]:
        out = {}
        for pid in _children(proc.pid):  # the agent's workers (not their own children)
            lr = _environ_int(pid, "LOCAL_RANK")
            if lr is not None and _alive(pid):
                out[lr] = pid
        seen.update(out.values())
        return out

    def on_kill(slot: int, t: float) -> None:
        (run_dir / f"back_{slot}").write_text(repr(t + repair))

    try:
        rc = _wait(proc, killer, live, on_kill, t0 + budget, tick=live)
    finally:
        _stop(proc, sorted(seen))
    res = _example_result(metrics)
    log = (run_dir / "log.txt").read_text(errors="replace")
    restarts = len(re.findall(r"will restart worker group", log))
    saved = [int(m) for m in re.findall(r"saved checkpoint at iteration (\d+)", log)]
    committed = iters if rc == 0 else max(saved, default=0)
    # Redone: iterations logged more than once, plus the one in flight at each restart.
    redone = res["logged"] - len(res["last"]) + restarts
    return _finish(
        {
            "system": "checkpoint-restart",
            "rc": rc,
            "committed": committed,
            "save_interval": k,
            "restarts": restarts,
            "logged_iterations": res["logged"],
            "redone_iterations": redone,
            "repeated_samples": redone * GBS,
            "skipped_samples": (iters - committed) * GBS,
            "eval": res["eval"],
            "kills": killer.events,
        },
        t0,
        load0,
    )


def run_mecefo(
    run_dir: Path,
    iters: int,
    data: str,
    period: float,
    repair: float,
    seed: int,
    policy: str,
    budget: float,
) -> Dict:
    """MeCeFO under the supervisor: survivors take over, replacements rejoin after R s."""
    metrics, records, pid_file = (
        run_dir / n for n in ("metrics.jsonl", "records.jsonl", "pids.txt")
    )
    for f in (metrics, records, pid_file):
        f.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "megatron_mecefo.recovery.supervisor",
        "--nproc-per-node=4",
        "--pid-file",
        str(pid_file),
        *SUPERVISOR_TIMEOUTS,
        "--replace",
        f"after:{repair:g}",
        "--standby",
        "1",
        "--max-replacements",
        "1000",
        "--records",
        str(records),
        "--",
        *_trainer_args(iters, metrics, data),
        "--mecefo",
        "--mecefo-rank",
        "16",
        "--mecefo-policy",
        policy,
    ]
    load0, t0 = os.getloadavg(), time.time()
    proc = _start(cmd, run_dir / "log.txt")
    killer = Killer(t0, period, repair, seed)

    def live() -> Dict[int, int]:
        holders: Dict[int, int] = {}
        if pid_file.exists():
            for line in pid_file.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3:
                    holders[int(parts[0])] = int(parts[2])  # the last line of a slot holds it
        return {s: p for s, p in holders.items() if _alive(p)}

    all_pids: List[int] = []
    try:
        rc = _wait(proc, killer, live, lambda s, t: None, t0 + budget)
    finally:
        if pid_file.exists():
            all_pids = [
                int(ln.split()[2])
                for ln in pid_file.read_text().splitlines()
                if len(ln.split()) == 3
            ]
        _stop(proc, all_pids)
    res = _example_result(metrics)
    recs = [r for r in _read_jsonl(records) if r.get("type") == "recovery"]
    fails = [r for r in recs if r.get("kind") == "failure"]
    skipped = sum(r.get("mecefo", {}).get("samples_skipped", 0) for r in res["last"].values())
    # A rank 0 killed between an iteration's commit and its metrics line leaves that line out:
    # a run that finished committed every iteration, logged or not.
    committed = iters if rc == 0 else len(res["last"])
    redone = res["logged"] - len(res["last"]) + len(fails)
    return _finish(
        {
            "system": f"mecefo-{policy}",
            "rc": rc,
            "committed": committed,
            "logged_iterations": res["logged"],
            "failures": len(fails),
            "rejoins": sum(1 for r in recs if r.get("kind") == "rejoin"),
            "redone_iterations": redone,
            "repeated_samples": sum(r.get("samples_redone", 0) for r in fails)
            + (res["logged"] - len(res["last"])) * GBS,
            "skipped_samples": skipped + (iters - committed) * GBS,
            "unlogged_iterations": iters - len(res["last"]) if rc == 0 else 0,
            "degraded_iterations": sum(
                1 for r in res["last"].values() if r.get("mecefo", {}).get("degraded")
            ),
            "recovery_total_s": [r.get("total_s") for r in fails],
            "eval": res["eval"],
            "kills": killer.events,
        },
        t0,
        load0,
    )


LIGHTHOUSE = """
import sys, time
from torchft._torchft import LighthouseServer
s = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
                     heartbeat_timeout_ms=5000)
print("LIGHTHOUSE_ADDR", s.address(), flush=True)
time.sleep(1e9)
"""


def run_torchft(
    run_dir: Path, iters: int, data: str, period: float, repair: float, seed: int, budget: float
) -> Dict:
    """torchft at DP4: 4 replica groups of one process, Lighthouse, heal from a peer."""
    for f in run_dir.glob("replica*.jsonl"):
        f.unlink()
    load0, t0 = os.getloadavg(), time.time()
    lh_log = run_dir / "lighthouse.txt"
    lh = _start([str(TFT_PYTHON), "-c", LIGHTHOUSE], lh_log)
    procs: Dict[int, subprocess.Popen] = {}
    every: List[subprocess.Popen] = []
    pending: Dict[int, float] = {}  # slot -> when its replacement starts
    incarnation = {s: 0 for s in range(4)}
    error = None
    killer = Killer(t0, period, repair, seed)
    try:
        while not (m := re.search(r"LIGHTHOUSE_ADDR http://([^:\s]+):(\d+)", lh_log.read_text())):
            if lh.poll() is not None or time.time() > t0 + 120:
                raise RuntimeError(f"the Lighthouse did not start: {lh_log.read_text()}")
            time.sleep(0.05)
        addr = f"http://127.0.0.1:{m.group(2)}"
        go = run_dir / "go"
        for f in [go, *run_dir.glob("go.ready*")]:
            f.unlink(missing_ok=True)

        def spawn(slot: int) -> None:
            inc = incarnation[slot]
            p = _start(
                [
                    str(TFT_PYTHON),
                    str(TFT_TRAINER),
                    "--replica-id",
                    str(slot),
                    "--lighthouse",
                    addr,
                    "--train-iters",
                    str(iters),
                    "--data-path",
                    data,
                    "--metrics-file",
                    str(run_dir / f"replica{slot}_{inc}.jsonl"),
                    "--wait-go",
                    str(go),
                ],
                run_dir / f"replica{slot}_{inc}.log",
            )
            procs[slot] = p
            every.append(p)

        for s in range(4):
            spawn(s)

        def live() -> Dict[int, int]:
            return {s: p.pid for s, p in procs.items() if p.poll() is None}

        def on_kill(slot: int, t: float) -> None:
            pending[slot] = t + repair
            incarnation[slot] += 1

        deadline = t0 + budget
        done_t: Optional[float] = None
        while True:
            if not go.exists() and all(Path(f"{go}.ready{s}").exists() for s in range(4)):
                go.touch()
            for s, when in list(pending.items()):
                if time.time() >= when:
                    del pending[s]
                    spawn(s)
            states = [p.poll() for p in procs.values()]
            if not pending and all(st is not None for st in states):
                break
            # A replica that reached the last step ends the job: a replacement still starting
            # would wait for a quorum that never comes (its peers are gone).
            if done_t is None and any(p.poll() == 0 for p in every):
                done_t = time.time()
            if done_t is not None and time.time() > done_t + 5:
                break
            if time.time() > deadline:
                error = "deadline"
                break
            if killer.due():
                killer.fire(live(), on_kill)
            time.sleep(0.05)
    finally:
        _stop(lh, [p.pid for p in every])
        for p in every:
            _stop(p, [])
    recs = [r for f in sorted(run_dir.glob("replica*.jsonl")) for r in _read_jsonl(f)]
    return _finish(
        {
            "system": "torchft",
            "rc": 0 if error is None else None,
            "error": error,
            **torchft_accounting(recs, iters),
            "incarnations": {str(s): i + 1 for s, i in incarnation.items()},
            "kills": killer.events,
        },
        t0,
        load0,
    )


def torchft_accounting(recs: List[Dict[str, Any]], iters: int) -> Dict[str, Any]:
    """Samples of the torchft replicas' step records: a replica's share (GBS/4) of global
    batch s entered an update exactly when it took part in the committed step s; the shares of
    replicas outside the quorum are skipped; an attempt that did not commit is redone."""
    # The job ends when the first replica has run the last step: a replacement that comes up
    # after that finds no peer and (min_replicas 1) would start a quorum of its own.
    finish = min((r["t"] for r in recs if r.get("type") == "eval"), default=math.inf)
    train = [r for r in recs if r.get("type") == "train" and r["t"] <= finish]
    share = GBS // 4
    committed_steps = {r["step"] for r in train if r["committed"]}
    used = {(r["step"], r["replica"]) for r in train if r["committed"] and r["participating"]}
    attempts: Dict[Tuple[int, int], int] = {}
    for r in train:
        if r["participating"]:
            attempts[(r["step"], r["replica"])] = attempts.get((r["step"], r["replica"]), 0) + 1
    # Repeated: a share computed again after an attempt that did not commit. (A share computed
    # in an attempt that failed and then dropped, its replica gone, counts as skipped.)
    repeated = sum(n - 1 for key, n in attempts.items() if key in used)
    failed_steps = {r["step"] for r in train if not r["committed"]}
    evals = sorted(
        (r for r in recs if r.get("type") == "eval" and r["t"] <= finish + 5),
        key=lambda r: r["replica"],
    )
    committed = len(committed_steps)
    # The job's stall: gaps between consecutive steps' first commits above 5x the median gap
    # (the failed attempt, detection, the new quorum), less the median gap each.
    first: Dict[int, float] = {}
    for r in train:
        if r["committed"]:
            first[r["step"]] = min(first.get(r["step"], math.inf), r["t"])
    times = [first[s] for s in sorted(first)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    med = statistics.median(gaps) if gaps else 0.0
    stall = sum(g - med for g in gaps if g > 5 * med)
    return {
        "committed": committed,
        "stall_s": round(stall, 3),
        "redone_iterations": len(failed_steps),
        "repeated_samples": repeated * share,
        "skipped_samples": iters * GBS - len(used) * share,
        "participants_histogram": {
            str(n): sum(
                1
                for s in committed_steps
                if sum(1 for r in train if r["step"] == s and r["committed"] and r["participating"])
                == n
            )
            for n in range(1, 5)
        },
        "eval": evals[0] if evals else None,
        "eval_all_replicas": [e["loss"] for e in evals],
    }


# ---------------------------------------------------------------- driver


def young_daly(save_s: float, mtbf_s: float, step_s: float) -> int:
    """Young/Daly's checkpoint interval sqrt(2 * save * MTBF), in iterations."""
    return max(1, round(math.sqrt(2 * save_s * mtbf_s) / step_s))


def measure_save_time(out: Path, data: str, iters: int = 30, every: int = 3) -> Dict[str, Any]:
    """Seconds per checkpoint save: two failure-free runs, with a save every ``every``
    iterations and without; the wall-time difference over the number of saves."""
    d = out / "calibration"
    d.mkdir(parents=True, exist_ok=True)
    plain = run_failure_free(d, iters, data)
    saving = run_failure_free(d, iters, data, save_every=every)
    n = iters // every
    return {
        "iterations": iters,
        "save_interval": every,
        "saves": n,
        "wall_plain_s": plain["wall_s"],
        "wall_saving_s": saving["wall_s"],
        "save_s": max(0.05, (saving["wall_s"] - plain["wall_s"]) / n),
    }


def run_one(
    system: str,
    run_dir: Path,
    a: argparse.Namespace,
    period: float,
    repair: float,
    seed: int,
    k: int,
    budget: float,
) -> Dict[str, Any]:
    """One run of ``system``; a run still going after ``budget`` seconds is stopped (what it
    committed by then counts)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if system == "failure-free":
        return run_failure_free(run_dir, a.iters, a.data_path)
    if system == "checkpoint-restart":
        return run_checkpoint_restart(
            run_dir, a.iters, a.data_path, period, repair, seed, k, budget
        )
    if system == "torchft":
        return run_torchft(run_dir, a.iters, a.data_path, period, repair, seed, budget)
    return run_mecefo(
        run_dir, a.iters, a.data_path, period, repair, seed, system.removeprefix("mecefo-"), budget
    )


def _kills(run: Dict[str, Any]) -> int:
    """The kills that hit a process (a due kill with no live target hits nothing)."""
    return sum(1 for e in run["kills"] if e.get("slot") is not None)


def summarize(runs: List[Dict[str, Any]], systems: List[str]) -> Dict[str, Any]:
    """Per setting and system: ETTR (mean, min, max over rounds) and the sample counts."""
    table: Dict[str, Any] = {}
    for setting in sorted({r["setting"] for r in runs}):
        rows: Dict[str, Any] = {}
        for system in systems:
            rs = [r for r in runs if r["setting"] == setting and r["system"] == system]
            ettr = [r["ettr"] for r in rs if r.get("ettr") is not None]
            ettr_med = [r["ettr_vs_median_ff"] for r in rs if "ettr_vs_median_ff" in r]
            ff_loss = [r.get("ff_val_loss") for r in rs]
            loss = [r["eval"]["loss"] if r.get("eval") else None for r in rs]
            rows[system] = {
                "runs": len(rs),
                "ettr_mean": round(statistics.mean(ettr), 4) if ettr else None,
                "ettr_min": round(min(ettr), 4) if ettr else None,
                "ettr_max": round(max(ettr), 4) if ettr else None,
                "ettr_vs_median_ff_mean": round(statistics.mean(ettr_med), 4) if ettr_med else None,
                "ettr_per_round": ettr,
                "wall_s_mean": round(statistics.mean(r["wall_s"] for r in rs), 1) if rs else None,
                "kills_mean": (statistics.mean(_kills(r) for r in rs) if rs else None),
                "committed": [r["committed"] for r in rs],
                "skipped_samples": [r["skipped_samples"] for r in rs],
                "repeated_samples": [r["repeated_samples"] for r in rs],
                "exactly_once_samples": [r["exactly_once_samples"] for r in rs],
                "redone_iterations": [r["redone_iterations"] for r in rs],
                "val_loss": [None if x is None else round(x, 4) for x in loss],
                "val_loss_minus_failure_free": [
                    None if x is None or f is None else round(x - f, 4)
                    for x, f in zip(loss, ff_loss, strict=True)
                ],
            }
        table[setting] = rows
    return table


def markdown(table: Dict[str, Any], iters: int) -> str:
    """The README table: per setting and system, ETTR over the rounds and the sample counts."""

    def cell(xs: List[Any], fmt: str = "{}") -> str:
        return ", ".join("-" if x is None else fmt.format(x) for x in xs)

    lines = [
        "| setting | system | ETTR mean (min-max) | ETTR per round | ETTR vs median "
        "failure-free | kills | batches committed | samples skipped | samples repeated | "
        "val loss - failure-free |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, rows in table.items():
        for system, r in rows.items():
            if r["ettr_mean"] is None:
                continue
            lines.append(
                f"| {setting} | {system} | {r['ettr_mean']:.3f} ({r['ettr_min']:.3f}-"
                f"{r['ettr_max']:.3f}) | {cell(r['ettr_per_round'], '{:.3f}')} | "
                f"{r['ettr_vs_median_ff_mean']:.3f} | {r['kills_mean']:.1f} | "
                f"{cell(r['committed'])} of {iters} | {cell(r['skipped_samples'])} | "
                f"{cell(r['repeated_samples'])} | "
                f"{cell(r['val_loss_minus_failure_free'], '{:+.3f}')} |"
            )
    return "\n".join(lines)


def plot(table: Dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(table)
    systems = list(next(iter(table.values())))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(settings))
    top = 1.0
    for i, setting in enumerate(settings):
        xs, ys, lo, hi = [], [], [], []
        for j, system in enumerate(systems):
            row = table[setting][system]
            if row["ettr_mean"] is None:
                continue
            xs.append(j + (i - (len(settings) - 1) / 2) * width)
            ys.append(row["ettr_mean"])
            lo.append(row["ettr_mean"] - row["ettr_min"])
            hi.append(row["ettr_max"] - row["ettr_mean"])
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=setting.replace("_", ", "))
        for x, system in zip(xs, [s for s in systems if table[setting][s]["ettr_mean"] is not None],
                             strict=True):  # fmt: skip
            pts = table[setting][system]["ettr_per_round"]
            ax.plot([x] * len(pts), pts, "o", ms=3, color="black", alpha=0.6)
        top = max(top, *(y + h for y, h in zip(ys, hi, strict=True)))
        del bars
    ax.set_xticks(range(len(systems)))
    ax.set_xticklabels(systems, rotation=15)
    ax.set_ylabel("ETTR (bar: mean; whiskers: min-max; dots: rounds)", fontsize=8)
    ax.set_ylim(0, top + 0.1)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--delayed-exec":  # the checkpoint-restart shim
        delayed_exec(sys.argv[2], sys.argv[4:])
        return
    # A SIGTERM (a timeout, CI) unwinds through the finally blocks that end every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="one setting (T20_R10), one round, 100 batches, --max-slowdown 2: the " "smoke test",
    )
    p.add_argument(
        "--settings", default=",".join(SETTINGS), help="comma list of T<seconds>_R<seconds>"
    )
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=400, help="global batches per run")
    p.add_argument("--seed", type=int, default=30)
    p.add_argument(
        "--max-slowdown",
        type=float,
        default=2.5,
        help="stop a run after this many failure-free walls (+30 s): its ETTR is "
        "below 1/this then anyway; what it committed counts",
    )
    p.add_argument(
        "--save-time",
        type=float,
        default=None,
        help="seconds per checkpoint save (default: measured; --quick 0.5)",
    )
    p.add_argument("--data-path", default=str(REPO / "data" / "stdlib_text_document"))
    p.add_argument("--output", default=None, help="default results/goodput.json")
    p.add_argument("--plot", default=None, help="default results/plots/goodput.png")
    p.add_argument("--workdir", default=str(REPO / "results" / "goodput"))
    p.add_argument("--plot-only", default=None, metavar="JSON", help="only plot this result")
    p.add_argument("--recount", action="store_true",
                   help="rebuild --output's table, derived fields and plot from its runs (a "
                   "partial file too), with the same flags as the run")  # fmt: skip
    a = p.parse_args()
    if a.plot_only:
        res = json.loads(Path(a.plot_only).read_text())
        plot(
            res["table"],
            Path(a.plot or REPO / "results" / "plots" / "goodput.png"),
            res.get("plot_title", "goodput"),
        )
        return
    if a.quick:
        a.settings, a.repeats, a.iters, a.max_slowdown = "T20_R10", 1, 100, 2.0
        a.save_time = 0.5 if a.save_time is None else a.save_time
    suffix = "_quick" if a.quick else ""
    a.output = a.output or str(REPO / "results" / f"goodput{suffix}.json")
    a.plot = a.plot or str(REPO / "results" / "plots" / f"goodput{suffix}.png")
    systems = [s for s in a.systems.split(",") if s]
    assert "failure-free" in systems, "ETTR needs the failure-free reference"
    if "torchft" in systems and not TFT_PYTHON.exists() and not a.recount:
        print(f"goodput: {TFT_PYTHON} missing (make bench-goodput sets it up): torchft left out")
        systems.remove("torchft")
    settings = {}
    for s in a.settings.split(","):
        m = re.fullmatch(r"T([\d.]+)_R([\d.]+)", s)
        assert m, f"bad setting {s}"
        settings[s] = (float(m.group(1)), float(m.group(2)))
    if a.recount:
        old = json.loads(Path(a.output).read_text())
        runs = old["runs"]
        if a.save_time is None:
            a.save_time = (old.get("config") or {}).get("save_time_s", math.nan)
        systems = [s for s in systems if any(r["system"] == s for r in runs)]
        loads = [r["loadavg_start_end"] for r in runs]
        finish(a, runs, systems, {s: v for s, v in settings.items()
                                  if any(r["setting"] == s for r in runs)},
               (old.get("config") or {}).get("save_time_calibration"),
               old.get("date", "unknown"),
               old.get("duration_s", sum(r["wall_s"] for r in runs)),
               tuple(loads[0][0]), tuple(loads[-1][1]))  # fmt: skip
        return
    out = Path(a.workdir)
    out.mkdir(parents=True, exist_ok=True)
    load_start, t_start = os.getloadavg(), time.time()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    calibration = None
    if a.save_time is None:
        calibration = measure_save_time(out, a.data_path)
        a.save_time = calibration["save_s"]
        print(f"goodput: save time {a.save_time:.2f} s ({calibration})", flush=True)
    runs: List[Dict[str, Any]] = []
    for setting, (period, repair) in settings.items():
        for rnd in range(a.repeats):
            seed = a.seed * 1000 + rnd * 17 + int(period)
            ff_step, ff_loss, k = None, None, None
            for system in systems:
                if system == "checkpoint-restart":
                    assert ff_step is not None, "the failure-free run goes first"
                    k = young_daly(a.save_time, period, ff_step)
                budget = a.max_slowdown * (ff_step or 0) * a.iters + 30
                run = run_one(
                    system,
                    out / setting / f"r{rnd}" / system,
                    a,
                    period,
                    repair,
                    seed,
                    k or 0,
                    budget,
                )
                if system == "failure-free":
                    ff_step = run["wall_s"] / a.iters
                    ff_loss = run["eval"]["loss"] if run.get("eval") else None
                run["setting"], run["round"], run["seed"] = setting, rnd, seed
                run["ettr"] = round(ff_step * run["committed"] / run["wall_s"], 4)
                run["exactly_once_samples"] = (
                    a.iters * GBS
                    - run["skipped_samples"]
                    - min(run["repeated_samples"], a.iters * GBS - run["skipped_samples"])
                )
                run["ff_val_loss"] = ff_loss
                runs.append(run)
                ev = run.get("eval") or {}
                print(
                    f"goodput {setting} round {rnd} {system:>18}: wall {run['wall_s']:7.1f} s, "
                    f"committed {run['committed']}/{a.iters}, ETTR {run['ettr']:.3f}, kills "
                    f"{_kills(run)}, skipped "
                    f"{run['skipped_samples']}, repeated {run['repeated_samples']}, val loss "
                    f"{ev.get('loss', float('nan')):.4f} (rc {run['rc']}, load "
                    f"{run['loadavg_start_end'][1][0]:.1f})",
                    flush=True,
                )
                Path(a.output).write_text(
                    json.dumps({"partial": True, "date": started, "runs": runs}, indent=1)
                )
    finish(a, runs, systems, settings, calibration, started, time.time() - t_start, load_start,
           os.getloadavg())  # fmt: skip


def _post(runs: List[Dict[str, Any]], iters: int, workdir: Path) -> None:
    """Derived fields: ETTR against the setting's median failure-free run (less exposed to a
    load swing during one reference run than the round's own), and torchft's stall per kill
    (from the replicas' records in ``workdir``, where they are still there)."""
    ff = {(r["setting"], r["round"]): r for r in runs if r["system"] == "failure-free"}
    for r in runs:
        if r["system"].startswith("mecefo") and r["rc"] == 0 and r["committed"] < iters:
            # Recorded before run_mecefo counted a finished run's unlogged iterations as
            # committed (see there): the same correction.
            r["unlogged_iterations"] = iters - r["committed"]
            r["skipped_samples"] -= r["unlogged_iterations"] * GBS
            r["committed"] = iters
        ref = ff[(r["setting"], r["round"])]
        r["ettr"] = round(ref["wall_s"] / iters * r["committed"] / r["wall_s"], 4)
        total = iters * GBS - r["skipped_samples"]
        r["exactly_once_samples"] = total - min(r["repeated_samples"], total)
    for setting in {r["setting"] for r in runs}:
        ffs = [r["wall_s"] / iters for r in runs if r["setting"] == setting
               and r["system"] == "failure-free"]  # fmt: skip
        med = statistics.median(ffs)
        for r in runs:
            if r["setting"] == setting:
                r["ettr_vs_median_ff"] = round(med * r["committed"] / r["wall_s"], 4)
    for r in runs:
        if r["system"] != "torchft":
            continue
        d = workdir / r["setting"] / f"r{r['round']}" / "torchft"
        if "stall_s" not in r and d.is_dir():
            recs = [x for f in sorted(d.glob("replica*.jsonl")) for x in _read_jsonl(f)]
            r["stall_s"] = torchft_accounting(recs, iters)["stall_s"]
        if r.get("stall_s") is not None and _kills(r):
            r["torchft_stall_s_per_kill"] = round(r["stall_s"] / _kills(r), 3)


def finish(
    a: argparse.Namespace,
    runs: List[Dict[str, Any]],
    systems: List[str],
    settings: Dict[str, Tuple[float, float]],
    calibration: Optional[Dict[str, Any]],
    started: str,
    duration: float,
    load_start: Tuple[float, ...],
    load_end: Tuple[float, ...],
) -> None:
    """The table, JSON, plot and summary line of ``runs``."""
    _post(runs, a.iters, Path(a.workdir))
    table = summarize(runs, systems)
    result = {
        "benchmark": "goodput",
        "date": started,
        "duration_s": round(duration, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_at_start": load_start,
            "loadavg_at_end": load_end,
        },
        "config": {
            "quick": a.quick,
            "layout": "DP4 (TP1 PP1) on 4 CPU ranks, gloo, OMP_NUM_THREADS=1",
            "model": MODEL,
            "global_batches": a.iters,
            "global_batch_size": GBS,
            "settings": {s: {"T_s": t, "R_s": r} for s, (t, r) in settings.items()},
            "repeats": a.repeats,
            "seed": a.seed,
            "systems": systems,
            "save_time_s": a.save_time,
            "save_time_calibration": calibration,
            "checkpoint_interval": "Young/Daly: round(sqrt(2 * save_time_s * T) / failure-free "
            "s per batch) iterations, per round (the run's save_interval)",
            "torchrun": "--nproc_per_node=4 --max-restarts 1000 --rdzv-backend c10d "
            "--rdzv-endpoint 127.0.0.1:<port>; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            "supervisor": [
                "--replace",
                "after:R",
                "--standby",
                "1",
                "--max-replacements",
                "1000",
                *SUPERVISOR_TIMEOUTS,
            ],
            "mecefo": ["--mecefo", "--mecefo-rank", "16", "--mecefo-policy", "P"],
            "torchft": "0.2.0 in .venv-tft; Lighthouse min_replicas 1, join_timeout 1 s, "
            "heartbeat timeout 5 s; Manager min_replica_size 1, synchronous quorum, "
            "ProcessGroupGloo timeout 30 s; one replica group per process",
            "ettr": "failure-free wall s per global batch (same round) x committed / wall s",
            "max_slowdown": a.max_slowdown,
            "ettr_vs_median_ff": "the same with the median failure-free wall of the setting",
        },
        "table": table,
        "runs": runs,
    }
    title = (
        f"goodput, DP4 on 4 CPU ranks, {a.iters} global batches, {a.repeats} round(s); "
        f"load {load_start[0]:.1f} -> {load_end[0]:.1f}"
    )
    result["plot_title"] = title
    Path(a.output).write_text(json.dumps(result, indent=1))
    try:
        plot(table, Path(a.plot), title)
    except ImportError:  # the plot extra is not installed here: .venv-tft has matplotlib
        if TFT_PYTHON.exists():
            subprocess.run(
                [str(TFT_PYTHON), __file__, "--plot-only", a.output, "--plot", a.plot],
                env=_env(),
                check=False,
            )
        else:
            print("goodput: matplotlib missing (the plot extra): no plot")
    print(markdown(table, a.iters))
    parts = []
    for setting, rows in table.items():
        cells = ", ".join(f"{s} {r['ettr_mean']}" for s, r in rows.items() if r["ettr_mean"])
        parts.append(f"{setting}: {cells}")
    print(
        f"goodput (DP4, {a.iters} batches, {a.repeats} round(s), save every K by Young/Daly "
        f"from {a.save_time:.2f} s saves, load {load_start[0]:.1f} -> {load_end[0]:.1f}): ETTR "
        + "; ".join(parts)
        + f"; wrote {a.output}"
    )


if __name__ == "__main__":
    main()
