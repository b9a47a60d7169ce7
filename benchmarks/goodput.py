"""Goodput in samples under real rank deaths: checkpoint-restart, torchft and MeCeFO.

One workload for every system: the example trainer's small GPT (the demo's model and data,
``data/stdlib_text_document``) at DP4 (TP1 PP1) on 4 CPU ranks (gloo), ``--iters`` global
batches of 16 sequences, under the **device clock** (``--device-clock llama-1b-h100``,
``megatron_mecefo/planner/device_clock.py``): each rank's forward, backward and optimizer
phases last what the step-cost model gives for Llama-1B on one H100 at 40% MFU (1.43 s a step),
so a run's step time does not depend on how many ranks share the 2 cores; every figure is
*emulated*. Recovery costs (detection, regroup, restart, heal) are real. One seeded schedule of
real ``SIGKILL`` s from outside, **by step** (``S<n>_R<s>``, default ``S8_R5``): kill ``k`` is
sent when the run first reaches step ``k * n``, for ``k * n`` below the last step, on one rank
drawn from the seed, and the dead rank comes back after ``R`` seconds as a new process. Every
system takes the same kills at the same steps, inside its training window
(``T<s>_R<s>``: kill ``k`` at ``k * T`` s after step 1, the older schedule).

Systems, each with **its own failure-free run** in every round (the same command without
kills), run back to back with its run under failures; the systems' order rotates by round and
the failure-free run goes first in even rounds:

* ``megatron-core-dp4``: the **common reference**, failure-free only: stock Megatron-Core DP4
  (the example trainer without ``--mecefo``, no saves) under torchrun and the same clock;
* ``checkpoint-restart``: the example trainer without ``--mecefo`` under ``torchrun
  --max-restarts`` (c10d rendezvous, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: pytorch issue
  135712), ``--save D --load D --save-interval K``, K the Young/Daly interval ``sqrt(2 * save *
  T)`` over the emulated step (save time measured first; T the time between kills); its
  failure-free run saves at the same K. The dead rank's new process waits until its ``R`` s
  are over (:func:`delayed_exec`);
* ``torchft``: torchft 0.2.0's Lighthouse, Manager and ``ProcessGroupGloo`` around the same
  GPTModel, data shares and AdamW settings (``benchmarks/goodput_torchft.py``, one replica
  group per process, run by the ``.venv-tft`` interpreter, on the same device clock). Its
  failure-free run has all four replicas in every step (the Lighthouse waits for 4; checked:
  ``rank_steps`` and ``eval_replicas``); under kills it goes on with fewer, a killed replica is
  started again after ``R`` s and heals from a peer, and the shares of replicas outside a
  step's quorum are dropped;
* ``mecefo-neighbor``, ``mecefo-spread``, ``mecefo-auto``: the example trainer with
  ``--mecefo --mecefo-policy P`` under ``python -m megatron_mecefo.recovery.supervisor
  --replace after:R --standby 1``.

Per run: the training window (from step 1's record to the last step's), the samples trained
on in it (samples of steps 2..N that entered a committed update: a dropped or skipped share
does not count; a redone step counts once) and the kills inside it. The headline,
``common_ratio``: samples per second of the window over the common reference's of the same
round; beside it ETTR: over the same system's failure-free run of the same round. Per system:
the mean over the rounds with a 95% t interval, the validation-loss delta against its own
failure-free run, the device clock's overruns (phases whose CPU work took longer than the
emulated time) and the load. ``checks``: torchft's failure-free runs at 4 of 4 replicas and
equal kills in the window; the benchmark exits non-zero when either fails.

Usage: ``.venv/bin/python benchmarks/goodput.py [--quick]``; writes ``results/goodput.json``,
``results/plots/goodput.png`` and prints the table and one summary line.
"""

from __future__ import annotations

import argparse
import collections
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
from run_header import plot_path  # noqa: E402

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
# The common reference (failure-free only): stock Megatron-Core DP4 under the same clock.
REFERENCE = "megatron-core-dp4"
SYSTEMS = (
    REFERENCE,
    "checkpoint-restart",
    "torchft",
    "mecefo-neighbor",
    "mecefo-spread",
    "mecefo-auto",
)
# Kill every T s, back after R s. The runs last about 80 s failure-free here (400 batches plus
# start-up), so T = 40 s gives 2 kills a run and T = 20 s 4; T = 60 s would give at most one.
SETTINGS = {"T40_R15": (40.0, 15.0), "T20_R10": (20.0, 10.0)}
DEVICE_CLOCK: Optional[str] = None  # --device-clock: the emulated GPU shape of every rank


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
    """The seeded kill schedule of one run. By step (``every`` set): kill ``k`` fires when the
    run's training first reaches step ``k * every`` (its record appears), for ``k * every`` below
    the last step, so every system takes the same kills at the same steps, all inside its
    training window. By time (``every`` None): kill ``k`` is due ``k * T`` s after ``t0``, the
    end of the run's first training step. ``t0`` None: not started yet; ``T`` infinite: a
    failure-free run. Counting from the first step, not the launch, keeps a kill out of the
    start-up, whose length depends on the machine's load."""

    def __init__(
        self,
        t0: Optional[float],
        period: float,
        repair: float,
        seed: int,
        every: Optional[int] = None,
        iters: int = 0,
    ) -> None:
        self.t0, self.period, self.repair = t0, period, repair
        self.every, self.iters = every, iters
        self.rng = random.Random(seed)
        self.next_k = 1
        self.events: List[Dict[str, Any]] = []

    def due(self, step: Optional[int] = None) -> bool:
        """Whether the next kill is due (``step``: the highest training step seen so far)."""
        if self.t0 is None or math.isinf(self.period):
            return False
        if self.every:
            at = self.next_k * self.every
            return at < self.iters and step is not None and step >= at
        return time.time() >= self.t0 + self.next_k * self.period

    def fire(
        self,
        live: Dict[int, int],
        on_kill: Callable[[int, float], None],
        step: Optional[int] = None,
    ) -> None:
        """Kill the drawn rank (or the next live one) among ``live`` (slot -> pid)."""
        drawn = self.rng.randrange(4)
        self.next_k += 1
        slot = next((s % 4 for s in range(drawn, drawn + 4) if s % 4 in live), None)
        event: Dict[str, Any] = {"k": self.next_k - 1, "drawn": drawn, "slot": slot}
        if self.every:
            event["at_step"], event["seen_step"] = (self.next_k - 1) * self.every, step
        if slot is not None:
            t = time.time()
            _kill([live[slot]])
            event.update(pid=live[slot], t=round(t - self.t0, 3) if self.t0 else None)
            on_kill(slot, t)
        self.events.append(event)


class Watch:
    """When each training step's record first and last appeared in a run's metrics files
    (polled): the run's training window runs from step 1's record to the last step's."""

    def __init__(
        self,
        paths: Callable[[], List[Path]],
        key: Callable[[Dict], Optional[int]],
        is_start: Callable[[Dict], bool] = lambda rec: _example_key(rec) == 1,
    ):
        self.paths, self.key, self.is_start = paths, key, is_start
        self.offsets: Dict[Path, int] = {}
        self.first: Dict[int, float] = {}
        self.last: Dict[int, float] = {}
        self.start: Optional[Tuple[int, float]] = None  # (step, when): the window's start

    def poll(self) -> None:
        now = time.time()
        for path in self.paths():
            off = self.offsets.get(path, 0)
            try:
                if path.stat().st_size < off:  # rewritten
                    off = 0
                with open(path, "rb") as f:
                    f.seek(off)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self.offsets[path] = off + end + 1
            for line in data[:end].splitlines():
                try:
                    rec = json.loads(line)
                    k = self.key(rec)
                    if k is not None and self.start is None and self.is_start(rec):
                        self.start = (k, now)
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue
                if k is not None:
                    self.first.setdefault(k, now)
                    self.last[k] = now

    def top(self) -> Optional[int]:
        """The highest training step seen (None before the first)."""
        return max(self.first) if self.first else None

    def start_killer(self, killer: Optional[Killer]) -> None:
        if killer is not None and killer.t0 is None and self.start is not None:
            killer.t0 = self.start[1]


def _example_key(rec: Dict[str, Any]) -> Optional[int]:
    return rec["iteration"] if rec.get("type") == "train" else None


def _torchft_key(rec: Dict[str, Any]) -> Optional[int]:
    return rec["step"] + 1 if rec.get("type") == "train" and rec["committed"] else None


def _torchft_first(rec: Dict[str, Any]) -> bool:
    return _torchft_key(rec) == 1


def _wait(
    proc: subprocess.Popen,
    killer: Optional[Killer],
    live: Callable[[], Dict[int, int]],
    on_kill: Callable[[int, float], None],
    deadline: float,
    tick: Callable[[], None] = lambda: None,
    watch: Optional[Watch] = None,
) -> Optional[int]:
    """Run the kill schedule until ``proc`` ends or the deadline passes (then None)."""
    while proc.poll() is None:
        if time.time() > deadline:
            return None
        if watch is not None:
            watch.poll()
            watch.start_killer(killer)
        step = watch.top() if watch is not None else None
        if killer is not None and killer.due(step):
            killer.fire(live(), on_kill, step)
        tick()
        time.sleep(0.05)
    if watch is not None:
        watch.poll()
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
    clock = ["--device-clock", DEVICE_CLOCK] if DEVICE_CLOCK else []
    return [
        str(TRAINER),
        *MODEL,
        "--data-path",
        data,
        "--train-iters",
        str(iters),
        "--metrics-file",
        str(metrics),
        *clock,
    ]


def _clean(run_dir: Path) -> None:
    """Remove a previous run's metrics, records and device-clock logs."""
    for pattern in ("metrics.jsonl*", "records.jsonl", "pids.txt", "replica*", "back_*"):
        for f in run_dir.glob(pattern):
            f.unlink()


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


def _finish(
    run: Dict[str, Any],
    t0: float,
    load0: Tuple[float, ...],
    watch: Optional[Watch] = None,
    iters: int = 0,
    clock_logs: Optional[List[Path]] = None,
    samples_after: Optional[Callable[[int], int]] = None,
) -> Dict[str, Any]:
    """Wall, load, and with ``watch`` the training window: from step 1's record to the last
    step's (the last appearance: a step redone after a restart counts when it was redone), or
    to the stop where the run did not finish. The samples trained on in the window: those of
    steps 2..N that entered an update (``samples_after(1)``; by default all of step 1's samples
    count as trained: no kill comes before it)."""
    now = time.time()
    run["wall_s"] = round(now - t0, 2)
    run["loadavg_start_end"] = [list(load0), list(os.getloadavg())]
    run["samples_trained"] = iters * GBS - run.get("skipped_samples", 0) if iters else None
    if watch is not None and watch.start is not None:
        step0, start = watch.start
        end = watch.last[iters] if run["committed"] >= iters and iters in watch.last else now
        after = samples_after or (lambda k: run["samples_trained"] - k * GBS)
        run["start_step"] = step0
        run["first_step_s"] = round(start - t0, 3)
        run["window_s"] = round(end - start, 3)
        run["samples_window"] = max(0, after(step0))
        run["samples_per_s"] = round(run["samples_window"] / run["window_s"], 4)
    else:
        run["window_s"] = run["samples_window"] = run["samples_per_s"] = None
    if DEVICE_CLOCK and clock_logs is not None:
        from megatron_mecefo.planner.device_clock import read_logs

        run["device_clock"] = read_logs([str(p) for p in clock_logs])
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


def run_reference(run_dir: Path, iters: int, data: str, budget: float) -> Dict:
    """The common reference: stock Megatron-Core DP4 (the example trainer without ``--mecefo``,
    no checkpoint saves) under torchrun and the same device clock, no kill. Every system's
    samples per second under kills is divided by this run's (of the same round)."""
    metrics = run_dir / "metrics.jsonl"
    _clean(run_dir)
    load0, t0 = os.getloadavg(), time.time()
    proc = _start(
        [*_torchrun(_free_port(), 0, "ref"), *_trainer_args(iters, metrics, data)],
        run_dir / "log.txt",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    watch = Watch(lambda: [metrics], _example_key)
    try:
        rc = _wait(proc, None, dict, lambda s, t: None, t0 + budget, watch=watch)
    finally:
        _stop(proc, [])
    res = _example_result(metrics)
    done = len(res["last"]) if rc == 0 else 0
    return _finish(
        {
            "system": REFERENCE,
            "rc": rc,
            "committed": done,
            "logged_iterations": res["logged"],
            "redone_iterations": 0,
            "repeated_samples": 0,
            "skipped_samples": (iters - done) * GBS,
            "eval": res["eval"],
            "kills": [],
        },
        t0,
        load0,
        watch,
        iters,
        sorted(run_dir.glob("metrics.jsonl.clock*")),
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
    every: Optional[int] = None,
) -> Dict:
    """Stock checkpoint-restart under torchrun, killed on the schedule."""
    metrics, ckpt = run_dir / "metrics.jsonl", run_dir / "ckpt"
    _clean(run_dir)
    subprocess.run(["rm", "-rf", str(ckpt)], check=True)
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
    killer = Killer(None, period, repair, seed, every, iters)
    watch = Watch(lambda: [metrics], _example_key)
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
        rc = _wait(proc, killer, live, on_kill, t0 + budget, tick=live, watch=watch)
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
        watch,
        iters,
        sorted(run_dir.glob("metrics.jsonl.clock*")),
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
    every: Optional[int] = None,
) -> Dict:
    """MeCeFO under the supervisor: survivors take over, replacements rejoin after R s."""
    metrics, records, pid_file = (
        run_dir / n for n in ("metrics.jsonl", "records.jsonl", "pids.txt")
    )
    _clean(run_dir)
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
    killer = Killer(None, period, repair, seed, every, iters)
    watch = Watch(lambda: [metrics], _example_key)

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
        rc = _wait(proc, killer, live, lambda s, t: None, t0 + budget, watch=watch)
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
            # auto: the planner's choice in the degraded iterations (what it ranked first).
            "planner_policies": dict(
                collections.Counter(
                    r["mecefo"]["planner"].get("policy")
                    for r in res["last"].values()
                    if r.get("mecefo", {}).get("degraded") and r["mecefo"].get("planner")
                )
            ),
            "eval": res["eval"],
            "kills": killer.events,
        },
        t0,
        load0,
        watch,
        iters,
        sorted(run_dir.glob("metrics.jsonl.clock*")),
    )


# The Lighthouse's (min_replicas, join_timeout_ms, heartbeat_timeout_ms): failure-free, all four
# replicas in every step; under kills, go on with whoever is there.
TFT_FULL = (4, 60000, 60000)
TFT_UNDER_KILLS = (1, 1000, 5000)
LIGHTHOUSE = """
import os, sys, time
from torchft._torchft import LighthouseServer
s = LighthouseServer(bind="[::]:0", min_replicas=int(sys.argv[2]),
                     join_timeout_ms=int(sys.argv[3]), heartbeat_timeout_ms=int(sys.argv[4]))
# A file of its own: the server's log lines interleave with stdout.
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(s.address())
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(1e9)
"""


def run_torchft(
    run_dir: Path,
    iters: int,
    data: str,
    period: float,
    repair: float,
    seed: int,
    budget: float,
    every: Optional[int] = None,
) -> Dict:
    """torchft at DP4: 4 replica groups of one process, Lighthouse, heal from a peer.

    Its failure-free run (``period`` infinite) has all four replicas in every step: the
    Lighthouse waits for 4 (``min_replicas`` 4, a join timeout and heartbeat timeout of 60 s
    that cover a slow start under load), the Manager's ``min_replica_size`` is 4, and the job
    ends when every replica has run its evaluation. Under kills it goes on with fewer:
    ``min_replicas`` 1, join timeout 1 s, heartbeat timeout 5 s, ``min_replica_size`` 1."""
    full = math.isinf(period)
    _clean(run_dir)
    load0, t0 = os.getloadavg(), time.time()
    lh_log = run_dir / "lighthouse.txt"
    lh_addr = run_dir / "lighthouse.addr"
    lh_addr.unlink(missing_ok=True)
    lh_args = TFT_FULL if full else TFT_UNDER_KILLS
    lh = _start([str(TFT_PYTHON), "-c", LIGHTHOUSE, str(lh_addr), *map(str, lh_args)], lh_log)
    procs: Dict[int, subprocess.Popen] = {}
    started: List[subprocess.Popen] = []
    pending: Dict[int, float] = {}  # slot -> when its replacement starts
    incarnation = {s: 0 for s in range(4)}
    error = None
    killer = Killer(None, period, repair, seed, every, iters)
    watch = Watch(lambda: sorted(run_dir.glob("replica*_*.jsonl")), _torchft_key, _torchft_first)
    try:
        while not (
            lh_addr.exists() and (m := re.search(r"http://([^:\s]+):(\d+)", lh_addr.read_text()))
        ):
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
                    "--min-replica-size",
                    str(4 if full else 1),
                    *(["--device-clock", DEVICE_CLOCK] if DEVICE_CLOCK else []),
                ],
                run_dir / f"replica{slot}_{inc}.log",
            )
            procs[slot] = p
            started.append(p)

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
            if done_t is None and any(p.poll() == 0 for p in started):
                done_t = time.time()
            # Failure-free: every replica runs its evaluation (the deadline still holds).
            if done_t is not None and time.time() > done_t + 5 and not full:
                break
            if time.time() > deadline:
                error = "deadline"
                break
            watch.poll()
            watch.start_killer(killer)
            if killer.due(watch.top()):
                killer.fire(live(), on_kill, watch.top())
            time.sleep(0.05)
        watch.poll()
    finally:
        _stop(lh, [p.pid for p in started])
        for p in started:
            _stop(p, [])
    recs = [r for f in sorted(run_dir.glob("replica*_*.jsonl")) for r in _read_jsonl(f)]
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
        watch,
        iters,
        sorted(run_dir.glob("replica*.clock")),
        lambda k: torchft_accounting(recs, iters, after_step=k)["samples_used"],
    )


def torchft_accounting(
    recs: List[Dict[str, Any]], iters: int, after_step: int = 0
) -> Dict[str, Any]:
    """Samples of the torchft replicas' step records: a replica's share (GBS/4) of global
    batch s entered an update exactly when it took part in the committed step s; the shares of
    replicas outside the quorum are skipped; an attempt that did not commit is redone.
    ``samples_used``: the samples of steps after the ``after_step``-th (1-based) that entered
    an update."""
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
    # The replicas that ran the evaluation after the last step (failure-free: all four).
    eval_replicas = {r["replica"] for r in recs if r.get("type") == "eval" and r["step"] >= iters}
    return {
        "committed": committed,
        "rank_steps": sum(1 for s, _ in used if s < iters),
        "rank_steps_expected": iters * 4,
        "eval_replicas": len(eval_replicas),
        "eval_replicas_expected": 4,
        "samples_used": sum(1 for s, _ in used if s + 1 > after_step) * share,
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


def parse_setting(name: str) -> Tuple[float, float, Optional[int]]:
    """``S<steps>_R<s>`` (kill k at step k x steps) or ``T<s>_R<s>`` (kill k at k x T s) as
    (period s, repair s, steps); by step the period is 1.0 (any finite value: not failure-free)."""
    m = re.fullmatch(r"([ST])([\d.]+)_R([\d.]+)", name)
    if not m or (m.group(1) == "S" and not m.group(2).isdigit()):
        raise SystemExit(
            f"goodput: --settings {name!r} is not S<steps>_R<seconds> or T<seconds>_R<seconds>; "
            "use e.g. --settings S8_R5"
        )
    if m.group(1) == "S":
        return 1.0, float(m.group(3)), int(m.group(2))
    return float(m.group(2)), float(m.group(3)), None


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
    every: Optional[int] = None,
) -> Dict[str, Any]:
    """One run of ``system`` (``period`` infinite: its failure-free run; ``every``: kill by
    step); a run still going after ``budget`` seconds is stopped (what it committed by then
    counts)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if system == REFERENCE:
        return run_reference(run_dir, a.iters, a.data_path, budget)
    if system == "checkpoint-restart":
        return run_checkpoint_restart(
            run_dir, a.iters, a.data_path, period, repair, seed, k, budget, every
        )
    if system == "torchft":
        return run_torchft(run_dir, a.iters, a.data_path, period, repair, seed, budget, every)
    policy = system.removeprefix("mecefo-")
    return run_mecefo(run_dir, a.iters, a.data_path, period, repair, seed, policy, budget, every)


def full_replicas(run: Dict[str, Any]) -> bool:
    """Whether a torchft run had all its replicas: every rank-step and every evaluation."""
    steps = run.get("rank_steps") == run.get("rank_steps_expected")
    return steps and run.get("eval_replicas") == run.get("eval_replicas_expected")


def kills_in_window(run: Dict[str, Any]) -> int:
    """The kills that hit a process inside the run's training window (from step 1's record to
    the last step's): a kill after the window, or one with no live target, is not counted."""
    w = run.get("window_s")
    if w is None:
        return 0
    return sum(
        1 for e in run["kills"] if e.get("slot") is not None and e.get("t") is not None
        and 0 <= e["t"] <= w
    )  # fmt: skip


def _kills(run: Dict[str, Any]) -> int:
    """The kills that hit a process (a due kill with no live target hits nothing)."""
    return sum(1 for e in run["kills"] if e.get("slot") is not None)


# Two-sided 95% Student t quantiles by degrees of freedom (rounds - 1).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179}  # fmt: skip


def interval(xs: List[float]) -> Dict[str, Optional[float]]:
    """Mean and 95% t half-width of ``xs`` (rounds are the samples)."""
    if not xs:
        return {"mean": None, "ci95": None, "n": 0}
    mean = statistics.mean(xs)
    half = (
        T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))
        if len(xs) > 1
        else None
    )
    return {"mean": round(mean, 4), "ci95": None if half is None else round(half, 4), "n": len(xs)}


def _loss(run: Dict[str, Any]) -> Optional[float]:
    return run["eval"]["loss"] if run.get("eval") else None


def _post(runs: List[Dict[str, Any]]) -> None:
    """Per run: the kills inside its window; ``common_ratio`` = its samples per second over the
    common reference's (stock Megatron-Core DP4, failure-free, same setting and round); and per
    run with failures ETTR = its samples per second over its own system's failure-free run of
    the same round, its validation loss minus that run's, torchft's stall per kill."""
    ff = {(r["setting"], r["round"], r["system"]): r for r in runs if r["failure_free"]}
    for r in runs:
        r["kills_in_window"] = kills_in_window(r)
        ref = ff.get((r["setting"], r["round"], REFERENCE))
        r["common_ratio"] = None
        if ref is not None and ref.get("samples_per_s"):
            r["common_ratio"] = round((r.get("samples_per_s") or 0.0) / ref["samples_per_s"], 4)
        if r["failure_free"]:
            r["ettr"] = 1.0
            continue
        own = ff.get((r["setting"], r["round"], r["system"]))
        r["ettr"] = None
        if own is not None and own.get("samples_per_s"):
            r["ettr"] = round((r.get("samples_per_s") or 0.0) / own["samples_per_s"], 4)
        lo, lf = _loss(r), _loss(own) if own else None
        r["val_loss_minus_own_failure_free"] = (
            None if lo is None or lf is None else round(lo - lf, 4)
        )
        if r["system"] == "torchft" and r.get("stall_s") is not None and _kills(r):
            r["torchft_stall_s_per_kill"] = round(r["stall_s"] / _kills(r), 3)


def checks(runs: List[Dict[str, Any]], iters: int) -> Dict[str, Any]:
    """What the headline rests on: torchft's failure-free runs had all four replicas (every
    rank-step and every evaluation); in each round every system that trained all ``iters``
    steps took the same number of kills inside its window (``equal``); a run stopped before the
    end took only the kills of the steps it reached (``unfinished``), and no run took a kill
    outside its window (``outside``)."""
    short = [
        {"setting": r["setting"], "round": r["round"], "rank_steps": r.get("rank_steps"),
         "eval_replicas": r.get("eval_replicas")}
        for r in runs if r["system"] == "torchft" and r["failure_free"] and not full_replicas(r)
    ]  # fmt: skip
    kills: Dict[str, Any] = {}
    for setting in sorted({r["setting"] for r in runs}):
        per_round: Dict[str, Dict[str, int]] = {}
        finished: Dict[str, set] = {}
        unfinished, outside = [], []
        for r in runs:
            if r["setting"] != setting or r["failure_free"]:
                continue
            rnd = str(r["round"])
            per_round.setdefault(rnd, {})[r["system"]] = r["kills_in_window"]
            if r.get("committed", 0) >= iters:
                finished.setdefault(rnd, set()).add(r["kills_in_window"])
            else:
                unfinished.append({"round": r["round"], "system": r["system"],
                                   "committed": r.get("committed"),
                                   "kills_in_window": r["kills_in_window"]})  # fmt: skip
            if _kills(r) != r["kills_in_window"]:
                outside.append({"round": r["round"], "system": r["system"]})
        kills[setting] = {
            "per_round": per_round,
            "equal": all(len(v) <= 1 for v in finished.values()) and not outside,
            "unfinished": unfinished,
            "outside": outside,
        }
    return {
        "torchft_failure_free_runs": sum(
            1 for r in runs if r["system"] == "torchft" and r["failure_free"]
        ),
        "torchft_failure_free_short": short,
        "kills_in_window": kills,
    }


def _overruns(rs: List[Dict[str, Any]]) -> Dict[str, Any]:
    phases = sum((r.get("device_clock") or {}).get("phases", 0) for r in rs)
    over = sum((r.get("device_clock") or {}).get("overruns", 0) for r in rs)
    return {"phases": phases, "overruns": over,
            "fraction": round(over / phases, 4) if phases else None}  # fmt: skip


def summarize(
    runs: List[Dict[str, Any]], systems: List[str], iters: int, emulated_step_s: Optional[float]
) -> Dict[str, Any]:
    """Per setting and system: ETTR over the rounds (mean, 95% t interval), the failure-free
    samples per second, the sample counts, the validation-loss delta and the clock overruns."""
    table: Dict[str, Any] = {}
    for setting in sorted({r["setting"] for r in runs}):
        rows: Dict[str, Any] = {}
        for system in systems:
            mine = [r for r in runs if r["setting"] == setting and r["system"] == system]
            fails = sorted((r for r in mine if not r["failure_free"]), key=lambda r: r["round"])
            refs = sorted((r for r in mine if r["failure_free"]), key=lambda r: r["round"])
            if system == REFERENCE and refs:
                rate = [r["samples_per_s"] for r in refs if r.get("samples_per_s")]
                rows[system] = {
                    "rounds": len(refs),
                    "reference": True,
                    "samples_per_s": rate,
                    "samples_per_s_mean": round(statistics.mean(rate), 4) if rate else None,
                    "over_emulated_ideal": (
                        round(statistics.mean(rate) * emulated_step_s / GBS, 4)
                        if rate and emulated_step_s
                        else None
                    ),
                    "clock_overruns": _overruns(refs),
                    "loadavg_end": [r["loadavg_start_end"][1][0] for r in refs],
                }
                continue
            if not fails:
                continue
            ettr = [r["ettr"] for r in fails if r.get("ettr") is not None]
            ci = interval(ettr)
            common = [r["common_ratio"] for r in fails if r.get("common_ratio") is not None]
            cci = interval(common)
            ff_rate = [r["samples_per_s"] for r in refs if r.get("samples_per_s")]
            delta = [r["val_loss_minus_own_failure_free"] for r in fails]
            bound = None if ci["ci95"] is None else 1 + ci["ci95"]
            rows[system] = {
                "rounds": len(fails),
                "common_mean": cci["mean"],
                "common_ci95": cci["ci95"],
                "common_per_round": common,
                "ff_over_common_reference": [r.get("common_ratio") for r in refs],
                "ettr_mean": ci["mean"],
                "ettr_ci95": ci["ci95"],
                "ettr_per_round": ettr,
                "ettr_min": min(ettr) if ettr else None,
                "ettr_max": max(ettr) if ettr else None,
                "runs_above_1_plus_ci95": [
                    r["round"] for r in fails if bound is not None and (r["ettr"] or 0) > bound
                ],
                "ff_samples_per_s": ff_rate,
                "ff_samples_per_s_mean": round(statistics.mean(ff_rate), 4) if ff_rate else None,
                "ff_over_emulated_ideal": (
                    round(statistics.mean(ff_rate) * emulated_step_s / GBS, 4)
                    if ff_rate and emulated_step_s
                    else None
                ),
                "kills_in_window": [r["kills_in_window"] for r in fails],
                "kills_mean": statistics.mean(r["kills_in_window"] for r in fails),
                "kills_after_window": [_kills(r) - r["kills_in_window"] for r in fails],
                "committed": [r["committed"] for r in fails],
                "samples_trained": [r["samples_trained"] for r in fails],
                "samples_trained_fraction": [
                    round(r["samples_trained"] / (iters * GBS), 4) for r in fails
                ],
                "skipped_samples": [r["skipped_samples"] for r in fails],
                "repeated_samples": [r["repeated_samples"] for r in fails],
                "val_loss": [_loss(r) for r in fails],
                "ff_val_loss": [_loss(r) for r in refs],
                "val_loss_minus_own_failure_free": delta,
                "val_loss_delta_mean": (
                    round(statistics.mean(d for d in delta if d is not None), 4)
                    if any(d is not None for d in delta)
                    else None
                ),
                "clock_overruns_failure_free": _overruns(refs),
                "clock_overruns_failures": _overruns(fails),
                "loadavg_end": [r["loadavg_start_end"][1][0] for r in mine],
            }
        table[setting] = rows
    return table


def markdown(table: Dict[str, Any], iters: int) -> str:
    """The docs table: per setting and system, ETTR in samples with its interval."""

    def cell(xs: List[Any], fmt: str = "{}") -> str:
        return ", ".join("-" if x is None else fmt.format(x) for x in xs)

    lines = [
        "| setting | system | samples/s ÷ common reference (emulated) mean ± 95% | per round | "
        "ETTR (own failure-free) mean ± 95% | per round | failure-free samples/s "
        "(emulated) | kills in window | samples trained | val loss − own failure-free | "
        "phases overrun |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, rows in table.items():
        for system, r in rows.items():
            if r.get("reference") or r["ettr_mean"] is None:
                continue
            over = r["clock_overruns_failures"]
            lines.append(
                f"| {setting} | {system} | {r['common_mean'] or 0:.3f} ± "
                f"{r['common_ci95'] or 0:.3f} | {cell(r['common_per_round'], '{:.3f}')} | "
                f"{r['ettr_mean']:.3f} ± {r['ettr_ci95'] or 0:.3f} | "
                f"{cell(r['ettr_per_round'], '{:.3f}')} | "
                f"{r['ff_samples_per_s_mean'] or 0:.2f} | {cell(r['kills_in_window'])} | "
                f"{cell(r['samples_trained_fraction'], '{:.2f}')} of {iters * GBS} | "
                f"{cell(r['val_loss_minus_own_failure_free'], '{:+.3f}')} | "
                f"{over['overruns']} of {over['phases']} |"
            )
    return "\n".join(lines)


def plot(table: Dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(table)
    systems = list(dict.fromkeys(s for rows in table.values() for s, r in rows.items()
                                 if not r.get("reference")))  # fmt: skip
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(settings))
    top = 1.0
    for i, setting in enumerate(settings):
        xs, ys, err = [], [], []
        for j, system in enumerate(systems):
            row = table[setting].get(system)
            if not row or row.get("reference") or row.get("common_mean") is None:
                continue
            x = j + (i - (len(settings) - 1) / 2) * width
            xs.append(x)
            ys.append(row["common_mean"])
            err.append(row["common_ci95"] or 0.0)
            pts = row["common_per_round"]
            ax.plot([x] * len(pts), pts, "o", ms=3, color="black", alpha=0.6)
            top = max(top, max(pts), row["common_mean"] + (row["common_ci95"] or 0))
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=setting.replace("_", ", "))
    ax.set_xticks(range(len(systems)))
    ax.set_xticklabels(systems, rotation=15)
    ax.set_ylabel("samples/s ÷ stock DP4 failure-free, emulated\n(bar: mean; whiskers: "
                  "95% t; dots: rounds)",
                  fontsize=8)  # fmt: skip
    ax.set_ylim(0, top + 0.1)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def emulated_step(shape: Optional[str], microbatches: int) -> Optional[float]:
    """The device clock's failure-free step time of ``shape`` (None without a clock)."""
    if not shape:
        return None
    from megatron_mecefo.planner.device_clock import clock_for

    return clock_for(shape).step_s(microbatches)


def main() -> None:
    global DEVICE_CLOCK
    if len(sys.argv) > 2 and sys.argv[1] == "--delayed-exec":  # the checkpoint-restart shim
        delayed_exec(sys.argv[2], sys.argv[4:])
        return
    # A SIGTERM (a timeout, CI) unwinds through the finally blocks that end every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="the smoke test: S4_R5, one round, 12 batches, the reference, "
                   "checkpoint-restart, torchft and mecefo-auto")  # fmt: skip
    p.add_argument("--settings", default="S8_R5",
                   help="comma list of S<steps>_R<seconds> (kill k at step k x steps, the same "
                   "steps for every system) or T<seconds>_R<seconds> (kill k at k x T s after "
                   "step 1); R: seconds until the dead rank's new process starts")  # fmt: skip
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=24, help="global batches per run")
    p.add_argument("--seed", type=int, default=30)
    p.add_argument("--device-clock", default="llama-1b-h100",
                   help="emulated GPU shape of every rank (megatron_mecefo/runtime/"
                   "device_clock.py); 'none': CPU time, load-dependent")  # fmt: skip
    p.add_argument(
        "--max-slowdown",
        type=float,
        default=5.0,
        help="stop a run after this many emulated failure-free training times (+60 s): "
        "what it committed by then counts",
    )
    p.add_argument(
        "--save-time",
        type=float,
        default=None,
        help="seconds per checkpoint save (default: measured; --quick 0.5)",
    )
    p.add_argument("--data-path", default=str(REPO / "data" / "stdlib_text_document"))
    p.add_argument("--output", default=None, help="default results/goodput.json")
    p.add_argument("--plot", default=None, help="default: results/plots/<--output's name>.png "
                   "for an --output in results/, else --output's path with .png")  # fmt: skip
    p.add_argument("--workdir", default=str(REPO / "results" / "goodput"))
    p.add_argument("--plot-only", default=None, metavar="JSON", help="only plot this result")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs in --output (a partial file); run the rest")  # fmt: skip
    p.add_argument("--recount", action="store_true",
                   help="rebuild --output's table, derived fields and plot from its runs (a "
                   "partial file too), with the same flags as the run")  # fmt: skip
    a = p.parse_args()
    DEVICE_CLOCK = None if a.device_clock == "none" else a.device_clock
    if a.plot_only:
        res = json.loads(Path(a.plot_only).read_text())
        plot(
            res["table"],
            Path(a.plot) if a.plot else plot_path(Path(a.plot_only)),
            res.get("plot_title", "goodput"),
        )
        return
    if a.quick:
        a.settings, a.repeats, a.iters = "S4_R5", 1, 12
        a.systems = f"{REFERENCE},checkpoint-restart,torchft,mecefo-auto"
        a.save_time = 0.5 if a.save_time is None else a.save_time
    suffix = "_quick" if a.quick else ""
    a.output = a.output or str(REPO / "results" / f"goodput{suffix}.json")
    a.plot = a.plot or str(plot_path(Path(a.output)))
    systems = [s for s in a.systems.split(",") if s]
    if "torchft" in systems and not TFT_PYTHON.exists() and not a.recount:
        print(f"goodput: {TFT_PYTHON} missing (make bench-goodput sets it up): torchft left out")
        systems.remove("torchft")
    settings = {}
    for s in a.settings.split(","):
        settings[s] = parse_setting(s)
    step_s = emulated_step(DEVICE_CLOCK, GBS // (2 * 4))
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
               tuple(loads[0][0]), tuple(loads[-1][1]), step_s)  # fmt: skip
        return
    out = Path(a.workdir)
    out.mkdir(parents=True, exist_ok=True)
    load_start, t_start = os.getloadavg(), time.time()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    calibration = None
    if a.save_time is None:
        calibration = measure_save_time(out, a.data_path, iters=12, every=3)
        a.save_time = calibration["save_s"]
        print(f"goodput: save time {a.save_time:.2f} s ({calibration})", flush=True)
    # Without the clock the per-step time is the calibration's (start-up included).
    step_ref = step_s or (calibration["wall_plain_s"] / 12 if calibration else 0.2)
    budget = a.max_slowdown * a.iters * step_ref + 60
    runs: List[Dict[str, Any]] = []
    if a.resume and Path(a.output).exists():  # keep the finished runs of an interrupted run
        runs = json.loads(Path(a.output).read_text())["runs"]
        print(f"goodput: resuming after {len(runs)} finished runs", flush=True)
    done = {(r["setting"], r["round"], r["system"], r["failure_free"]) for r in runs}
    for setting, (period, repair, every) in settings.items():
        # Young/Daly over the time between kills (by step: every x the emulated step).
        k = young_daly(a.save_time, every * step_ref if every else period, step_ref)
        for rnd in range(a.repeats):
            seed = a.seed * 1000 + rnd * 17 + int(period)
            # Rotate the systems' order, and alternate which run of a pair goes first.
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
            kinds = (True, False) if rnd % 2 == 0 else (False, True)
            for system in order:
                for failure_free in (True,) if system == REFERENCE else kinds:
                    if (setting, rnd, system, failure_free) in done:
                        continue
                    name = "failure-free" if failure_free else "failures"
                    try:
                        run = run_one(
                            system,
                            out / setting / f"r{rnd}" / system / name,
                            a,
                            math.inf if failure_free else period,
                            repair,
                            seed,
                            k,
                            budget,
                            every,
                        )
                    except Exception as e:  # a harness error ends this run, not the benchmark
                        load = list(os.getloadavg())
                        run = {"error": repr(e), "rc": None, "committed": 0, "kills": [],
                               "skipped_samples": a.iters * GBS, "repeated_samples": 0,
                               "samples_trained": 0, "window_s": None, "samples_per_s": None,
                               "wall_s": 0.0, "loadavg_start_end": [load, load]}  # fmt: skip
                    run["system"], run["failure_free"] = system, failure_free
                    run["setting"], run["round"], run["seed"] = setting, rnd, seed
                    runs.append(run)
                    if system == "torchft" and failure_free and not full_replicas(run):
                        print(f"goodput: FAIL: torchft's failure-free run of {setting} round "
                              f"{rnd} ran {run.get('rank_steps')} of "
                              f"{run.get('rank_steps_expected')} rank-steps, "
                              f"{run.get('eval_replicas')} of 4 replicas at the evaluation",
                              flush=True)  # fmt: skip
                    ev = run.get("eval") or {}
                    oc = run.get("device_clock") or {}
                    print(
                        f"goodput {setting} round {rnd} {system:>18} {name:>12}: wall "
                        f"{run['wall_s']:6.1f} s, window {run['window_s']} s, committed "
                        f"{run['committed']}/{a.iters}, samples/s {run['samples_per_s']}, "
                        f"kills {_kills(run)}, skipped {run['skipped_samples']}, val loss "
                        f"{ev.get('loss', float('nan')):.4f}, overruns "
                        f"{oc.get('overruns')}/{oc.get('phases')} (rc {run['rc']}, load "
                        f"{run['loadavg_start_end'][1][0]:.1f})",
                        flush=True,
                    )
                    Path(a.output).write_text(
                        json.dumps({"partial": True, "date": started, "runs": runs}, indent=1)
                    )
    finish(a, runs, systems, settings, calibration, started, time.time() - t_start, load_start,
           os.getloadavg(), step_s)  # fmt: skip


def finish(
    a: argparse.Namespace,
    runs: List[Dict[str, Any]],
    systems: List[str],
    settings: Dict[str, Tuple[float, float, Optional[int]]],
    calibration: Optional[Dict[str, Any]],
    started: str,
    duration: float,
    load_start: Tuple[float, ...],
    load_end: Tuple[float, ...],
    step_s: Optional[float],
) -> None:
    """The table, JSON, plot and summary line of ``runs``."""
    _post(runs)
    table = summarize(runs, systems, a.iters, step_s)
    clock = None
    if DEVICE_CLOCK:
        from megatron_mecefo.planner.device_clock import clock_for

        clock = clock_for(DEVICE_CLOCK).summary()
        del clock["stats"]
    result = {
        "benchmark": "goodput",
        "date": started,
        "duration_s": round(duration, 1),
        "emulated": bool(DEVICE_CLOCK),
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
            "device_clock": clock,
            "emulated_step_s": step_s,
            "settings": {
                s: {"T_s": None if e else t, "R_s": r, "kill_every_steps": e}
                for s, (t, r, e) in settings.items()
            },
            "kill_schedule": "S<n>: kill k when the run first reaches step k * n (its record "
            "appears), for k * n below the last step: the same steps for every system, all "
            "inside the training window; T<s>: kill k at k * T s after the first training "
            "step's record. Only the kills inside the window are counted (kills_in_window)",
            "common_reference": f"{REFERENCE}: stock Megatron-Core DP4 (the example trainer "
            "without --mecefo, no checkpoint saves) under torchrun and the same device clock, "
            "failure-free, one run per round; common_ratio = a run's samples per second over "
            "this run's of the same round (the headline column)",
            "repeats": a.repeats,
            "seed": a.seed,
            "systems": systems,
            "order": "per round: the systems rotated by the round number; each system's "
            "failure-free run and its run with failures back to back, failure-free first in "
            "even rounds",
            "save_time_s": a.save_time,
            "save_time_calibration": calibration,
            "checkpoint_interval": "Young/Daly: round(sqrt(2 * save_time_s * T) / step s) "
            "iterations (the run's save_interval); its failure-free run saves at the same K",
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
            "torchft": "0.2.0 in .venv-tft (the newest release on PyPI here); failure-free: "
            "Lighthouse min_replicas 4, join_timeout 60 s, heartbeat timeout 60 s, Manager "
            "min_replica_size 4 (all four replicas in every step; checked: rank_steps and "
            "eval_replicas); under kills: Lighthouse min_replicas 1, join_timeout 1 s, "
            "heartbeat timeout 5 s, Manager min_replica_size 1; synchronous quorum, "
            "ProcessGroupGloo timeout 30 s; one "
            "replica group per process; the same model, data shares and AdamW settings and "
            "parameter groups as the example trainer, no Megatron DDP",
            "ettr": "samples trained on (entered a committed update) in steps 2..N per second "
            "of the training window (step 1's record to step N's), over the same system's "
            "failure-free run of the same round (the second column)",
            "interval": "95% Student t over the rounds",
            "max_slowdown": a.max_slowdown,
        },
        "table": table,
        "checks": checks(runs, a.iters),
        "runs": runs,
    }
    title = (
        f"goodput (emulated: {DEVICE_CLOCK}), DP4 on 4 CPU ranks, {a.iters} global batches, "
        f"{a.repeats} round(s); load {load_start[0]:.1f} -> {load_end[0]:.1f}"
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
        cells = ", ".join(
            f"{s} {r['common_mean']} ± {r['common_ci95']} (ETTR {r['ettr_mean']})"
            for s, r in rows.items()
            if not r.get("reference") and r["common_mean"] is not None
        )
        parts.append(f"{setting}: {cells}")
    print(
        f"goodput (DP4, emulated {DEVICE_CLOCK}, {a.iters} batches, {a.repeats} round(s), "
        f"save every K by Young/Daly from {a.save_time:.2f} s saves, load {load_start[0]:.1f} "
        f"-> {load_end[0]:.1f}, {duration:.0f} s): samples/s over stock DP4's failure-free "
        + "; ".join(parts)
        + f"; wrote {a.output}"
    )
    bad = result["checks"]["torchft_failure_free_short"]
    if bad or not all(c["equal"] for c in result["checks"]["kills_in_window"].values()):
        raise SystemExit(
            f"goodput: FAIL: torchft failure-free runs short of all replicas: {bad}; kills in "
            f"window per round equal for every system: "
            f"{ {k: v['equal'] for k, v in result['checks']['kills_in_window'].items()} }"
        )


if __name__ == "__main__":
    main()
