"""Recovery at model scale: regroup and heal time, heal bandwidth and memory, per state size.

For each trainer (``--trainers``: the example trainer ``examples/pretrain_gpt/pretrain_gpt.py``
and Megatron-LM's own ``pretrain_gpt.py`` at core_v0.16.1, patched, through
``patches/run_megatron_lm_cpu.py`` as ``recovery_latency.py --trainer megatron-lm`` runs it),
each data-parallel size (``--dps``) and each state size per rank (``--sizes``, GiB of fp32
weights + gradients + Adam moments, about 16 bytes per parameter; the model is sized by its
hidden size and layer count, :data:`SIZES`), one supervised run on CPU ranks over gloo:

* rank 1 is SIGKILLed in the forward of iteration ``--kill-iteration`` (``--mecefo-kill``); the
  survivors regroup without it and redo the iteration; a warm standby replaces it
  ``--replace-after`` seconds later and rejoins at an iteration boundary, healed from a
  data-parallel peer; the run trains ``--after-iterations`` past the rejoin, then the benchmark
  ends it (every process by PID);
* a thread samples ``VmRSS`` of every process under the supervisor (``/proc/*/stat`` parents)
  every ``--sample-ms``; the phase windows come from the members' absolute timestamps in the
  membership store (``killed/<slot>/<inc>``, ``rt/<generation>/<slot>``) and, failing that,
  from the run's log lines, stamped as the benchmark reads them.

Per run: kill -> redone (``total_s``), ``regroup_s``, ``heal_s`` (from the recovery records),
heal GB/s (the record's byte count if it has one, else 12 bytes per parameter: fp32 weights
and Adam's two moments, what the heal copies), and per role (``survivor`` during the regroup;
``sender``, ``joiner``, ``bystander`` during the rejoin) the peak and after-heal RSS against
the steady RSS before the kill (the joiner against its slot's previous incarnation), and the
spurious generations (a failure generation that lost no rank). gloo's own bandwidth for one
large float32 tensor between two processes on loopback (send/recv and broadcast) is measured
in the same invocation, before the runs, and the heal's bandwidth is reported against it.

Before gloo's measurement and before each run the benchmark waits (``--quiet-wait``) for a
quiet machine (fewer than ``--quiet-cores`` busy over 3 s) and for ``--memory-headroom`` times
the run's estimated memory to be available; a configuration whose estimated total (``dp`` ranks
and a joiner at 1.3 x the state) exceeds ``--memory-limit-gib`` (14) is skipped, and a run is
killed if its processes exceed ``--memory-cap-gib`` or the machine's ``MemAvailable`` falls
below ``--memory-floor-gib``; each run records the CPU that other processes used meanwhile
(``foreign_cpu_cores``) and ends after ``--run-timeout`` seconds at most ("timed out").

Usage (repo root)::

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recovery_scale.py \\
        [--sizes 0.1,0.4,1.6,3.2] [--dps 2,4] [--trainers example,megatron-lm] [--quick]

``--quick``: 0.1 and 0.4 GiB, DP2, the example trainer, gloo at 256 MiB once (about 2 minutes
on a quiet machine). ``results/recovery_scale_before.json`` is ``--sizes 0.1,0.4,1.6 --dps 2
--trainers example`` on the heal before its rewrite (``broadcast_object_list`` of the pickled
state).

Writes ``results/recovery_scale.json`` (``--output``), ``results/plots/recovery_scale.png``
(``--plot``; for an output outside ``results/``, the output's path with ``.png``) and prints a
one-line summary. Run folders (logs, records, pid files, RSS series) go to
``results/recovery_scale/`` (``--workdir``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from goodput import _read_jsonl  # noqa: E402  (a sibling script: complete JSON lines)
from recovery_latency import _Tail  # noqa: E402
from run_header import plot_path, run_header  # noqa: E402

from megatron_mecefo.recovery.records import _heal_seconds  # noqa: E402
from megatron_mecefo.recovery.state.memory import mem_available, rss_bytes  # noqa: E402

TRAINER = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt.py"
GIB = 1024**3
STATE_BYTES_PER_PARAM = 16
"""fp32 weights, gradients (the DDP buffer) and Adam's two moments: what a rank holds."""
HEAL_BYTES_PER_PARAM = 12
"""What a heal copies per parameter when the record gives no byte count: fp32 weights and
Adam's two moments (the gradient buffer is not part of the state)."""
SIZES: Dict[str, Tuple[int, int, int]] = {
    "0.1": (4, 384, 6),
    "0.4": (4, 768, 12),
    "1.6": (9, 1024, 16),
    "3.2": (18, 1024, 16),
}
"""State size label (GiB per rank) -> (layers, hidden size, attention heads)."""
EXAMPLE_VOCAB = 384  # ByteTokenizer's 258 ids padded to a multiple of 128
MLM_VOCAB = 128  # --vocab-size 128, padded to a multiple of 128
RESIDENT_PER_STATE = 1.3
"""Resident memory of a rank over its state (1.6 GB of state: about 2.1 GiB resident)."""
ROLES = ("survivor", "sender", "joiner", "bystander")
GOALS = {
    "heal_vs_gloo_min": 0.7,
    "regroup_1.6_over_0.1_max": 1.5,
    "peak_over_steady_max": 1.15,  # sender, joiner, bystander
    "survivor_regroup_peak_over_steady_max": 1.25,
    "after_over_steady_max": 1.05,
    "spurious_generations": 0,
}
ITERATION = re.compile(r"\] iteration +(\d+)/")
PARAMS_EXAMPLE = re.compile(r"([\d,]+) params on rank 0")
PARAMS_MLM = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank "
                        r"\(0, 0\): (\d+)")  # fmt: skip
HEALED = "MeCeFO recovery: healed"


# ------------------------------------------------------------------ sizes and the model


def example_params(layers: int, hidden: int, vocab: int = EXAMPLE_VOCAB) -> int:
    """Parameters of the example trainer's default GPT (LLaMA-style: RMSNorm, SwiGLU with
    ffn ``int(8 h / 3 / 64) * 64``, no biases, rotary positions, untied embeddings)."""
    ffn = int(8 * hidden / 3 / 64) * 64
    layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
    return layers * layer + 2 * vocab * hidden + hidden


def mlm_params(layers: int, hidden: int, seq: int, vocab: int = MLM_VOCAB) -> int:
    """Parameters of Megatron-LM's GPT as the benchmark runs it (LayerNorm, GeLU MLP 4h,
    biases, learned positions, separate input and output embeddings: 7,209,216 at 4 x 384
    in its log)."""
    layer = 12 * hidden * hidden + 13 * hidden
    return layers * layer + 2 * vocab * hidden + seq * hidden + 2 * hidden


def estimated_total_gib(state_gib: float, dp: int) -> float:
    """Resident memory of a run: ``dp`` ranks and a joiner at :data:`RESIDENT_PER_STATE`."""
    return (dp + 1) * state_gib * RESIDENT_PER_STATE


# ------------------------------------------------------------------ pure analysis


def assign_roles(records: Sequence[Dict[str, Any]], world: int) -> Dict[str, Any]:
    """Roles of the slots of a data-parallel-only run, from its recovery records.

    Args:
        records: The run's ``recovery`` records (other types are ignored).
        world: Ranks at the start.

    Returns:
        ``lost``: the slots the first failure lost; ``survivor``: the others; ``joiner``: the
        slots the heal's generation joined; ``sender``: the lowest member of that generation
        that did not join (the heal's source: the first rank of the data-parallel group that
        holds the newest state); ``bystander``: its other members; ``heal_generation`` and
        ``failure_generation``. Empty lists and ``None`` where a record is missing.
    """
    recs = [r for r in records if r.get("type", "recovery") == "recovery"]
    failure = next((r for r in recs if r["kind"] == "failure" and r["ranks_lost"]), None)
    heal = next((r for r in recs if r.get("ranks_joined")), None)
    lost = list(failure["ranks_lost"]) if failure else []
    out: Dict[str, Any] = {
        "failure_generation": failure["generation"] if failure else None,
        "heal_generation": heal["generation"] if heal else None,
        "lost": lost,
        "survivor": [s for s in range(world) if s not in lost] if failure else [],
        "sender": None,
        "joiner": [],
        "bystander": [],
    }
    if heal is not None:
        joined = list(heal["ranks_joined"])
        members = sorted(heal["replicas"])  # data-parallel only: replica index == slot
        holders = [s for s in members if s not in joined]
        out["joiner"] = joined
        out["sender"] = holders[0] if holders else None
        out["bystander"] = holders[1:]
    return out


def spurious_generations(records: Sequence[Dict[str, Any]]) -> List[int]:
    """Failure generations whose record names no lost rank (the goal: none)."""
    return [
        r["generation"]
        for r in records
        if r.get("type", "recovery") == "recovery" and r["kind"] == "failure"
        and not r.get("ranks_lost")
    ]  # fmt: skip


def window_max(
    series: Sequence[Tuple[float, int]], start: Optional[float], end: Optional[float]
) -> Optional[int]:
    """The largest sample of ``series`` (``(time, value)``) with ``start <= time <= end``;
    ``None`` if no sample falls there or a bound is unknown."""
    if start is None or end is None:
        return None
    vals = [v for t, v in series if start <= t <= end]
    return max(vals) if vals else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b`` rounded to 3 places, or ``None``."""
    return None if a is None or not b else round(a / b, 3)


def role_memory(
    series: Dict[int, Sequence[Tuple[float, int]]],
    pids: Dict[str, List[Tuple[int, int]]],
    windows: Dict[str, Tuple[Optional[float], Optional[float]]],
) -> Dict[str, Dict[str, Any]]:
    """Peak and after-heal RSS per role against the steady RSS before the kill.

    Args:
        series: Per PID, its ``(time, RSS bytes)`` samples.
        pids: Per role, ``(pid, steady pid)`` pairs: the process in the role and the one whose
            steady RSS it is compared with (itself, or the dead incarnation of its slot).
        windows: ``steady`` (before the kill), ``regroup`` (kill -> redone), ``heal`` (the
            rejoin's boundary -> its first step done), optionally ``heal_copy`` (the state
            copy and its checksum alone: the members' ``constructed`` -> ``healed``), and
            ``after`` (the second iteration after the rejoin), each ``(start, end)`` in
            ``time.time`` seconds.

    Returns:
        Per role: ``steady``, ``peak`` (in the regroup window for ``survivor``, the heal window
        otherwise), ``copy_peak`` (the heal copy's window; not for ``survivor``) and ``after``
        in bytes (the role's largest over its processes), and ``peak_ratio``,
        ``copy_peak_ratio`` and ``after_ratio``, the largest per-process ratios.
    """
    out: Dict[str, Dict[str, Any]] = {}
    for role, pairs in pids.items():
        survivor = role == "survivor"
        phase = "regroup" if survivor else "heal"
        steady, peak, copy, after, peak_r, copy_r, after_r = [], [], [], [], [], [], []
        for pid, steady_pid in pairs:
            s = window_max(series.get(steady_pid, []), *windows["steady"])
            p = window_max(series.get(pid, []), *windows[phase])
            c = None
            if not survivor:
                c = window_max(series.get(pid, []), *windows.get("heal_copy", (None, None)))
            a = None if survivor else window_max(series.get(pid, []), *windows["after"])
            steady.append(s)
            peak.append(p)
            copy.append(c)
            after.append(a)
            peak_r.append(ratio(p, s))
            copy_r.append(ratio(c, s))
            after_r.append(ratio(a, s))

        def top(vals: List[Any]) -> Any:
            known = [v for v in vals if v is not None]
            return max(known) if known else None

        out[role] = {
            "pids": [p for p, _ in pairs],
            "steady_bytes": top(steady),
            "peak_bytes": top(peak),
            "copy_peak_bytes": top(copy),
            "after_bytes": top(after),
            "peak_ratio": top(peak_r),
            "copy_peak_ratio": top(copy_r),
            "after_ratio": top(after_r),
        }
    return out


HEAL_RATIO_GOALS = ("heal_vs_gloo", "heal_vs_gloo_same_size", "heal_vs_link")
"""The heal's bandwidth over each reference (the 1 GiB tensor before the runs, gloo of the same
bytes, gloo in the job's processes), each held to ``GOALS["heal_vs_gloo_min"]``."""


def goal_checks(run: Dict[str, Any], gloo_gbps: Optional[float]) -> Dict[str, Optional[bool]]:
    """Pass/fail of the per-run goals (:data:`GOALS`); ``None`` where unmeasured."""
    mem = run.get("memory", {})

    def at_most(v: Optional[float], limit: float) -> Optional[bool]:
        return None if v is None else v <= limit

    peaks = [mem.get(r, {}).get("peak_ratio") for r in ("sender", "joiner", "bystander")
             if mem.get(r, {}).get("pids")]  # fmt: skip
    afters = [mem.get(r, {}).get("after_ratio") for r in ("sender", "joiner", "bystander")
              if mem.get(r, {}).get("pids")]  # fmt: skip
    heal = run.get("heal_gbps")
    refs = (gloo_gbps, run.get("gloo_same_size_gbps"), run.get("heal_link_gbps"))
    checks: Dict[str, Optional[bool]] = {
        **{goal: None if heal is None or not ref else heal / ref >= GOALS["heal_vs_gloo_min"]
           for goal, ref in zip(HEAL_RATIO_GOALS, refs, strict=True)},
        "peak_sender_joiner_bystander": None if not peaks or None in peaks else
        max(peaks) <= GOALS["peak_over_steady_max"],
        "survivor_regroup_peak": at_most(mem.get("survivor", {}).get("peak_ratio"),
                                         GOALS["survivor_regroup_peak_over_steady_max"]),
        "after_heal": None if not afters or None in afters else
        max(afters) <= GOALS["after_over_steady_max"],
        "spurious_generations": None if run.get("spurious_generations") is None else
        len(run["spurious_generations"]) == 0,
    }  # fmt: skip
    return checks


def heal_bytes(rec: Dict[str, Any], params: Optional[int]) -> Tuple[Optional[int], str]:
    """The bytes a heal copied: the record's own count if it has one (a key with ``bytes``
    in its name), else :data:`HEAL_BYTES_PER_PARAM` per parameter."""
    for key in ("heal_bytes", "state_bytes", "bytes", "heal_state_bytes"):
        if isinstance(rec.get(key), (int, float)) and rec[key] > 0:
            return int(rec[key]), f"record:{key}"
    for key, val in rec.items():
        if "bytes" in key and isinstance(val, (int, float)) and val > 0:
            return int(val), f"record:{key}"
    if params is None:
        return None, "unknown"
    return HEAL_BYTES_PER_PARAM * params, f"computed: {HEAL_BYTES_PER_PARAM} B/parameter"


# ------------------------------------------------------------------ processes and sampling


def _env() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _ppid_map() -> Dict[int, int]:
    """pid -> parent pid of every process (``/proc/*/stat``)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(name)] = int(fields[1])
    return out


def descendants(root: int, ppids: Dict[int, int]) -> List[int]:
    """Every process below ``root`` in ``ppids`` (pid -> parent)."""
    kids: Dict[int, List[int]] = {}
    for pid, parent in ppids.items():
        kids.setdefault(parent, []).append(pid)
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _rss(pid: int) -> Optional[int]:
    """VmRSS of ``pid`` in bytes, or ``None`` if it is gone."""
    try:
        return rss_bytes(str(pid)) or None  # a zombie has no VmRSS
    except OSError:
        return None


def _busy_jiffies() -> int:
    """CPU time all processes of the machine used, in clock ticks (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # less idle, iowait


def _cpu_jiffies(pid: int) -> Optional[int]:
    """utime + stime of ``pid`` in clock ticks, or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


class RssSampler(threading.Thread):
    """Samples VmRSS of every process under ``root`` every ``interval`` seconds; also the
    machine's ``MemAvailable`` and the CPU that processes outside the run used meanwhile (other
    jobs on a shared machine)."""

    def __init__(self, root: int, interval: float, cap_bytes: int, floor_bytes: int) -> None:
        super().__init__(daemon=True)
        self.root, self.interval, self.cap, self.floor = root, interval, cap_bytes, floor_bytes
        self.series: Dict[int, List[Tuple[float, int]]] = {}
        self.total: List[Tuple[float, int]] = []
        self.min_available: Optional[int] = None
        self.over_cap = ""
        self.halt = threading.Event()
        self._cpu: Dict[int, int] = {}
        self._t0, self._busy0 = time.time(), _busy_jiffies()

    def foreign_cores(self) -> float:
        """Cores that processes outside the run used on average since the start."""
        hz = os.sysconf("SC_CLK_TCK")
        busy = _busy_jiffies() - self._busy0
        return round(max(0.0, (busy - sum(self._cpu.values())) / hz / (time.time() - self._t0)), 2)

    def run(self) -> None:
        while not self.halt.is_set():
            pids = descendants(self.root, _ppid_map())
            now, total = time.time(), 0
            for pid in pids:
                rss = _rss(pid)
                if rss:
                    self.series.setdefault(pid, []).append((now, rss))
                    total += rss
                cpu = _cpu_jiffies(pid)
                if cpu is not None:
                    self._cpu[pid] = cpu
            self.total.append((now, total))
            avail = mem_available()
            self.min_available = min(avail, self.min_available or avail)
            if total > self.cap:
                self.over_cap = f"total RSS {total / GIB:.1f} GiB above --memory-cap-gib"
            elif avail < self.floor:
                self.over_cap = (f"the machine's MemAvailable {avail / GIB:.1f} GiB below "
                                 f"--memory-floor-gib")  # fmt: skip
            self.halt.wait(self.interval)


def busy_cores(seconds: float) -> float:
    """Cores the machine's processes used on average over the next ``seconds``."""
    b0, t0 = _busy_jiffies(), time.time()
    time.sleep(seconds)
    return (_busy_jiffies() - b0) / os.sysconf("SC_CLK_TCK") / (time.time() - t0)


def wait_for_machine(need_bytes: int, max_cores: float, timeout: float) -> Dict[str, Any]:
    """Wait up to ``timeout`` s for ``need_bytes`` of ``MemAvailable`` and a quiet machine
    (below ``max_cores`` busy over 3 s: other jobs on a shared machine); what was found, and
    how long it took."""
    t0 = time.time()
    while True:
        avail, busy = mem_available(), busy_cores(3.0)
        ok_mem, quiet = avail >= need_bytes, busy < max_cores
        if (ok_mem and quiet) or time.time() - t0 > timeout:
            return {"waited_s": round(time.time() - t0, 1), "mem_available_gib":
                    round(avail / GIB, 2), "busy_cores_3s": round(busy, 2),
                    "loadavg": os.getloadavg(), "memory_ok": ok_mem, "quiet": quiet}  # fmt: skip


class LogTail:
    """New complete lines of a growing log, each with the time this process read it."""

    def __init__(self, path: Path) -> None:
        self._tail = _Tail(path)  # recovery_latency's reader of a growing log
        self.lines: List[Tuple[float, str]] = []

    def poll(self) -> None:
        self.lines += self._tail.lines()

    def iteration_time(self, it: int, after: float = 0.0) -> Optional[float]:
        """When the first log line of iteration ``it`` read at or after ``after`` came."""
        for t, line in self.lines:
            m = ITERATION.search(line)
            if t >= after and m and int(m.group(1)) == it:
                return t
        return None

    def first(self, text: str, after: float = 0.0) -> Optional[float]:
        return next((t for t, ln in self.lines if t >= after and text in ln), None)


def _pid_file(path: Path) -> List[Tuple[int, int, int]]:
    """``(slot, incarnation, pid)`` lines of a supervisor's pid file."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return out


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the supervisor's live descendants (ranks and standbys lead their own sessions:
    their process groups too, with any data-loader workers), found before anything dies, then
    the supervisor's process group. Only live descendants, never a PID from a file or an old
    sample: on a shared machine a dead rank's PID may belong to someone else by now."""
    targets = descendants(proc.pid, _ppid_map())
    for pid in targets:
        for kill, target in ((os.killpg, pid), (os.kill, pid)):
            try:
                if kill is os.killpg and os.getpgid(pid) != pid:
                    continue  # not a group leader: its group is someone else's
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ------------------------------------------------------------------ gloo's own bandwidth


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GLOO_OPS = ("send_recv", "broadcast", "send_recv_fresh")


def gloo_worker(
    rank: int, port: int, sizes_mib: List[int], reps: int, ops: Sequence[str] = GLOO_OPS
) -> None:
    """One of the two processes of :func:`gloo_bandwidth` (rank 0 prints the JSON)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out: Dict[str, Any] = {}
    for mib in sizes_mib:
        n = mib * 1024 * 1024 // 4
        t = torch.ones(n) if rank == 0 else torch.zeros(n)  # the pages faulted in
        res: Dict[str, List[float]] = {op: [] for op in ops}
        for rep in range(reps + 1):  # the first round untimed: a warm-up
            for op in res:
                # send_recv_fresh: into a buffer allocated just before, its pages not yet
                # touched, as a joiner's optimizer moments (and, built without initialisation,
                # its weights) are when the heal's bytes land in them.
                fresh = torch.empty(n) if op == "send_recv_fresh" and rank == 1 else None
                dist.barrier()
                t0 = time.perf_counter()
                if op == "broadcast":
                    dist.broadcast(t, src=0)
                elif rank == 0:
                    dist.send(t, 1)
                else:
                    dist.recv(t if fresh is None else fresh, 0)
                del fresh
                dist.barrier()  # both ends done
                if rep:
                    res[op].append(time.perf_counter() - t0)
        del t
        out[str(mib)] = {
            op: {
                "seconds": [round(x, 4) for x in v],
                "gbps": round(4 * n / statistics.median(v) / 1e9, 3),
            }
            for op, v in res.items()
        }
    if rank == 0:
        print("GLOO_JSON " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def run_pair(cmd: List[str], rank_flag: str, env: Dict[str, str], timeout: float) -> List[str]:
    """Run ``cmd`` twice, with ``rank_flag`` 0 and 1, in sessions of their own; their output.
    Both are ended (by process group) whatever happens.

    Raises:
        subprocess.TimeoutExpired: A worker ran over ``timeout`` seconds.
    """
    procs = [
        subprocess.Popen([*cmd, rank_flag, str(r)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        for r in (0, 1)
    ]
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def gloo_bandwidth(
    sizes_mib: List[int], reps: int, timeout: float, ops: Sequence[str] = GLOO_OPS
) -> Dict[str, Any]:
    """gloo between two processes on loopback: one float32 tensor per size, sent with each of
    ``ops`` (:data:`GLOO_OPS`: send/recv, broadcast, send/recv into a fresh buffer), ``reps``
    times each; GB/s (1e9 bytes) of the median."""
    port = _free_port()
    cmd = [sys.executable, __file__, "--gloo-worker", "--gloo-port", str(port),
           "--gloo-sizes-mib", ",".join(map(str, sizes_mib)), "--gloo-reps", str(reps),
           "--gloo-ops", ",".join(ops)]  # fmt: skip
    try:
        outs = run_pair(cmd, "--gloo-rank", _env(), timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    line = next((ln for ln in outs[0].splitlines() if ln.startswith("GLOO_JSON ")), None)
    if line is None:
        return {"error": outs[0][-2000:]}
    per_size = json.loads(line[len("GLOO_JSON ") :])
    largest = per_size[str(max(sizes_mib))]
    return {
        "sizes_mib": sizes_mib,
        "reps": reps,
        "per_size": per_size,
        "reference_gbps": largest["send_recv"]["gbps"],
        "reference": f"send/recv of {max(sizes_mib)} MiB",
        "reference_fresh_gbps": largest.get("send_recv_fresh", {}).get("gbps"),
        "reference_fresh": f"send/recv of {max(sizes_mib)} MiB into a fresh buffer",
    }


SAME_SIZE_CAP_MIB = 1024
"""Largest one tensor of the same-size reference: beyond 1 GiB gloo's loopback bandwidth no
longer grows with the size, and a larger tensor would cost the machine memory for nothing."""


def same_size_mib(trainer: str, size: str) -> int:
    """MiB of the one tensor that a run's heal is compared with: the heal's own bytes
    (:data:`HEAL_BYTES_PER_PARAM` per parameter), at most :data:`SAME_SIZE_CAP_MIB`."""
    layers, hidden, _ = SIZES[size]
    params = example_params(layers, hidden) if trainer == "example" else mlm_params(
        layers, hidden, 32)  # fmt: skip
    return max(1, min(SAME_SIZE_CAP_MIB, round(HEAL_BYTES_PER_PARAM * params / 2**20)))


def adjacent_gloo(a: argparse.Namespace, sizes_mib: Sequence[int]) -> Dict[str, Any]:
    """gloo's one-tensor send/recv of each of ``sizes_mib`` (0s dropped) between two fresh
    processes, ``--same-size-gloo-reps`` times each (3 if 0): measured right before a run
    and right after it, side by side with its heal; empty with no size."""
    sizes = sorted({m for m in sizes_mib if m})
    if not sizes:
        return {}
    return gloo_bandwidth(sizes, a.same_size_gloo_reps or 3, timeout=300, ops=("send_recv",))


def _send_recv(g: Dict[str, Any], mib: int) -> Dict[str, Any]:
    """The send/recv entry (``seconds``, ``gbps``) of ``mib`` in a :func:`gloo_bandwidth`
    result; empty if it was not measured."""
    return g.get("per_size", {}).get(str(mib), {}).get("send_recv", {})


def same_size_reference(
    mib: int, before: Dict[str, Any], after: Dict[str, Any]
) -> Optional[Dict[str, Any]]:
    """The same-size reference of a run: gloo's one tensor of the heal's bytes (``mib``),
    the seconds measured right before and right after the run, and the GB/s of their
    median; None without a sample."""

    def secs(g: Dict[str, Any]) -> List[float]:
        return _send_recv(g, mib).get("seconds", [])

    both = secs(before) + secs(after)
    if not mib or not both:
        return None
    return {
        "mib": mib,
        "seconds_before": secs(before),
        "seconds_after": secs(after),
        "gbps": round(mib * 2**20 / statistics.median(both) / 1e9, 3),
    }


# ------------------------------------------------------------------ one supervised run


def _trainer_args(trainer: str, size: str, dp: int, iters: int, tree: Optional[Path]) -> List[str]:
    layers, hidden, heads = SIZES[size]
    dims = ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", "32",
            "--micro-batch-size", "1", "--global-batch-size", str(dp),
            "--train-iters", str(iters), "--log-interval", "1", "--eval-iters", "0",
            "--lr", "1e-4", "--lr-decay-style", "constant"]  # fmt: skip
    if trainer == "example":
        return [str(TRAINER), *dims, "--mock-data", "--eval-interval", "100000",
                "--mecefo", "--mecefo-rank", "16"]  # fmt: skip
    import recovery_latency as rl

    model = list(rl.MLM_MODEL)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--max-position-embeddings", "--micro-batch-size", "--global-batch-size",
                 "--log-interval", "--lr", "--lr-decay-style", "--eval-iters"):  # fmt: skip
        i = model.index(flag)
        del model[i : i + 2]
    return [str(rl.MLM_LAUNCHER), "--megatron-lm-dir", str(tree), *model, *dims,
            "--max-position-embeddings", "32", *rl.MLM_MECEFO]  # fmt: skip


def _store_times(store_file: Path, gens: List[int], kill_slot: int) -> Dict[str, Any]:
    """The members' absolute timestamps per generation and the kill time, from the store."""
    from megatron_mecefo.recovery.membership import MembershipStore

    if not (store_file.exists() and store_file.read_text().strip()):
        return {}
    ms = MembershipStore.connect(store_file.read_text().strip(), 10)
    out: Dict[str, Any] = {"generations": {}}
    for g in gens:
        gen = ms.generation(g)
        out["generations"][g] = {
            "members": sorted(gen.members),
            "lost": list(gen.lost),
            "at_iteration": gen.at_iteration,
            "times": {s: ms.get_json(f"rt/{g}/{s}") or {} for s in gen.members},
        }
    killed = ms.get_json(f"killed/{kill_slot}/0")
    out["kill_t"] = killed["t"] if killed else None
    last = ms.generation_number()
    out["store_spurious"] = [g for g in range(1, last + 1)
                             if ms.generation(g).at_iteration is None
                             and not ms.generation(g).lost]  # fmt: skip
    return out


def scale_run(
    a: argparse.Namespace,
    trainer: str,
    size: str,
    dp: int,
    tree: Optional[Path],
    supervisor_flags: Sequence[str] = (),
    tag: str = "",
    env: Optional[Dict[str, str]] = None,
) -> Dict[str, Any]:
    """One supervised run (see the module docstring) and its measurements; ``supervisor_flags``
    are added to the supervisor's, ``env`` to its environment (``tag`` names the run's
    folder)."""
    run_dir = Path(a.workdir) / f"{trainer}_dp{dp}_{size}gib{tag}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for f in run_dir.iterdir():
        if f.is_file():
            f.unlink()
    records, pid_file, store_file, log = (run_dir / n for n in (
        "records.jsonl", "pids.txt", "store.txt", "log.txt"))  # fmt: skip
    kill_it = a.kill_iteration
    iters = kill_it + a.max_iterations_after_kill
    cmd = [sys.executable, "-m", "megatron_mecefo.recovery.supervisor",
           f"--nproc-per-node={dp}", "--pid-file", str(pid_file), "--store-file",
           str(store_file), "--records", str(records),
           "--replace", f"after:{a.replace_after}", "--replace-ranks", "1", "--standby", "1",
           "--heartbeat-interval", "1", "--heartbeat-timeout", str(a.heartbeat_timeout),
           "--collective-timeout", str(a.collective_timeout),
           "--init-timeout", str(a.collective_timeout + 60), *supervisor_flags,
           "--", *_trainer_args(trainer, size, dp, iters, tree),
           "--mecefo-kill", f"1:{kill_it}:forward"]  # fmt: skip
    # Side by side with this run's heal: gloo's one tensor of 1 GiB and of the heal's own
    # bytes right before it, and of the heal's bytes again right after it.
    same_mib = same_size_mib(trainer, size) if a.same_size_gloo_reps else 0
    before = adjacent_gloo(a, [a.adjacent_gloo_mib, same_mib])
    adjacent = _send_recv(before, a.adjacent_gloo_mib).get("gbps")
    load0 = os.getloadavg()
    t0 = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**_env(), **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    sampler = RssSampler(proc.pid, a.sample_ms / 1000, int(a.memory_cap_gib * GIB),
                         int(a.memory_floor_gib * GIB))  # fmt: skip
    sampler.start()
    tail = LogTail(log)
    status = "running"
    store: Dict[str, Any] = {}
    heal_rec: Optional[Dict[str, Any]] = None
    try:
        while True:
            time.sleep(0.05)
            tail.poll()
            recs = [r for r in _read_jsonl(records) if r.get("type") == "recovery"]
            heal_rec = next((r for r in recs if r.get("ranks_joined")), None)
            if heal_rec is not None:
                healed_at = tail.first(HEALED) or t0
                done = tail.iteration_time(heal_rec["iteration"] + a.after_iterations,
                                           after=healed_at)  # fmt: skip
                if done is not None:
                    gens = sorted({r["generation"] for r in recs})
                    try:
                        store = _store_times(store_file, gens, 1)
                    except Exception as err:  # the store gone: the log's times instead
                        store = {"error": f"{type(err).__name__}: {err}"}
                    status = "measured"
                    break
            if sampler.over_cap:
                status = f"killed by the benchmark: {sampler.over_cap}"
                break
            if proc.poll() is not None:
                status = f"exited (rc {proc.returncode}) before the rejoin's measurement"
                break
            if time.time() - t0 > a.run_timeout:
                status = f"timed out after {a.run_timeout:.0f} s"
                break
    finally:
        _kill(proc)
        sampler.halt.set()
        sampler.join()
        tail.poll()
    wall = time.time() - t0
    same = same_size_reference(same_mib, before, adjacent_gloo(a, [same_mib]))
    recs = [r for r in _read_jsonl(records) if r.get("type") == "recovery"]
    result: Dict[str, Any] = {
        "trainer": trainer, "size_gib": size, "dp": dp, "status": status,
        "gloo_adjacent_gbps": adjacent, "gloo_same_size": same,
        "gloo_same_size_gbps": same and same["gbps"], "wall_s": round(wall, 1),
        "kill": f"1:{kill_it}:forward", "train_iters_cap": iters,
        "loadavg_start_end": [load0, os.getloadavg()], "records": recs,
        "foreign_cpu_cores": sampler.foreign_cores(),
        "min_mem_available_gib": round((sampler.min_available or 0) / GIB, 2),
        "log": str(log.relative_to(REPO)) if log.is_relative_to(REPO) else str(log),
    }  # fmt: skip
    result.update(analyze(tail, recs, store, sampler, _pid_file(pid_file), dp, kill_it, a))
    (run_dir / "rss.json").write_text(json.dumps(
        {str(p): s for p, s in sampler.series.items()}))  # fmt: skip
    (run_dir / "store.json").write_text(json.dumps(store, default=str))
    errors = [
        ln
        for _, ln in tail.lines
        if ("Error" in ln or "error:" in ln) and "left generation" not in ln
    ][:5]
    if errors:
        result["error_lines"] = [e[:400] for e in errors]
    return result


def probed_heal_s(store: Dict[str, Any], generation: Optional[int]) -> Optional[float]:
    """The heal of ``generation`` over its sender and joiners alone, each member's counted as
    the record counts it (``records._heal_seconds`` over the store's per-member times; the
    longest), or None where the store lacks them."""
    times = store.get("generations", {}).get(str(generation), {}).get("times", {})
    spans = _heal_seconds({s: t for s, t in times.items()
                           if t.get("heal_role") in ("sender", "joiner")})  # fmt: skip
    return round(max(spans), 4) if spans else None


def analyze(
    tail: LogTail,
    recs: List[Dict[str, Any]],
    store: Dict[str, Any],
    sampler: RssSampler,
    pids: List[Tuple[int, int, int]],
    dp: int,
    kill_it: int,
    a: argparse.Namespace,
) -> Dict[str, Any]:
    """Timings, bandwidth, memory per role and spurious generations of one run."""
    params = None
    for _, line in tail.lines:
        m = PARAMS_EXAMPLE.search(line) or PARAMS_MLM.search(line)
        if m:
            params = int(m.group(1).replace(",", ""))
            break
    roles = assign_roles(recs, dp)
    failure = next((r for r in recs if r["generation"] == roles["failure_generation"]), None)
    heal = next((r for r in recs if r["generation"] == roles["heal_generation"]), None)
    out: Dict[str, Any] = {"params_logged": params, "roles": roles}
    # A replacement up before the survivors regrouped joins the failure's own world: then the
    # regroup includes the heal, and there is no separate rejoin (--replace-after larger).
    out["heal_in_failure_generation"] = (
        roles["heal_generation"] is not None
        and roles["heal_generation"] == roles["failure_generation"]
    )
    if failure:
        out["total_s"] = failure.get("total_s")
        out["regroup_s"] = failure.get("regroup_s")
        out["detect_s"] = failure.get("detect_s")
        out["redo_s"] = failure.get("redo_s")
    if heal:
        out["heal_s"] = heal.get("heal_s")
        if heal.get("heal_link_gbps") and roles.get("bystander"):
            # The link probe runs between the sender and a joiner before their heal begins; a
            # bystander's heal (its wait) begins at once, so its span holds the probe too.
            probed = probed_heal_s(store, roles["heal_generation"])
            if probed:
                out["heal_s_every_member"], out["heal_s"] = out["heal_s"], probed
        out["rejoin_switch_s"] = heal.get("regroup_s")
        out["rejoin_s"] = heal.get("rejoin_s")
        nbytes, source = heal_bytes(heal, params)
        out["heal_bytes"], out["heal_bytes_source"] = nbytes, source
        if nbytes and out["heal_s"]:
            out["heal_gbps"] = round(nbytes / out["heal_s"] / 1e9, 3)
        # The joiner's own transfer (state/tensor_stream.py: its receive loop, checksums in).
        out["heal_transfer_s"] = heal.get("heal_transfer_s")
        out["heal_transfer_gbps"] = heal.get("heal_gbps")
        out["heal_steps_s"] = heal.get("heal_steps_s")  # the slowest member per step
        out["heal_written_bytes"] = heal.get("heal_written_bytes")
        # The joiner's heap faulted in before its world formed, and the pages its receive
        # still faulted in (state/warm_heap.py).
        out["heal_warm_bytes"] = heal.get("heal_warm_bytes")
        out["heal_page_faults"] = heal.get("heal_page_faults")
        out["heal_link_gbps"] = heal.get("heal_link_gbps")  # with MECEFO_HEAL_LINK_PROBE only
        out["rejoin_build_s"] = heal.get("regroup_steps_s", {}).get("build")
    out["spurious_generations"] = spurious_generations(recs)
    if "store_spurious" in store:
        out["store_spurious_generations"] = store["store_spurious"]

    # Windows: the store's timestamps where known, else the log's lines.
    slot_pid = {(s, inc): pid for s, inc, pid in pids if s >= 0}
    dead_pid = slot_pid.get((1, 0))
    t_kill = store.get("kill_t")
    if t_kill is None and dead_pid in sampler.series:
        t_kill = sampler.series[dead_pid][-1][0]
    gens = store.get("generations", {})

    def times(g: Optional[int], key: str, pick: Any, skip: Sequence[int] = ()) -> Optional[float]:
        t = gens.get(g, {}).get("times", {})
        vals = [v[key] for s, v in t.items() if s not in skip and v.get(key)]
        return pick(vals) if vals else None

    fg, hg = roles["failure_generation"], roles["heal_generation"]
    regroup_end = times(fg, "done", max) or tail.first(f"generation {fg}: ranks")
    heal_start = times(hg, "left", min, roles["joiner"]) or tail.first(f"generation {hg} (rejoin")
    heal_end = times(hg, "done", max) or tail.first("rejoined at iteration")
    healed_t = times(hg, "healed", max) or tail.first(HEALED)
    steady_start = tail.iteration_time(min(2, kill_it - 1))
    after_it = heal["iteration"] + a.after_iterations if heal else None
    after_end = tail.iteration_time(after_it, after=healed_t or 0) if after_it else None
    after_start = (tail.iteration_time(after_it - 1, after=healed_t or 0)
                   if after_it else None)  # fmt: skip
    if after_start is not None and after_end is not None:
        # Two log lines read at once carry one stamp: the window would hold no sample. It
        # spans at least two sampling periods (into the next iteration at most).
        after_end = max(after_end, after_start + 2 * a.sample_ms / 1000)
    windows = {
        "steady": (steady_start, t_kill),
        "regroup": (t_kill, regroup_end),
        "heal": (heal_start, heal_end),
        "heal_copy": (times(hg, "constructed", min), healed_t),
        "after": (after_start, after_end),
    }
    out["windows"] = {k: [None if x is None else round(x, 3) for x in v]
                      for k, v in windows.items()}  # fmt: skip
    out["window_source"] = "store" if gens else "log"
    joiner_pids = {s: slot_pid.get((s, 1)) for s in roles["joiner"]}
    role_pids: Dict[str, List[Tuple[int, int]]] = {
        "survivor": [(slot_pid[(s, 0)], slot_pid[(s, 0)]) for s in roles["survivor"]
                     if (s, 0) in slot_pid],
        "sender": ([(slot_pid[(roles["sender"], 0)],) * 2]
                   if (roles["sender"], 0) in slot_pid else []),
        "joiner": [(p, slot_pid[(s, 0)]) for s, p in joiner_pids.items()
                   if p and (s, 0) in slot_pid],
        "bystander": [(slot_pid[(s, 0)],) * 2 for s in roles["bystander"] if (s, 0) in slot_pid],
    }  # fmt: skip
    out["memory"] = role_memory(sampler.series, role_pids, windows)
    out["peak_total_rss_bytes"] = max((v for _, v in sampler.total), default=None)
    return out


# ------------------------------------------------------------------ the matrix and the report


def summarize(runs: List[Dict[str, Any]], gloo: Dict[str, Any]) -> Dict[str, Any]:
    """Goals per run and the cross-size regroup goal per trainer and DP."""
    ref = gloo.get("reference_gbps")
    for run in runs:
        if run.get("status", "").startswith("skipped"):
            continue
        run["heal_vs_gloo"] = ratio(run.get("heal_gbps"), ref)
        # Against gloo measured right before this run: the machine's speed drifts by
        # 15% between minutes (4.1-5.3 GB/s in one session), the denominator with it.
        run["heal_vs_gloo_adjacent"] = ratio(run.get("heal_gbps"), run.get("gloo_adjacent_gbps"))
        # Against gloo's one tensor of the heal's own bytes, right before and after the run:
        # gloo's own bandwidth falls with the size (fixed costs per transfer), and drifts.
        run["heal_vs_gloo_same_size"] = ratio(run.get("heal_gbps"), run.get("gloo_same_size_gbps"))
        # With --link-probe-every-run: against gloo's one tensor between this run's own sender
        # and joiner, in the job's processes, right before the heal (state/link_probe.py).
        run["heal_vs_link"] = ratio(run.get("heal_gbps"), run.get("heal_link_gbps"))
        run["link_vs_gloo_same_size"] = ratio(
            run.get("heal_link_gbps"), run.get("gloo_same_size_gbps")
        )
        # For reference only: the transfer against gloo's one tensor into a fresh buffer (the
        # joiner's case before its warm heap, state/warm_heap.py).
        run["heal_transfer_vs_gloo_fresh"] = ratio(
            run.get("heal_transfer_gbps"), gloo.get("reference_fresh_gbps")
        )
        run["goals"] = goal_checks(run, ref)
    configs = per_config(runs)
    cross = {}
    for conf in configs:
        if conf["size_gib"] != "1.6" or conf.get("regroup_s") is None:
            continue
        base = next((c for c in configs if c["trainer"] == conf["trainer"]
                     and c["dp"] == conf["dp"] and c["size_gib"] == "0.1"
                     and c.get("regroup_s")), None)  # fmt: skip
        if base:
            rr = round(conf["regroup_s"] / base["regroup_s"], 3)
            cross[f"{conf['trainer']}_dp{conf['dp']}"] = {
                "regroup_1.6_over_0.1": rr,
                "pass": rr <= GOALS["regroup_1.6_over_0.1_max"],
            }
            conf["goals"]["regroup_1.6_over_0.1"] = rr <= GOALS["regroup_1.6_over_0.1_max"]
    return {"regroup_scaling": cross, "configs": configs}


CONFIG_MEDIANS = ("heal_s", "heal_gbps", "heal_transfer_s", "heal_vs_gloo",
                  "heal_vs_gloo_same_size", "heal_vs_gloo_adjacent", "gloo_same_size_gbps",
                  "gloo_adjacent_gbps", "heal_link_gbps", "heal_vs_link",
                  "link_vs_gloo_same_size", "regroup_s", "total_s")  # fmt: skip
"""The values of a configuration's repetitions that :func:`per_config` gives the median of."""


def per_config(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per configuration (trainer, DP, size) over its measured repetitions: the medians of
    :data:`CONFIG_MEDIANS`, the range of the same-size ratio, the largest peak and after
    ratios per role, the spurious generations of every repetition, and the goals: the heal's
    on the medians (against gloo's one tensor of the same bytes and against the run's 1 GiB
    reference), memory and spurious generations in every repetition."""
    out: List[Dict[str, Any]] = []
    keys = sorted({(r["trainer"], r["dp"], r["size_gib"]) for r in runs},
                  key=lambda k: (k[0], k[1], float(k[2])))  # fmt: skip
    for trainer, dp, size in keys:
        rows = [r for r in runs if (r["trainer"], r["dp"], r["size_gib"]) == (trainer, dp, size)]
        done = [r for r in rows if r.get("status") == "measured"]
        conf: Dict[str, Any] = {
            "trainer": trainer, "dp": dp, "size_gib": size, "runs": len(rows),
            "measured": len(done), "statuses": sorted({r.get("status", "") for r in rows}),
        }  # fmt: skip
        if not done:
            out.append(conf)
            continue
        for key in CONFIG_MEDIANS:
            vals = [r[key] for r in done if r.get(key) is not None]
            conf[key] = round(statistics.median(vals), 4) if vals else None
        same = [r["heal_vs_gloo_same_size"] for r in done if r.get("heal_vs_gloo_same_size")]
        conf["heal_vs_gloo_same_size_range"] = [min(same), max(same)] if same else None
        conf["memory"] = {}
        for role in ROLES:
            per = [r.get("memory", {}).get(role) or {} for r in done]
            if not any(m.get("pids") for m in per):
                continue
            conf["memory"][role] = {
                k: max((m[k] for m in per if m.get(k) is not None), default=None)
                for k in ("peak_ratio", "copy_peak_ratio", "after_ratio")
            }
        conf["spurious_generations"] = sum(len(r.get("spurious_generations") or []) for r in done)

        def every(goal: str, rows: List[Dict[str, Any]] = done) -> Optional[bool]:
            vals = [r.get("goals", {}).get(goal) for r in rows]
            return None if None in vals else all(vals)

        least = GOALS["heal_vs_gloo_min"]
        conf["goals"] = {
            **{g: None if conf[g] is None else conf[g] >= least for g in HEAL_RATIO_GOALS},
            **{g: every(g) for g in ("peak_sender_joiner_bystander", "survivor_regroup_peak",
                                     "after_heal", "spurious_generations")},
        }  # fmt: skip
        out.append(conf)
    return out


def summary_line(configs: List[Dict[str, Any]], gloo: Dict[str, Any]) -> str:
    """One line: per configuration (:func:`per_config`), the medians over its runs of regroup
    and heal seconds, heal GB/s and its ratios to gloo's one tensor of the same bytes (before
    and after the run) and to the run's 1 GiB reference, and the largest peak ratio."""
    parts = []
    for c in configs:
        tag = f"{c['trainer'][:3]} dp{c['dp']} {c['size_gib']}G"
        if not c["measured"]:
            parts.append(f"{tag}: {'; '.join(c['statuses'])}")
            continue
        mem = c.get("memory", {})
        peak = max((m["peak_ratio"] for m in mem.values() if m.get("peak_ratio")), default=None)
        link = f", x{c['heal_vs_link']} gloo in the job" if c.get("heal_vs_link") else ""
        parts.append(
            f"{tag} ({c['measured']}/{c['runs']} runs, medians): regroup {c.get('regroup_s')} s, "
            f"heal {c.get('heal_s')} s ({c.get('heal_gbps')} GB/s, "
            f"x{c.get('heal_vs_gloo_same_size')} gloo same bytes, x{c.get('heal_vs_gloo')} "
            f"gloo 1 GiB{link}), peak x{peak}"
        )
    return f"recovery_scale: gloo {gloo.get('reference_gbps')} GB/s (1 GiB); " + "; ".join(parts)


COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf"]  # fmt: skip
"""matplotlib's tab10, for the plot's fallback without matplotlib."""


def plot_panels(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The plot's three panels as data: per panel its title, series (label, style, points)
    and horizontal reference lines (label, y)."""
    runs = [c for c in result["cross_size"]["configs"] if c.get("measured")]  # medians
    panels: List[Dict[str, Any]] = [
        {"title": "heal bandwidth (GB/s, medians)", "series": [], "hlines": []},
        {"title": "regroup and heal (s)", "series": [], "hlines": []},
        {"title": "peak RSS / steady RSS", "series": [], "hlines": []},
    ]
    for trainer, dp in sorted({(r["trainer"], r["dp"]) for r in runs}):
        rs = sorted((r for r in runs if r["trainer"] == trainer and r["dp"] == dp),
                    key=lambda r: float(r["size_gib"]))  # fmt: skip
        label = f"{trainer} DP{dp}"

        def pts(get: Any, rs: List[Dict[str, Any]] = rs) -> List[Tuple[float, float]]:
            """(nominal size, value) of each run where ``get`` has one."""
            return [(float(r["size_gib"]), v) for r in rs if (v := get(r)) is not None]

        panels[0]["series"].append((label, "-", pts(lambda r: r.get("heal_gbps"))))
        panels[0]["series"].append((f"{label}: gloo, one tensor of the same bytes", ":",
                                    pts(lambda r: r.get("gloo_same_size_gbps"))))  # fmt: skip
        panels[1]["series"].append((f"{label} regroup", "-", pts(lambda r: r.get("regroup_s"))))
        panels[1]["series"].append((f"{label} heal", "--", pts(lambda r: r.get("heal_s"))))
        for role in ROLES:
            p = pts(lambda r, role=role: (r.get("memory", {}).get(role) or {}).get("peak_ratio"))
            if p:
                panels[2]["series"].append((f"{label} {role}", "-", p))
    ref = result["gloo"].get("reference_gbps")
    if ref:
        panels[0]["hlines"] += [("gloo send/recv, 1 GiB", ref),
                                ("goal: 0.7 x gloo", GOALS["heal_vs_gloo_min"] * ref)]  # fmt: skip
    panels[2]["hlines"] += [("goal 1.15", GOALS["peak_over_steady_max"]),
                            ("goal (survivor) 1.25",
                             GOALS["survivor_regroup_peak_over_steady_max"])]  # fmt: skip
    return panels


def plot(result: Dict[str, Any], out: Path) -> None:
    """Heal GB/s, regroup/heal seconds and peak/steady per role against the state size
    (matplotlib as ``benchmarks/plots.py``; without it, the same panels drawn with PIL)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    panels = plot_panels(result)
    title = f"Recovery at model scale ({result.get('code', '')})"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plot_pil(panels, title, out)
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, panel in zip(axes, panels, strict=True):
        for i, (label, style, pts) in enumerate(panel["series"]):
            if pts:
                ax.plot(*zip(*pts, strict=True), "o" + style, color=COLORS[i % 10], label=label)
        for (label, y), ls in zip(panel["hlines"], ("--", ":"), strict=False):
            ax.axhline(y, color="black", ls=ls, lw=1, label=label)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("state per rank (GiB, nominal)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_pil(panels: List[Dict[str, Any]], title: str, out: Path) -> None:
    """The panels of :func:`plot_panels` drawn with PIL: log2 x axis, linear y from 0."""
    import math

    from PIL import Image, ImageDraw, ImageFont

    w, h, pw = 1430, 440, 470
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    font, small = ImageFont.load_default(size=13), ImageFont.load_default(size=10)
    d.text((w // 2, 12), title, fill="black", font=font, anchor="mt")
    for k, panel in enumerate(panels):
        x0, y0, x1, y1 = k * pw + 55, 60, k * pw + pw - 15, h - 50
        d.text(((x0 + x1) // 2, 40), panel["title"], fill="black", font=font, anchor="mt")
        d.text(((x0 + x1) // 2, h - 18), "state per rank (GiB, nominal)", fill="black",
               font=small, anchor="mm")  # fmt: skip
        xs = [x for _, _, pts in panel["series"] for x, _ in pts]
        ys = [y for _, _, pts in panel["series"] for _, y in pts] + [y for _, y in panel["hlines"]]
        d.rectangle((x0, y0, x1, y1), outline="black")
        if not xs:
            d.text(((x0 + x1) // 2, (y0 + y1) // 2), "no data", fill="grey", font=font,
                   anchor="mm")  # fmt: skip
            continue
        lo, hi = math.log2(min(xs)) - 0.3, math.log2(max(xs)) + 0.3
        top = max(ys) * 1.15 or 1.0

        def at(x: float, y: float, box: Tuple[float, ...] = (x0, y0, x1, y1, lo, hi, top)
               ) -> Tuple[float, float]:  # fmt: skip
            bx0, by0, bx1, by1, blo, bhi, btop = box
            return (bx0 + (math.log2(x) - blo) / (bhi - blo) * (bx1 - bx0),
                    by1 - y / btop * (by1 - by0))  # fmt: skip

        for i in range(6):  # y grid and ticks
            yv = top * i / 5
            yy = y1 - (y1 - y0) * i / 5
            d.line((x0, yy, x1, yy), fill="#e6e6e6")
            d.text((x0 - 4, yy), f"{yv:.3g}", fill="black", font=small, anchor="rm")
        for x in sorted(set(xs)):
            xx = at(x, 0)[0]
            d.line((xx, y0, xx, y1), fill="#e6e6e6")
            d.text((xx, y1 + 4), f"{x:.2g}", fill="black", font=small, anchor="mt")
        legend = []
        for (label, y), dash in zip(panel["hlines"], (8, 3), strict=False):
            yy = at(2**lo, y)[1]
            for xx in range(x0, x1, 2 * dash):
                d.line((xx, yy, min(xx + dash, x1), yy), fill="black")
            legend.append((label, "black"))
        for i, (label, style, pts) in enumerate(panel["series"]):
            color = COLORS[i % 10]
            xy = [at(x, y) for x, y in pts]
            if len(xy) > 1:
                if style == "--":
                    for a, b in zip(xy, xy[1:], strict=False):
                        for f in range(0, 10, 2):
                            pa = (a[0] + (b[0] - a[0]) * f / 10, a[1] + (b[1] - a[1]) * f / 10)
                            pb = (a[0] + (b[0] - a[0]) * (f + 1) / 10,
                                  a[1] + (b[1] - a[1]) * (f + 1) / 10)  # fmt: skip
                            d.line((pa, pb), fill=color, width=2)
                else:
                    d.line(xy, fill=color, width=2)
            for px, py in xy:
                d.ellipse((px - 3, py - 3, px + 3, py + 3), fill=color)
            legend.append((label, color))
        for j, (label, color) in enumerate(legend):
            d.rectangle((x0 + 6, y0 + 6 + 12 * j, x0 + 14, y0 + 14 + 12 * j), fill=color)
            d.text((x0 + 18, y0 + 4 + 12 * j), label, fill="black", font=small)
    img.save(out)


def _git(args: List[str]) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _raise_on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Optional[List[str]] = None) -> None:
    """Parse the flags, measure gloo, run the matrix, write the JSON, the plot and the line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=None, help=f"default {','.join(SIZES)}")
    p.add_argument("--dps", default=None, help="default 2,4")
    p.add_argument("--trainers", default=None, help="default example,megatron-lm")
    p.add_argument(
        "--mlm-sizes",
        default="0.1,0.4",
        help="the sizes Megatron-LM runs at (of --sizes; the example trainer runs at all)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="defaults sizes 0.1,0.4, DP2, the example trainer; gloo at 256 MiB, 1 rep",
    )
    p.add_argument("--kill-iteration", type=int, default=8)
    p.add_argument(
        "--after-iterations",
        type=int,
        default=2,
        help="iterations trained past the rejoin's first one before the run ends",
    )
    p.add_argument("--max-iterations-after-kill", type=int, default=400)
    p.add_argument("--replace-after", type=float, default=1.0)
    p.add_argument("--heartbeat-timeout", type=float, default=8.0)
    p.add_argument("--collective-timeout", type=float, default=300.0)
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--sample-ms", type=float, default=50.0)
    p.add_argument(
        "--memory-limit-gib",
        type=float,
        default=14.0,
        help="skip a configuration whose estimated resident total exceeds this",
    )
    p.add_argument(
        "--memory-cap-gib",
        type=float,
        default=20.0,
        help="kill a run whose sampled total RSS exceeds this",
    )
    p.add_argument(
        "--memory-floor-gib",
        type=float,
        default=1.0,
        help="kill a run when the machine's MemAvailable falls below this",
    )
    p.add_argument(
        "--memory-headroom",
        type=float,
        default=2.0,
        help="a run starts once MemAvailable >= this x its estimated total",
    )
    p.add_argument(
        "--quiet-cores",
        type=float,
        default=0.3,
        help="a run starts once the machine is below this many busy cores ...",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=180.0,
        help="... or after this many seconds (recorded either way)",
    )
    for name, what in AB_HELP.items():
        p.add_argument(
            f"--{name}-ab",
            default="1.6",
            metavar="SIZE",
            help=f"after the matrix, the example trainer at DP2 and this size {what}, side by "
            "side; '' to skip",
        )
        p.add_argument(f"--{name}-ab-pairs", type=int, default=2)
    p.add_argument(
        "--link-probe",
        default="1.6",
        metavar="SIZE",
        help="after the matrix, the example trainer at DP2 and this size with gloo's one tensor "
        "also measured between the sender and the joiner, in the job's processes, right before "
        "the heal (MECEFO_HEAL_LINK_PROBE); '' to skip",
    )
    p.add_argument("--link-probe-runs", type=int, default=3)
    p.add_argument(
        "--link-probe-every-run",
        type=int,
        default=0,
        metavar="N",
        help="in every run of the matrix, gloo's one tensor also sent N times between the "
        "heal's sender and its joiner in the job's processes right before the heal "
        "(MECEFO_HEAL_LINK_PROBE; heal_vs_link); 0: not",
    )
    p.add_argument(
        "--adjacent-gloo-mib",
        type=int,
        default=1024,
        help="gloo's one tensor of this size measured again right before each run (its "
        "heal_vs_gloo_adjacent); 0 to skip",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=3,
        help="runs per configuration, in rounds over the matrix (a drift of the machine "
        "weighs on every configuration alike); the goals are judged on their medians",
    )
    p.add_argument(
        "--same-size-gloo-reps",
        type=int,
        default=3,
        help="gloo's one tensor of the heal's own bytes measured this many times right before "
        "and right after each run (its heal_vs_gloo_same_size); 0 to skip",
    )
    p.add_argument("--gloo-sizes-mib", default="512,1024")
    p.add_argument("--gloo-ops", default=",".join(GLOO_OPS), help=argparse.SUPPRESS)
    p.add_argument("--gloo-reps", type=int, default=3)
    p.add_argument("--megatron-lm-dir", default=None)
    p.add_argument("--output", default=str(REPO / "results" / "recovery_scale.json"))
    p.add_argument(
        "--plot",
        default=None,
        help="default: results/plots/<output's name>.png for an output in results/, else the "
        "output's path with .png (a run written elsewhere leaves the committed plot alone)",
    )
    p.add_argument("--workdir", default=str(REPO / "results" / "recovery_scale"))
    p.add_argument(
        "--code-label",
        default=None,
        help="what code this measures, for the JSON and the plot's title",
    )
    p.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gloo-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--gloo-port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    # A SIGTERM (a CI step's timeout, kill) unwinds like Ctrl-C: the runs' ``finally`` blocks
    # end their supervisors and ranks by process group, which the default action would orphan.
    signal.signal(signal.SIGTERM, _raise_on_term)
    sizes_mib = [int(x) for x in a.gloo_sizes_mib.split(",")]
    if a.gloo_worker:
        gloo_worker(a.gloo_rank, a.gloo_port, sizes_mib, a.gloo_reps, a.gloo_ops.split(","))
        return
    if a.quick:
        sizes_mib, a.gloo_reps, a.adjacent_gloo_mib, a.link_probe = [256], 1, 0, ""
        a.reps, a.same_size_gloo_reps = 1, 1
        for name in AB_MODES:
            setattr(a, _ab_key(name), "")
    checked = [(f"--{name}-ab", getattr(a, _ab_key(name))) for name in AB_MODES]
    if a.reps < 1:
        raise SystemExit(f"recovery_scale: error: --reps {a.reps}: use 1 or more")
    if a.link_probe_every_run < 0:
        raise SystemExit(f"recovery_scale: error: --link-probe-every-run "
                         f"{a.link_probe_every_run}: use 0 (no probe) or more")  # fmt: skip
    for flag, value in [*checked, ("--link-probe", a.link_probe)]:
        if value and value not in SIZES:
            raise SystemExit(
                f"recovery_scale: error: {flag} {value}: use one of {', '.join(SIZES)}, "
                "or '' to skip"
            )
    a.sizes = a.sizes or ("0.1,0.4" if a.quick else ",".join(SIZES))
    a.dps = a.dps or ("2" if a.quick else "2,4")
    a.trainers = a.trainers or ("example" if a.quick else "example,megatron-lm")
    sizes = a.sizes.split(",")
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"recovery_scale: error: --sizes {s}: use some of {', '.join(SIZES)}")
    dps = [int(x) for x in a.dps.split(",")]
    trainers = a.trainers.split(",")
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    result: Dict[str, Any] = run_header("recovery_scale")
    commit = _git(["rev-parse", "HEAD"])
    result["code"] = a.code_label or f"commit {commit[:10]}"
    result["commit"] = commit
    result["goals"] = GOALS
    config: Dict[str, Any] = {
        "sizes": {}, "dps": dps, "trainers": trainers, "kill": f"1:{a.kill_iteration}:forward",
        "replace": f"after:{a.replace_after}, --standby 1, --replace-ranks 1",
        "after_iterations": a.after_iterations, "sample_ms": a.sample_ms,
        "heartbeat_timeout_s": a.heartbeat_timeout, "collective_timeout_s": a.collective_timeout,
        "run_timeout_s": a.run_timeout, "memory_limit_gib": a.memory_limit_gib,
        "memory_cap_gib": a.memory_cap_gib, "seq_length": 32, "micro_batch_size": 1,
        "global_batch_size": "DP (one micro-batch per replica)",
        "data": "--mock-data", "state_bytes_per_parameter": STATE_BYTES_PER_PARAM,
        "heal_bytes_per_parameter_if_not_recorded": HEAL_BYTES_PER_PARAM,
        "reps": a.reps, "same_size_gloo_reps": a.same_size_gloo_reps,
        "same_size_cap_mib": SAME_SIZE_CAP_MIB, "link_probe_every_run": a.link_probe_every_run,
    }  # fmt: skip
    for s in sizes:
        layers, hidden, heads = SIZES[s]
        ex = example_params(layers, hidden)
        ml = mlm_params(layers, hidden, 32)
        config["sizes"][s] = {
            "layers": layers, "hidden": hidden, "heads": heads,
            "params": {"example": ex, "megatron-lm": ml},
            "state_bytes_per_rank": {"example": STATE_BYTES_PER_PARAM * ex,
                                     "megatron-lm": STATE_BYTES_PER_PARAM * ml},
        }  # fmt: skip
    result["config"] = config
    print(f"recovery_scale: gloo bandwidth ({sizes_mib} MiB)", flush=True)
    machine = wait_for_machine(6 * max(sizes_mib) * 1024**2, a.quiet_cores, a.quiet_wait)
    busy0, t_gloo = _busy_jiffies(), time.time()
    result["gloo"] = gloo_bandwidth(sizes_mib, a.gloo_reps, timeout=600)
    result["gloo"]["machine_before"] = machine
    a.gloo_result = result["gloo"]
    result["gloo"]["machine_cpu_cores"] = round(  # the two workers' ~2 cores and the rest
        (_busy_jiffies() - busy0) / os.sysconf("SC_CLK_TCK") / (time.time() - t_gloo), 2
    )
    print(f"recovery_scale: gloo {json.dumps(result['gloo'].get('reference_gbps'))} GB/s",
          flush=True)  # fmt: skip
    tree = None
    if "megatron-lm" in trainers:
        import recovery_latency as rl

        tree = rl.megatron_lm_tree(Path(a.workdir), a.megatron_lm_dir)
    runs: List[Dict[str, Any]] = []
    matrix = [(trainer, dp, s) for trainer in trainers for dp in dps for s in sizes
              if trainer != "megatron-lm" or s in a.mlm_sizes.split(",")]  # fmt: skip
    for rep in range(a.reps):  # rounds over the matrix
        for trainer, dp, s in matrix:
            params = config["sizes"][s]["params"][trainer]
            state_gib = STATE_BYTES_PER_PARAM * params / GIB
            est = estimated_total_gib(state_gib, dp)
            base = {"trainer": trainer, "size_gib": s, "dp": dp, "rep": rep,
                    "state_gib": round(state_gib, 3), "params": params,
                    "estimated_total_gib": round(est, 2)}  # fmt: skip
            if est > a.memory_limit_gib:
                runs.append({**base, "status": f"skipped: estimated resident total "
                             f"{est:.1f} GiB ({dp} ranks and a joiner at "
                             f"{RESIDENT_PER_STATE} x {state_gib:.2f} GiB) exceeds "
                             f"--memory-limit-gib {a.memory_limit_gib}"})  # fmt: skip
                print(f"recovery_scale: {trainer} DP{dp} {s} GiB: {runs[-1]['status']}")
                continue
            need = int(a.memory_headroom * est * GIB)
            machine = wait_for_machine(need, a.quiet_cores, a.quiet_wait)
            print(f"recovery_scale: round {rep + 1}/{a.reps}: {trainer} DP{dp} {s} GiB ... "
                  f"({machine})", flush=True)  # fmt: skip
            if not machine["memory_ok"]:
                runs.append({**base, "machine_before": machine, "status": "skipped: "
                             f"MemAvailable {machine['mem_available_gib']} GiB < "
                             f"{a.memory_headroom} x the estimated {est:.1f} GiB (other "
                             "jobs on the machine)"})  # fmt: skip
                continue
            probe = (
                {LINK_PROBE_ENV: str(a.link_probe_every_run)} if a.link_probe_every_run else None
            )
            run = {**base, "machine_before": machine,
                   **scale_run(a, trainer, s, dp, tree, tag=f"_r{rep}", env=probe)}  # fmt: skip
            runs.append(run)
            print(f"recovery_scale: {trainer} DP{dp} {s} GiB: {run['status']}; "
                  f"total {run.get('total_s')} s, regroup {run.get('regroup_s')} s, heal "
                  f"{run.get('heal_s')} s ({run.get('heal_gbps')} GB/s; gloo same bytes "
                  f"{run.get('gloo_same_size_gbps')} GB/s), memory "
                  + ", ".join(f"{k} x{v.get('peak_ratio')}/x{v.get('after_ratio')}"
                              for k, v in run.get("memory", {}).items() if v["pids"]),
                  flush=True)  # fmt: skip
            _write(result, runs, a)
    for name in AB_MODES:
        key = _ab_key(name)
        if getattr(a, key):
            pairs = getattr(a, key + "_pairs")
            result[key] = side_by_side(a, name, getattr(a, key), pairs)
            _write(result, runs, a)
    if a.link_probe:
        result["link_probe"] = link_probe(a, a.link_probe)
    _write(result, runs, a)
    print(result["summary"])


AB_KEYS = ("heal_s", "heal_gbps", "heal_vs_gloo", "gloo_adjacent_gbps", "heal_vs_gloo_adjacent",
           "gloo_same_size_gbps", "heal_vs_gloo_same_size",
           "heal_transfer_s", "heal_transfer_gbps",
           "heal_page_faults", "heal_warm_bytes", "rejoin_build_s", "rejoin_s")  # fmt: skip


def ab_order(pairs: int, a_name: str = "warm", b_name: str = "cold") -> List[str]:
    """``pairs`` pairs of runs with (``a_name``) and without (``b_name``), ABBA: a drift of the
    machine over the pairs weighs on both alike."""
    a, b = a_name, b_name
    return [a, b, b, a] * (pairs // 2) + [a, b] * (pairs % 2)


AB_MODES: Dict[str, Dict[str, Tuple[Tuple[str, ...], Dict[str, str]]]] = {
    # name (its flag --NAME-ab) -> mode -> (supervisor flags, environment); the first is "with"
    "warm-heap": {"warm": ((), {}), "cold": (("--no-warm-heap",), {})},
    "connections": {"two": ((), {"MECEFO_HEAL_CONNECTIONS": "2"}),
                    "one": ((), {"MECEFO_HEAL_CONNECTIONS": "1"})},
}  # fmt: skip
AB_HELP = {
    "warm-heap": "with the joiner's warm heap and without (--no-warm-heap)",
    "connections": "with the heal's messages dealt over two connections and over one "
    "(MECEFO_HEAL_CONNECTIONS)",
}


def _ab_key(name: str) -> str:
    """The JSON key and argparse attribute of the A/B ``name`` (``warm-heap`` ->
    ``warm_heap_ab``)."""
    return name.replace("-", "_") + "_ab"


def _side_run(a: argparse.Namespace, size: str, flags: Sequence[str], env: Dict[str, str],
              tag: str, keys: Sequence[str]) -> Dict[str, Any]:  # fmt: skip
    """One run of the example trainer at DP2 and ``size`` after the matrix (an A/B's, the
    link probe's), once the machine is quiet: ``keys`` of its measurements, its status, the
    machine before it and the joiner's peak."""
    params = example_params(*SIZES[size][:2])
    est = estimated_total_gib(STATE_BYTES_PER_PARAM * params / GIB, 2)
    machine = wait_for_machine(int(a.memory_headroom * est * GIB), a.quiet_cores, a.quiet_wait)
    run = scale_run(a, "example", size, 2, None, flags, tag=tag, env=env)
    summarize([run], a.gloo_result)
    kept = {k: run.get(k) for k in keys}
    kept["status"], kept["machine_before"] = run["status"], machine
    kept["joiner_peak_ratio"] = (run.get("memory", {}).get("joiner") or {}).get("peak_ratio")
    return kept


def _medians(
    rows: Sequence[Dict[str, Any]], keys: Sequence[str], prefix: str = ""
) -> Dict[str, Any]:
    """``{prefix}{key}_median`` of each of ``keys`` over ``rows`` (None without a value)."""
    out: Dict[str, Any] = {}
    for key in keys:
        vals = [r[key] for r in rows if r.get(key)]
        out[f"{prefix}{key}_median"] = round(statistics.median(vals), 4) if vals else None
    return out


def side_by_side(a: argparse.Namespace, name: str, size: str, pairs: int) -> Dict[str, Any]:
    """The example trainer at DP2 and ``size`` in the two modes of :data:`AB_MODES` ``name``
    (the joiner's warm heap or not; the heal over two connections or one), in the order ABBA
    (``pairs`` pairs): side by side."""
    modes = AB_MODES[name]
    first, second = modes
    order = ab_order(pairs, first, second)
    out: Dict[str, Any] = {"trainer": "example", "dp": 2, "size_gib": size, "order": order,
                           "runs": {first: [], second: []}}  # fmt: skip
    for i, mode in enumerate(order):
        flags, env = modes[mode]
        kept = _side_run(a, size, flags, env, f"_{_ab_key(name)}{i}_{mode}", AB_KEYS)
        out["runs"][mode].append(kept)
        print(f"recovery_scale: {name} A/B {i + 1}/{len(order)} ({mode}): heal "
              f"{kept['heal_s']} s, transfer {kept['heal_transfer_s']} s, page faults "
              f"{kept['heal_page_faults']}", flush=True)  # fmt: skip
    for mode in (first, second):
        out.update(_medians(out["runs"][mode], ("heal_s", "heal_vs_gloo_adjacent"), f"{mode}_"))
    w, c = out[f"{first}_heal_s_median"], out[f"{second}_heal_s_median"]
    out[f"{second}_over_{first}_heal_s"] = round(c / w, 3) if w and c else None
    return out


LINK_KEYS = AB_KEYS + ("heal_link_gbps",)
LINK_PROBE_ENV = "MECEFO_HEAL_LINK_PROBE"
"""Repetitions of the job's own gloo probe (``state/link_probe.py``'s ``ENV``)."""


def link_probe(a: argparse.Namespace, size: str) -> Dict[str, Any]:
    """The example trainer at DP2 and ``size``, ``--link-probe-runs`` times, with gloo's one
    tensor also measured in the job's own processes right before each heal
    (``MECEFO_HEAL_LINK_PROBE``, ``state/link_probe.py``): the heal against the link as those
    processes see it, beside the fresh processes' reference."""
    out: Dict[str, Any] = {"trainer": "example", "dp": 2, "size_gib": size, "probe_reps": 3,
                           "runs": []}  # fmt: skip
    for i in range(a.link_probe_runs):
        kept = _side_run(a, size, (), {LINK_PROBE_ENV: "3"}, f"_link{i}", LINK_KEYS)
        link = kept.get("heal_link_gbps")
        kept["heal_vs_link"] = ratio(kept.get("heal_gbps"), link)
        kept["link_vs_gloo_adjacent"] = ratio(link, kept.get("gloo_adjacent_gbps"))
        out["runs"].append(kept)
        print(f"recovery_scale: link probe {i + 1}/{a.link_probe_runs}: heal {kept['heal_s']} s "
              f"({kept['heal_gbps']} GB/s); gloo in the job {link} GB/s, before the run "
              f"{kept['gloo_adjacent_gbps']} GB/s", flush=True)  # fmt: skip
    out.update(_medians(out["runs"], ("heal_s", "heal_link_gbps", "gloo_adjacent_gbps",
                                      "heal_vs_link", "heal_vs_gloo_adjacent",
                                      "link_vs_gloo_adjacent")))  # fmt: skip
    return out


def _write(result: Dict[str, Any], runs: List[Dict[str, Any]], a: argparse.Namespace) -> None:
    result["runs"] = runs
    result["cross_size"] = summarize(runs, result["gloo"])
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["summary"] = summary_line(result["cross_size"]["configs"], result["gloo"])
    for name, modes in AB_MODES.items():
        ab = result.get(_ab_key(name))
        if ab:
            first, second = modes
            result["summary"] += (
                f"; {name} A/B at {ab['size_gib']} GiB DP2 (median heal s): "
                f"{ab[f'{first}_heal_s_median']} {first}, {ab[f'{second}_heal_s_median']} "
                f"{second}"
            )
    probe = result.get("link_probe")
    if probe:
        result["summary"] += (
            f"; in the job's processes (DP2 {probe['size_gib']} GiB, medians) gloo "
            f"{probe['heal_link_gbps_median']} GB/s, x{probe['link_vs_gloo_adjacent_median']} "
            f"of gloo before the run; heal x{probe['heal_vs_link_median']} of it"
        )
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=1) + "\n")
    try:
        plot(result, Path(a.plot) if a.plot else plot_path(Path(a.output)))
    except Exception as err:  # a plot is not worth the measurements
        print(f"recovery_scale: no plot: {type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main()
