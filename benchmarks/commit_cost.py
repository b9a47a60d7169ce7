"""The commit vote's cost per iteration: ``--store-mode single`` against ``--store-mode etcd``,
side by side in one run (issue 43, item 1: goal <= 1 ms p50 added at DP4), and etcd mode with
the node-level vote (``etcd_node``: ``MECEFO_NODE_VOTE=1``, :mod:`.node_vote_host`).

Configuration: two supervisors stand in for two nodes on this machine (2 ranks each, DP4, TP1
PP1), the example trainer (``examples/pretrain_gpt/pretrain_gpt.py``) with the small model of
:mod:`recovery_latency`, gloo on CPU, that benchmark's supervisor timeouts. The etcd mode runs
against a private 3-member etcd (``tests/helpers/etcd_cluster.py``, Debian's etcd-server) on
this host. ``--repeats`` pairs of failure-free runs, the two modes alternated, each
``--iters`` iterations; per run, from the ranks' ``armed_cost`` records (past the first 5
iterations of each rank):

* ``vote``: the training thread's wait for the vote's outcome (every rank, every iteration);
* ``vote_protocol``: the store round trips of the votes a rank completed (it waited for no
  peer: the protocol's own cost);
* the mean step time.

Writes JSON (``results/commit_cost.json``) and one summary line. Run it alone on the machine
(under the heavy-run lock here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
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
    _kill_pids,
)
from run_header import run_header  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "helpers"))
from etcd_cluster import EtcdCluster, etcd_missing_reason  # noqa: E402


def _pcts(values: List[float]) -> Dict[str, Any]:
    v = sorted(values)
    if not v:
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    return {
        "n": len(v),
        "p50_ms": round(1e3 * statistics.median(v), 3),
        "p99_ms": round(1e3 * v[min(len(v) - 1, int(0.99 * len(v)))], 3),
    }


def run_once(out: Path, mode: str, iters: int, data: str, etcd: Optional[str]) -> Dict[str, Any]:
    """One failure-free DP4 run on two supervisors; its vote and step times."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    records, pids = out / "records.jsonl", out / "pids.txt"
    env = dict(_env(), MECEFO_JOB_ID=f"cost-{os.getpid()}-{out.name}")
    if mode.endswith("_node"):  # the node-level vote (recovery/node_vote_host.py)
        env["MECEFO_NODE_VOTE"] = "1"
    extra = ["--store-mode", mode.removesuffix("_node")] + (["--etcd", etcd] if etcd else [])
    trainer = [*MODEL, "--train-iters", str(iters), "--data-path", data,
               "--metrics-file", str(out / "metrics.jsonl")]  # fmt: skip
    procs: List[subprocess.Popen] = []
    try:
        for node in (0, 1):
            cmd = [
                sys.executable, "-m", "megatron_mecefo.recovery.supervisor",
                "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(node),
                "--pid-file", str(pids), "--records", str(records),
                "--store-file", str(out / f"store{node}.txt"), *extra, *SUPERVISOR_TIMEOUTS,
            ]  # fmt: skip
            if node == 1:
                store = out / "store0.txt"
                deadline = time.time() + 120
                while not (store.exists() and store.read_text().strip()):
                    if time.time() > deadline:
                        raise RuntimeError(f"{store} never written")
                    time.sleep(0.05)
                cmd += ["--store", store.read_text().strip()]
            log = open(out / f"node{node}.log", "w")
            procs.append(subprocess.Popen(
                [*cmd, "--", str(TRAINER), *trainer], cwd=REPO, env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            ))  # fmt: skip
        deadline = time.time() + 900
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _kill_pids(pids)
        for p in procs:
            p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0, 0]:
        raise RuntimeError(f"{mode} run ended {codes}: {out}")
    recs = _armed_records(records, 0)
    votes = [v for r in recs for v in r["vote_s"][5:]]
    protocol = [v for r in recs for v in r["vote_protocol_s"][5:]]
    steps = [v for r in recs for v in r["step_time_s"][5:]]
    return {
        "mode": mode,
        "iterations": iters,
        "vote": _pcts(votes),
        "vote_protocol": _pcts(protocol),
        "step_ms_mean": round(1e3 * statistics.fmean(steps), 2),
        "loadavg_after": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument(
        "--modes", default="single,etcd,etcd_node",
        help="store modes; a _node suffix votes per node (MECEFO_NODE_VOTE=1)",
    )  # fmt: skip
    p.add_argument("--data-path", default=str(REPO / "data" / "stdlib_text_document"))
    p.add_argument("--work-dir", default=str(REPO / "results" / "logs" / "commit_cost"))
    p.add_argument("--output", default=str(REPO / "results" / "commit_cost.json"))
    a = p.parse_args()
    modes = a.modes.split(",")
    if etcd_missing_reason() is not None:
        raise SystemExit(f"commit_cost: {etcd_missing_reason()}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result: Dict[str, Any] = {
        **run_header("commit_cost"),
        "config": {
            "layout": "DP4 (TP1 PP1) on two supervisors of 2 ranks each, one host",
            "trainer": "examples/pretrain_gpt/pretrain_gpt.py, gloo on CPU",
            "model": MODEL,
            "supervisor_timeouts": SUPERVISOR_TIMEOUTS,
            "etcd": "3 members on 127.0.0.1 (tests/helpers/etcd_cluster.py)",
            "iterations": a.iters,
            "repeats": a.repeats,
            "modes": modes,
            "skipped": "the first 5 iterations of each rank",
        },
        "runs": [],
    }
    work = Path(a.work_dir)
    cluster = EtcdCluster(Path(tempfile.mkdtemp(prefix="etcd-cost-"))).start()
    try:
        for r in range(a.repeats):
            for mode in modes:
                etcd = ",".join(cluster.endpoints) if mode.startswith("etcd") else None
                try:
                    row = run_once(work / f"{mode}{r}", mode, a.iters, a.data_path, etcd)
                except RuntimeError as err:  # recorded; the other runs go on
                    row = {"mode": mode, "error": str(err)}
                result["runs"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        cluster.stop()
    summary: Dict[str, Any] = {}
    med = statistics.median
    for mode in modes:
        rows = [x for x in result["runs"] if x["mode"] == mode and "error" not in x]
        for part in ("vote", "vote_protocol"):
            for q in ("p50_ms", "p99_ms"):
                got = [x[part][q] for x in rows if x[part][q] is not None]
                summary[f"{mode}_{part}_{q}"] = round(med(got), 3) if got else None
        steps = [x["step_ms_mean"] for x in rows]
        summary[f"{mode}_step_ms_mean"] = round(med(steps), 2) if steps else None
    if summary.get("etcd_vote_p50_ms") is not None and summary.get("single_vote_p50_ms"):
        added = summary["etcd_vote_p50_ms"] - summary["single_vote_p50_ms"]
        summary["added_vote_p50_ms"] = round(added, 3)
    result["summary"] = summary
    result["machine"]["loadavg_end"] = os.getloadavg()
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=1))
    s = summary
    if "etcd_node_vote_p50_ms" in s:
        print(
            f"node vote (etcd): vote p50/p99 {s['etcd_node_vote_p50_ms']}/"
            f"{s['etcd_node_vote_p99_ms']} ms, step {s['etcd_node_step_ms_mean']} ms"
        )
    print(f"commit cost (DP4, {a.repeats}x{a.iters} it, load {os.getloadavg()[0]:.1f}): {s}")
    print(f"commit_cost: wrote {a.output}")


if __name__ == "__main__":
    main()
