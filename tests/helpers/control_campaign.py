"""A randomized campaign against the etcd control plane, on real processes.

One run: four supervisors (one rank each, PP2 x DP2, ``--vote-group-size 2``: groups {0, 1}
and {2, 3}, heads 0 and 2, so the two-level vote is in use), each node in a network namespace
of its own (tests/helpers/netns.py), a private three-member etcd on the bridge's address, and
one fault drawn from a seeded plan:

* ``kill``: every process of a node SIGKILLed (a lost machine);
* ``stop``: every process of a node SIGSTOPped for the rest of the run (a frozen machine);
* ``stop-resume``: SIGSTOPped for a few seconds, then SIGCONT (a long pause; under the lease
  TTL it may cost nothing);
* ``cut``: the node's link cut for the rest of the run (a lost network);
* ``cut-restore``: cut, then restored after a few seconds;
* ``after-claim``, ``after-hot-vote`` (:data:`POINTS`; not drawn by :func:`plan`): the node
  kills itself at that point of the commit vote, at the fault's iteration or the first later
  one where it gets there (``fault_injection.die_at``): its commit claimed on etcd but not yet
  announced, or (a group head) its group's vote counted on the hot store but not yet told to
  its group. No signal from outside hits these reliably; they leave members in doubt.

The node (group heads and the leader, node 0, included) and the moment (an iteration, then a
delay inside it) are drawn too. The invariants, checked on every run:

* the run ends (every node's supervisor exits) within :data:`END_BOUND_S` of the fault: no
  hang;
* every sample of every iteration processed exactly once (:func:`check_every_sample_once`);
* the replicas equal to each other (Megatron's weight-hash check every iteration) and the
  survivors' parameters equal to the simulated run of the same losses (the trainer under
  torchrun with ``--mecefo-fail`` at each failure record's iteration);
* no ``ShardLost``: one fault never loses a whole stage (each stage has two nodes);
* a node that was not lost exits 0.

:func:`plan` is seeded and :func:`run_one` returns the run's record (fault, outcome,
violations); ``benchmarks/control_campaign.py`` runs many and writes the table.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from etcd_cluster import EtcdCluster
from harness import (
    SMALL_MODEL,
    Job,
    check_every_sample_once,
    max_param_diff,
    run_torchrun,
    train_records,
)
from netns import Netns, supervisor_launcher

from megatron_mecefo.recovery.fault_injection import DIE_AT_ENV, DIE_POINTS

KINDS = ("kill", "stop", "stop-resume", "cut", "cut-restore")
POINTS = DIE_POINTS
"""Fault kinds that are points of the vote (``fault_injection.die_at``)."""
NODES = 4
ITERS = 24
GBS = 16
HB = 4.0
"""``--heartbeat-timeout``; the etcd lease TTL is at least 10 s (``lease_ttl_s``)."""
END_BOUND_S = 240.0
"""From the fault to the end of every supervisor: the lease TTL (10 s), the regroup, the
degraded steps left and a cold simulated twin's worth of slack at a load of 15."""
PARAM_ATOL = 2e-5  # as test_etcd_partition: fp32 reassociation over the survivors' all-reduce


@dataclass
class Fault:
    """One run's fault."""

    kind: str
    """One of :data:`KINDS` or :data:`POINTS`."""
    node: int
    """The node it hits (0: the etcd leader and group 0's head; 2: group 1's head)."""
    iteration: int
    """The iteration printed before the fault."""
    delay_s: float
    """Seconds after that iteration's line."""
    hold_s: float
    """``stop-resume`` / ``cut-restore``: seconds until SIGCONT / the link's restore."""


def plan(seed: int, runs: int) -> List[Fault]:
    """``runs`` faults drawn from ``seed`` (every kind and node equally likely)."""
    rng = random.Random(seed)
    return [
        Fault(
            kind=rng.choice(KINDS),
            node=rng.randrange(NODES),
            iteration=rng.randrange(4, ITERS - 10),
            delay_s=round(rng.uniform(0.0, 0.5), 3),
            hold_s=round(rng.uniform(1.0, 15.0), 2),
        )
        for _ in range(runs)
    ]


def trainer_args(data_path: str) -> List[str]:
    """PP2 x DP2 over four one-rank nodes; SGD keeps fp32 rounding at rounding size, and no
    clipping, which would hide an error in the gradient's scale."""
    return SMALL_MODEL + [
        "--pipeline-model-parallel-size", "2", "--global-batch-size", str(GBS),
        "--train-iters", str(ITERS), "--mecefo", "--data-path", data_path,
        "--check-weight-hash-across-dp-replicas-interval", "1",
        "--optimizer", "sgd", "--lr", "0.05", "--clip-grad", "0",
    ]  # fmt: skip


def _signal_node(net: Netns, node: int, sig: int) -> List[int]:
    """``sig`` to every process of node ``node`` (its namespace's PIDs)."""
    pids = net.pids(node)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def _last_iteration(job: Job) -> int:
    return max((r["iteration"] for r in job.records_of("train")), default=0)


def run_one(workdir: Path, fault: Fault, data_path: str, tag: str) -> Dict[str, Any]:
    """One run with ``fault``; returns its record: the fault, what happened, the violations."""
    workdir.mkdir(parents=True, exist_ok=True)
    violations: List[str] = []
    out: Dict[str, Any] = {"fault": asdict(fault), "violations": violations}
    net = Netns(NODES, tag=tag).setup()
    cluster: Optional[EtcdCluster] = None
    job: Optional[Job] = None
    stopped: List[int] = []
    try:
        cluster = EtcdCluster(workdir / "etcd", net.host_address).start()
        supervisor = ["--store-mode", "etcd", "--etcd", ",".join(cluster.endpoints),
                      "--heartbeat-timeout", str(HB), "--vote-group-size", "2"]  # fmt: skip
        args = trainer_args(data_path)
        point = {fault.node: {DIE_AT_ENV: f"{fault.kind}:{fault.iteration}"}}
        launch = supervisor_launcher(net, point if fault.kind in POINTS else None)
        job = Job(workdir / "real", 1, args, nnodes=NODES, supervisor_args=supervisor,
                  launch=launch, MECEFO_TEST_STEP_SLEEP="0.1",
                  MECEFO_JOB_ID=f"campaign{tag}")  # fmt: skip
        job.start()
        deadline = time.monotonic() + 300
        while _last_iteration(job) < fault.iteration:
            if time.monotonic() > deadline or all(p.poll() is not None for p in job.procs):
                violations.append(f"never reached iteration {fault.iteration} (no fault made)")
                return out
            time.sleep(0.05)
        time.sleep(fault.delay_s)
        t_fault = time.monotonic()
        if fault.kind in ("none", *POINTS):  # no fault, or the node's own at its point
            pass
        elif fault.kind == "kill":
            _signal_node(net, fault.node, signal.SIGKILL)
        elif fault.kind in ("stop", "stop-resume"):
            stopped = _signal_node(net, fault.node, signal.SIGSTOP)
        else:
            net.cut(fault.node)
        held = fault.kind in ("stop-resume", "cut-restore")
        released = False
        while any(p.poll() is None for i, p in enumerate(job.procs) if not _frozen(fault, i)):
            now = time.monotonic() - t_fault
            if held and not released and now >= fault.hold_s:
                if fault.kind == "stop-resume":
                    _signal_node(net, fault.node, signal.SIGCONT)
                    stopped = []
                else:
                    net.restore(fault.node)
                released = True
            if now > END_BOUND_S:
                violations.append(f"hang: supervisors still running {END_BOUND_S:.0f} s after")
                return out
            time.sleep(0.1)
        out["end_s"] = round(time.monotonic() - t_fault, 2)
        rcs = [p.returncode for p in job.procs]
        out["exit_codes"] = rcs
        _check(job, fault, rcs, workdir, args, out)
    except Exception:  # a check's own crash is a violation of the run, reported with its trace
        violations.append("error: " + traceback.format_exc(limit=3)[-600:])
    finally:
        if stopped:
            _signal_node(net, fault.node, signal.SIGCONT)
        if job is not None:
            job.stop()
        net.teardown()
        if cluster is not None:
            cluster.stop()
    return out


def _frozen(fault: Fault, node: int) -> bool:
    """A node that stays SIGSTOPped to the end never exits by itself (it is killed after)."""
    return fault.kind == "stop" and node == fault.node


def _check(
    job: Job, fault: Fault, rcs: List[Optional[int]], workdir: Path, args: List[str],
    out: Dict[str, Any],
) -> None:  # fmt: skip
    violations: List[str] = out["violations"]
    log = job.log()
    out["in_doubt"] = re.findall(r"in doubt on \d+ rank\(s\), was (committed|aborted)", log)
    if "ShardLost" in log:
        violations.append("ShardLost with one fault (no stage was lost)")
    failures = [r for r in job.records_of("recovery") if r.get("ranks_lost")]
    lost = sorted({rank for r in failures for rank in r["ranks_lost"]})
    out["ranks_lost"] = lost
    out["generations"] = len(job.records_of("recovery"))
    if lost and lost != [fault.node]:
        violations.append(f"ranks lost {lost}; the fault hit node {fault.node} (rank {fault.node})")
    if not lost and fault.kind in ("kill", "stop", "cut", *POINTS):
        violations.append(f"a {fault.kind} of node {fault.node} lost no rank")
    for node, rc in enumerate(rcs):
        if node not in lost and rc != 0:
            violations.append(f"node {node} (not lost) exited {rc}")
    try:
        check_every_sample_once(train_records(job.metrics), ITERS, GBS, 2)
    except AssertionError as e:
        violations.append(f"samples: {str(e)[:300]}")
    if not all(c["identical"] for c in job.records_of("dp_weight_check")):
        violations.append("replicas differ (dp weight-hash check)")
    real = job.params()
    # The simulated run drops a whole replica (its stage siblings wait as spares, orphan=wait)
    # at the failure's iteration: --mecefo-fail takes REPLICA:ITERATION.
    fails, live = [], {0, 1}
    for r in failures:
        for replica in sorted(live - set(r["replicas"])):
            fails += ["--mecefo-fail", f"{replica}:{r['iteration']}"]
        live &= set(r["replicas"])
    out["simulated"] = fails
    sim = run_torchrun(workdir / "sim", NODES, args + fails)
    diff = max_param_diff(real, sim)
    out["param_diff"] = diff
    if diff > PARAM_ATOL:
        violations.append(f"parameters differ from the simulated twin by {diff:.2e}")
