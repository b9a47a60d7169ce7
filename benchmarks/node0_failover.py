"""Losing node 0, the leader, under ``--store-mode etcd``: kill -> takeover -> redone, and
the etcd mode's cost without failures.

Configuration: two supervisors stand in for two nodes on this machine (2 ranks each, DP4,
TP1 PP1), the example trainer (``examples/pretrain_gpt/pretrain_gpt.py``) with the small model
of :mod:`recovery_latency` (:data:`recovery_latency.MODEL`), gloo on CPU, the supervisors'
timeouts of that benchmark (heartbeat 1 s / 10 s, collective backstop 30 s) unless
``--heartbeat-timeout`` says otherwise; a private 3-member etcd on 127.0.0.1
(``tests/helpers/etcd_cluster.py``, Debian's etcd-server), one for the whole run (each job
under its own prefix, ``MECEFO_JOB_ID``).

1. ``--trials`` runs: once training runs, the benchmark SIGKILLs node 0's supervisor (the
   leader: its hot store and coordinator die with it) and its two ranks, at a seeded random
   moment (after iteration 10-30 and a random 0-200 ms). The clock starts at the benchmark's
   ``time.time()`` just before the kill; the takeover time is the new leader's own stamp
   (``primary`` key of its store), and *redone* is the latest member's ``done`` stamp of the
   failure generation (``rt/<g>/<slot>``, read through etcd from the new leader's store).
   The leader's lease is the heartbeat timeout, but a SIGKILL is a certain death (its store's
   port refuses connections): node 1 revokes the lease at once (``cause`` "revoked" in each
   trial; "expired" when the takeover waited for the TTL).
2. ``--overhead-repeats`` pairs of failure-free runs, ``--store-mode single`` and ``etcd``
   alternated: the commit vote's wait and protocol time per iteration and the step time,
   from the ranks' ``armed_cost`` records.

Usage: ``.venv/bin/python benchmarks/node0_failover.py [--trials 10] [--overhead-repeats 3]``
(under the heavy-run lock here); writes ``results/node0_failover.json`` and one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery_latency import (  # noqa: E402
    MODEL,
    REPO,
    SUPERVISOR_TIMEOUTS,
    TRAINER,
    _armed_records,
    _env,
    _git_commit,
    _kill_pids,
)

sys.path.insert(0, str(REPO / "tests" / "helpers"))
from etcd_cluster import EtcdCluster  # noqa: E402

from megatron_mecefo.recovery.membership import MembershipStore  # noqa: E402
from megatron_mecefo.recovery.store_forwarding import PRIMARY_KEY  # noqa: E402


class TwoNodes:
    """Two supervisors of 2 ranks each (DP4), ended by PID in :meth:`stop`."""

    def __init__(
        self, out: Path, mode: str, iters: int, data: str, etcd: List[str], timeouts: List[str]
    ) -> None:
        self.out, self.mode, self.etcd, self.timeouts = out, mode, etcd, timeouts
        shutil.rmtree(out, ignore_errors=True)  # a stale store file would name a dead store
        out.mkdir(parents=True)
        self.pid_file = out / "pids.txt"
        self.records = out / "records.jsonl"
        self.procs: List[subprocess.Popen] = []
        self.args = [
            *MODEL, "--train-iters", str(iters), "--data-path", data, "--log-interval", "1",
            "--metrics-file", str(out / "metrics.jsonl"),
        ]  # fmt: skip

    def start(self) -> TwoNodes:
        for node in (0, 1):
            cmd = [
                sys.executable, "-m", "megatron_mecefo.recovery.supervisor",
                "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(node),
                "--pid-file", str(self.pid_file), "--records", str(self.records),
                "--store-mode", self.mode, "--store-file", str(self.out / f"store{node}.txt"),
                *self.timeouts,
            ]  # fmt: skip
            if self.mode == "etcd":
                cmd += ["--etcd", ",".join(self.etcd)]
            if node == 1:
                cmd += ["--store", self._wait_file(self.out / "store0.txt")]
            log = open(self.out / f"node{node}.log", "w")
            self.procs.append(
                subprocess.Popen(
                    [*cmd, "--", str(TRAINER), *self.args], cwd=REPO,
                    env=dict(_env(), MECEFO_JOB_ID=f"node0_failover/{self.out.name}"), stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            )
        return self

    @staticmethod
    def _wait_file(path: Path, timeout: float = 120) -> str:
        deadline = time.time() + timeout
        while not (path.exists() and path.read_text().strip()):
            if time.time() > deadline:
                raise RuntimeError(f"{path} never written")
            time.sleep(0.05)
        return path.read_text().strip()

    def iteration(self) -> int:
        """The last iteration in the metrics file (0 before the first)."""
        path = self.out / "metrics.jsonl"
        last = 0
        if path.exists():
            for line in path.read_text().splitlines():
                if '"type": "train"' in line or '"type":"train"' in line:
                    last = max(last, json.loads(line)["iteration"])
        return last

    def kill_node0(self) -> float:
        """SIGKILL node 0's supervisor and its ranks; the time just before the kill."""
        ranks = []
        for line in self.pid_file.read_text().splitlines():
            slot, _, pid = (int(x) for x in line.split())
            if slot < 2:
                ranks.append(pid)
        t_kill = time.time()
        os.killpg(self.procs[0].pid, signal.SIGKILL)
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return t_kill

    def wait(self, timeout: float) -> List[Optional[int]]:
        deadline = time.time() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _kill_pids(self.pid_file)
        for p in self.procs:
            p.wait()


def failover_trial(
    out: Path, data: str, rng: random.Random, etcd: List[str], timeouts: List[str]
) -> Dict[str, Any]:
    """One node-0 loss: kill -> takeover -> every survivor redone (see the module doc)."""
    job = TwoNodes(out, "etcd", 100_000, data, etcd, timeouts).start()
    try:
        after = rng.randint(10, 30)
        deadline = time.time() + 300
        while job.iteration() < after:
            if time.time() > deadline or any(p.poll() is not None for p in job.procs):
                raise RuntimeError(f"never reached iteration {after}: {out}")
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.2))
        store = job._wait_file(out / "store1.txt")  # the job's etcd:// address
        t_kill = job.kill_node0()
        ms = MembershipStore.connect(store, 120)  # follows hot_store to the new leader
        deadline_takeover = time.time() + 120
        while ms.get_str(PRIMARY_KEY) is None:
            if time.time() > deadline_takeover:
                raise RuntimeError(f"no takeover within 120 s: {out}")
            time.sleep(0.05)
        takeover = json.loads(ms.get_str(PRIMARY_KEY))
        g = takeover["generation"] + 1  # the failure generation the new leader publishes
        ms.wait_for(f"record/{g}", 120)
        gen = ms.generation(g)
        times = {s: ms.get_json(f"rt/{g}/{s}") or {} for s in gen.members}
        record = ms.get_json(f"record/{g}")
        done = max(t.get("done", 0.0) for t in times.values())
        detect = max(t.get("detect", 0.0) for t in times.values())
        result = {
            "killed_after_iteration": after,
            "takeover_s": round(takeover["t"] - t_kill, 3),
            "detect_s": round(detect - t_kill, 3) if detect else None,
            "redone_s": round(done - t_kill, 3),
            "lost": list(gen.lost),
            "replicas": list(gen.replicas),
            "redone_iteration": record.get("iteration"),
            "term": takeover["term"],
            "cause": takeover.get("cause"),
        }
        # Training goes on past the redone iteration.
        target = job.iteration() + 3
        while job.iteration() < target and time.time() < deadline:
            time.sleep(0.05)
        result["trained_on"] = job.iteration() >= target
        return result
    finally:
        job.stop()


def overhead_run(
    out: Path, data: str, mode: str, iters: int, etcd: List[str], timeouts: List[str]
) -> Dict[str, Any]:
    """A failure-free run: the ranks' commit-vote and step times (``armed_cost`` records)."""
    job = TwoNodes(out, mode, iters, data, etcd, timeouts).start()
    try:
        codes = job.wait(600)
    finally:
        job.stop()
    if codes != [0, 0]:
        raise RuntimeError(f"{mode} run ended {codes}: {out}")
    recs = _armed_records(job.records, 0)
    votes = [v for r in recs for v in r["vote_s"][5:]]  # past the first iterations' warm-up
    protocol = [v for r in recs for v in r["vote_protocol_s"][5:]]
    steps = [v for r in recs for v in r["step_time_s"][5:]]
    return {
        "mode": mode,
        "vote_ms_p50": round(1000 * statistics.median(votes), 3),
        "vote_protocol_ms_p50": round(1000 * statistics.median(protocol), 3),
        "step_ms_mean": round(1000 * statistics.fmean(steps), 2),
        "iterations": iters,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--overhead-repeats", type=int, default=3)
    p.add_argument("--overhead-iters", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help="the supervisors' --heartbeat-timeout (the leader's lease TTL)",
    )
    p.add_argument("--data-path", default=str(REPO / "data" / "stdlib_text_document"))
    p.add_argument("--work-dir", default=str(REPO / "results" / "logs" / "node0_failover"))
    p.add_argument("--output", default=str(REPO / "results" / "node0_failover.json"))
    a = p.parse_args()
    if not Path(a.data_path + ".bin").exists():
        raise SystemExit(f"--data-path {a.data_path}: no .bin/.idx there; run `make data` first")
    work = Path(a.work_dir)
    timeouts = list(SUPERVISOR_TIMEOUTS)
    if a.heartbeat_timeout is not None:
        timeouts[timeouts.index("--heartbeat-timeout") + 1] = f"{a.heartbeat_timeout:g}"
    rng = random.Random(a.seed)
    t0 = time.time()
    trials: List[Dict[str, Any]] = []
    overhead: List[Dict[str, Any]] = []
    etcd = EtcdCluster(work / "etcd")
    try:
        shutil.rmtree(work / "etcd", ignore_errors=True)
        etcd.start()
        for i in range(a.trials):
            trials.append(
                failover_trial(work / f"trial{i}", a.data_path, rng, etcd.endpoints, timeouts)
            )
            print(f"trial {i}: {trials[-1]}", flush=True)
        for r in range(a.overhead_repeats):
            for mode in ("single", "etcd"):
                run = overhead_run(
                    work / f"{mode}{r}", a.data_path, mode, a.overhead_iters, etcd.endpoints,
                    timeouts,
                )  # fmt: skip
                overhead.append(run)
                print(f"overhead {mode} {r}: {overhead[-1]}", flush=True)
    finally:
        etcd.stop()

    def med(key: str, rows: List[Dict[str, Any]]) -> Optional[float]:
        values = [row[key] for row in rows if row.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    summary = {
        "trials": len(trials),
        "trained_on": sum(t["trained_on"] for t in trials),
        **{f"{k}_p50": med(k, trials) for k in ("takeover_s", "detect_s", "redone_s")},
        "redone_s_max": max((t["redone_s"] for t in trials), default=None),
    }
    for mode in ("single", "etcd"):
        rows = [o for o in overhead if o["mode"] == mode]
        for key in ("vote_ms_p50", "vote_protocol_ms_p50", "step_ms_mean"):
            summary[f"{mode}_{key}"] = med(key, rows)
    result = {
        "benchmark": "node0_failover",
        "config": {
            "layout": "2 supervisors (nodes) x 2 ranks, DP4, TP1 PP1, gloo, CPU, --store-mode "
            "etcd on a 3-member etcd (127.0.0.1)",
            "model": MODEL, "supervisor_timeouts": timeouts, "seed": a.seed,
            "overhead_iters": a.overhead_iters, "machine": f"{os.cpu_count()} CPUs, "
            f"{platform.platform()}", "commit": _git_commit(),
            "load_average_start": os.getloadavg(),
        },  # fmt: skip
        "trials": trials,
        "overhead": overhead,
        "summary": summary,
        "wall_s": round(time.time() - t0, 1),
    }
    Path(a.output).write_text(json.dumps(result, indent=1) + "\n")
    s = summary
    print(
        f"node0_failover: {s['trained_on']}/{s['trials']} node-0 losses trained on; kill -> "
        f"takeover p50 {s['takeover_s_p50']} s, kill -> redone p50 {s['redone_s_p50']} s, max "
        f"{s['redone_s_max']} s; vote p50 single {s['single_vote_ms_p50']} ms vs etcd "
        f"{s['etcd_vote_ms_p50']} ms; step mean {s['single_step_ms_mean']} vs "
        f"{s['etcd_step_ms_mean']} ms (config: {result['config']['layout']})"
    )


if __name__ == "__main__":
    main()
