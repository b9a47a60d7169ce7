"""Real rank deaths inside Megatron-LM's own ``pretrain_gpt.py``, survived in-process.

Megatron-LM core_v0.16.1 (``mlm_runs``) runs under MeCeFO's recovery supervisor; ranks are
SIGKILLed at a phase of an iteration (``--mecefo-kill``) or from outside. Each run is checked
against the simulated-failure run of the same schedule under torchrun (``--mecefo-fail``):
the final parameters of the ``--save`` checkpoint, every sample processed once, no checkpoint
read. ``make test`` runs four: ``--mecefo`` without failures against stock Megatron-LM, one
simulated failure (the reference) and one real SIGKILL, and a SIGTERM (Slurm's ``--signal``)
that saves and resumes; the rest are ``slow``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator, List

import pytest
from etcd_cluster import EtcdCluster, running_cluster
from mlm_runs import MECEFO, final_params, max_difference, supervised, supervised_nodes, torchrun
from mlm_runs import check_against_simulated as _check_against_simulated
from mlm_runs import recovery_records as _records


@pytest.fixture()
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A private 3-member etcd for the ``--store-mode etcd`` case (skipped without etcd)."""
    yield from running_cluster(tmp_path / "etcd")


def test_mecefo_without_failure_is_bitwise_stock(megatron_lm: Path, tmp_path: Path) -> None:
    argv = ["--train-iters", "6"]
    rc, stock = torchrun(megatron_lm, [*argv, "--save", str(tmp_path / "stock")], tmp_path)
    assert rc == 0, stock[-4000:]
    rc, plugin = torchrun(
        megatron_lm, [*argv, *MECEFO, "--save", str(tmp_path / "mecefo")], tmp_path
    )
    assert rc == 0, plugin[-4000:]
    assert "MeCeFO summary: 0 degraded iterations" in plugin
    assert max_difference(final_params(tmp_path / "stock"), final_params(tmp_path / "mecefo")) == 0


def test_real_sigkill_survived_in_process_equals_simulated(
    megatron_lm: Path, tmp_path: Path
) -> None:
    """DP4: rank 1 is SIGKILLed in its backward of iteration 3; the survivors regroup, re-enter
    pretrain() with the state in memory and redo iteration 3 without replica 1."""
    argv = ["--train-iters", "8"]
    save = tmp_path / "real"
    rc, real = supervised(
        megatron_lm, [*argv, *MECEFO, "--mecefo-kill", "1:3:backward", "--save", str(save)],
        tmp_path,
    )  # fmt: skip
    assert rc == 0, real[-6000:]
    assert "pretrain() re-entered in generation 1; no checkpoint read" in real
    assert "loading checkpoint" not in real
    (record,) = _records(tmp_path)
    assert record["ranks_lost"] == [1] and record["samples_redone"] == 16
    assert record["iteration"] == 3 and record["kind"] == "failure"
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert schedule == ["1:3"]


@pytest.mark.slow  # the example trainer's twin is in make test
@pytest.mark.parametrize("second", ["world", "groups"])
def test_second_death_while_the_world_is_built(
    megatron_lm: Path, tmp_path: Path, second: str
) -> None:
    """DP4: rank 1 dies in iteration 3; rank 3 dies while the survivors build the next world
    (before init_process_group, or before pretrain() builds Megatron's groups). The others
    leave that rendezvous when the next generation is published, not at the store timeout,
    and redo iteration 3 without replicas 1 and 3."""
    argv = ["--train-iters", "8"]
    save = tmp_path / "real"
    kills = ["--mecefo-kill", "1:3:backward", "--mecefo-kill", f"3:3:{second}"]
    rc, real = supervised(megatron_lm, [*argv, *MECEFO, *kills, "--save", str(save)], tmp_path)
    assert rc == 0, real[-6000:]
    assert "wait timeout" not in real and "loading checkpoint" not in real, real[-6000:]
    records = _records(tmp_path)
    # Generation 1 (rank 1 lost) never redid its iteration: one record, of generation 2.
    assert [(r["ranks_lost"], r["iteration"]) for r in records] == [([3], 3)], records
    # The store timeout is 30 s: a rank left in the rendezvous would take that long.
    assert records[0]["total_s"] is not None and records[0]["total_s"] < 10, records
    print(f"second death at {second}: kill -> redone {records[0]['total_s']:.2f} s")
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert sorted(schedule) == ["1:3", "3:3"], schedule


# About 45 s (a save, a restart, a load): make test-all, to keep .ci/run within 35 min.
@pytest.mark.slow
def test_sigterm_saves_and_the_run_resumes_there(megatron_lm: Path, tmp_path: Path) -> None:
    """Slurm's ``--signal`` before the time limit: the supervisor passes SIGTERM to the ranks,
    Megatron-LM's ``--exit-signal-handler`` saves at the next iteration boundary and every
    process exits 0 (not a failure to recover); started again with ``--load``, the run resumes
    at that iteration and ends on the parameters of the uninterrupted run."""
    argv = ["--train-iters", "12"]
    save = tmp_path / "ckpt"
    flags = [*argv, *MECEFO, "--exit-signal-handler", "--save", str(save), "--load", str(save)]

    def stop(proc: subprocess.Popen, log_path: Path) -> None:
        _wait_for(log_path, "iteration        3/")
        proc.send_signal(signal.SIGTERM)

    rc, first = supervised(megatron_lm, flags, tmp_path, act=stop)
    assert rc == 0, first[-6000:]
    assert "exiting program after receiving SIGTERM" in first
    assert "ranks saved and exited (--exit-signal-handler)" in first
    assert "Traceback" not in first and not _records(tmp_path), first[-6000:]
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 12, saved
    rc, second = supervised(megatron_lm, flags, tmp_path)
    assert rc == 0, second[-6000:]
    assert f"successfully loaded checkpoint from {save} " in second, second[-6000:]
    assert f"at iteration {saved}" in second
    assert "iteration       12/      12" in second
    rc, ref = torchrun(megatron_lm, [*argv, *MECEFO, "--save", str(tmp_path / "ref")], tmp_path)
    assert rc == 0, ref[-4000:]
    diff = max_difference(final_params(save), final_params(tmp_path / "ref"))
    print(f"stopped at {saved}, resumed, against uninterrupted: max |difference| {diff:.3g}")
    assert diff == 0


PHASE_KILLS = {  # phase -> (kill, the replica's first failed iteration)
    "forward": ("2:3:forward", 3),
    "backward": ("2:3:backward", 3),
    "grad-sync": ("2:3:grad-sync", 3),
    "optimizer": ("2:3:optimizer", 4),  # the vote passed: iteration 3 commits without it
    "between": ("2:3:between", 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(PHASE_KILLS))
@pytest.mark.parametrize("layout", ["dp4", "pp2dp4"])
def test_kill_in_every_phase(megatron_lm: Path, tmp_path: Path, phase: str, layout: str) -> None:
    kill, first = PHASE_KILLS[phase]
    argv = ["--train-iters", "6"]
    nproc = 4
    if layout == "pp2dp4":  # 8 ranks; rank 6 is replica 2's last stage
        argv += ["--num-layers", "4", "--pipeline-model-parallel-size", "2"]
        kill, nproc = kill.replace("2:", "6:", 1), 8
    save = tmp_path / "real"
    rc, real = supervised(
        megatron_lm, [*argv, *MECEFO, "--mecefo-kill", kill, "--save", str(save)], tmp_path,
        nproc=nproc,
    )  # fmt: skip
    assert rc == 0, real[-6000:]
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv, nproc)
    assert schedule == [f"2:{first}"]


@pytest.mark.slow
def test_rejoin_heals_the_replacement(megatron_lm: Path, tmp_path: Path) -> None:
    """Rank 0 dies at the grad sync of iteration 4; a warm standby replaces it a second later,
    rejoins at an iteration boundary and is healed from a peer: Megatron-LM's own weight-hash
    check then finds every replica identical."""
    argv = ["--train-iters", "40", "--check-weight-hash-across-dp-replicas-interval", "5"]
    save = tmp_path / "real"
    rc, real = supervised(
        megatron_lm, [*argv, *MECEFO, "--mecefo-kill", "0:4:grad-sync", "--save", str(save)],
        tmp_path, supervisor=["--replace", "after:1", "--standby", "1"],
    )  # fmt: skip
    assert rc == 0, real[-6000:]
    assert "healed; parameters and optimizer state identical on every data-parallel" in real
    assert "Weight hashes match after 40 iterations" in real
    assert "do not match" not in real
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert len(schedule) == 1 and schedule[0].startswith("0:4:"), schedule


def _pids(work: Path) -> dict:
    """Slot -> pid of the first incarnation of each rank (the supervisor's pid file)."""
    out = {}
    for line in (work / "pids.txt").read_text().splitlines():
        slot, inc, pid = map(int, line.split())
        if inc == 0 and slot >= 0:
            out[slot] = pid
    return out


def _wait_for(path: Path, text: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "sigstop", "two_200ms_apart"])
def test_external_signals(megatron_lm: Path, tmp_path: Path, how: str) -> None:
    """``kill -9`` from outside at a random moment, a SIGSTOPped rank (found by its missed
    heartbeats) and two replicas lost 200 ms apart end like an injected kill."""
    argv = ["--train-iters", "60"]
    save = tmp_path / "real"

    def kill(proc: subprocess.Popen, log_path: Path) -> None:
        _wait_for(log_path, "iteration        5/")
        time.sleep(random.Random(7).uniform(0.0, 0.5))
        pids = _pids(tmp_path)
        if how == "sigkill":
            os.kill(pids[2], signal.SIGKILL)
        elif how == "sigstop":
            os.kill(pids[2], signal.SIGSTOP)
        else:
            os.kill(pids[1], signal.SIGKILL)
            time.sleep(0.2)
            os.kill(pids[3], signal.SIGKILL)

    rc, real = supervised(
        megatron_lm, [*argv, *MECEFO, "--save", str(save)], tmp_path,
        supervisor=["--replace", "never", "--heartbeat-timeout", "3"], act=kill,
    )  # fmt: skip
    assert rc == 0, real[-6000:]
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    lost = sorted(int(v.split(":")[0]) for v in schedule)
    assert lost == ([1, 3] if how == "two_200ms_apart" else [2]), schedule


@pytest.mark.slow  # the example trainer's twin is in make test
@pytest.mark.parametrize("first", ["save", "saved"])
def test_deaths_around_a_save(megatron_lm: Path, tmp_path: Path, first: str) -> None:
    """``--save-interval 3``: rank 1 dies as the save of iteration 3 starts (the others are in
    its collectives) or once it ended; rank 2 dies as the recovered world's save of iteration 6
    starts. Each death costs one regroup of seconds, no generation forms without a lost rank,
    and the run equals its simulated twin (which saves at the same iterations)."""
    argv = ["--train-iters", "9", "--save-interval", "3"]
    save = tmp_path / "real"
    kills = ["--mecefo-kill", f"1:3:{first}", "--mecefo-kill", "2:6:save"]
    rc, real = supervised(megatron_lm, [*argv, *MECEFO, *kills, "--save", str(save)], tmp_path)
    assert rc == 0, real[-6000:]
    assert "timed out" not in real and "loading checkpoint" not in real, real[-6000:]
    records = _records(tmp_path)
    assert [(r["ranks_lost"], r["iteration"]) for r in records] == [([1], 4), ([2], 7)], records
    assert all(r["total_s"] is not None and r["total_s"] < 10 for r in records), records
    print(f"deaths at {first} and save: kill -> redone {[r['total_s'] for r in records]} s")
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert sorted(schedule) == ["1:4", "2:7"], schedule


@pytest.mark.slow  # 45 s; .ci/run's 35 minutes (make test-all runs it)
def test_data_loader_worker_killed(megatron_lm: Path, tmp_path: Path) -> None:
    """``--num-workers 1``: rank 1's data-loader worker is SIGKILLed from outside mid-run. The
    rank exits at once (exit code 75) and its replica is taken over as after the rank's own
    SIGKILL, within seconds, with every sample processed once and no generation without a
    lost rank (before: the rank left the world alive, and the coordinator formed a generation
    with nobody lost after its error timeout: 22-29 s)."""
    import psutil

    argv = ["--train-iters", "40", "--num-workers", "1"]
    save = tmp_path / "real"
    killed: List[int] = []

    def kill_worker(proc: subprocess.Popen, log_path: Path) -> None:
        _wait_for(log_path, "iteration        5/")
        workers = psutil.Process(_pids(tmp_path)[1]).children()
        assert workers, "rank 1 has no data-loader worker"
        killed.append(workers[0].pid)
        os.kill(workers[0].pid, signal.SIGKILL)

    rc, real = supervised(
        megatron_lm, [*argv, *MECEFO, "--save", str(save)], tmp_path,
        supervisor=["--replace", "never"], act=kill_worker,
    )  # fmt: skip
    assert rc == 0, real[-6000:]
    assert killed and "a data-loader worker died" in real, real[-6000:]
    assert "died: exit code 75" in real, real[-6000:]
    records = _records(tmp_path)
    assert [r["ranks_lost"] for r in records] == [[1]], records
    assert records[0]["total_s"] is not None and 0 <= records[0]["total_s"] < 10, records
    print(f"data-loader worker killed: kill -> redone {records[0]['total_s']:.2f} s")
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert [v.split(":")[0] for v in schedule] == ["1"], schedule


@pytest.mark.slow
def test_every_replica_lost_ends_with_one_message(megatron_lm: Path, tmp_path: Path) -> None:
    """DP2 with both replicas killed: one clear message, a non-zero exit, no hang."""
    argv = ["--train-iters", "8", "--global-batch-size", "8"]
    rc, out = supervised(
        megatron_lm,
        [*argv, *MECEFO, "--mecefo-kill", "0:3:backward", "--mecefo-kill", "1:3:forward"],
        tmp_path, nproc=2, timeout=240,
    )  # fmt: skip
    assert rc not in (0, -999), out[-4000:]
    assert "training aborted" in out, out[-4000:]


@pytest.mark.slow
def test_death_during_the_rejoin(megatron_lm: Path, tmp_path: Path) -> None:
    """Rank 2 dies at the grad sync of iteration 3; its first replacement dies while it is
    being healed; the next one (a cold start: the standby was used) rejoins. The survivors
    never lose their state."""
    argv = ["--train-iters", "200", "--check-weight-hash-across-dp-replicas-interval", "10"]
    save = tmp_path / "real"
    rc, real = supervised(
        megatron_lm,
        [*argv, *MECEFO, "--mecefo-kill", "2:3:grad-sync", "--mecefo-kill", "2:4:heal",
         "--save", str(save)],
        tmp_path, supervisor=["--replace", "after:1", "--standby", "1"],
    )  # fmt: skip
    assert rc == 0, real[-6000:]
    assert "Weight hashes match after 200 iterations" in real
    records = _records(tmp_path)
    assert sum(2 in r["ranks_joined"] for r in records) >= 1, records
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert len(schedule) == 1 and schedule[0].startswith("2:3:"), schedule


@pytest.mark.slow
def test_distributed_optimizer_shard_rebuilt_from_snapshots(
    megatron_lm: Path, tmp_path: Path
) -> None:
    """--use-distributed-optimizer with a snapshot per iteration and XOR parity: rank 2 dies in
    its backward of iteration 5; the survivors roll back to the newest snapshot held with
    parity, rebuild rank 2's optimizer shard, re-shard over 3 replicas and replay."""
    argv = ["--train-iters", "10", "--use-distributed-optimizer"]
    save = tmp_path / "real"
    rc, real = supervised(
        megatron_lm,
        [*argv, *MECEFO, "--mecefo-snapshot-interval", "1", "--mecefo-snapshot-redundancy", "1",
         "--mecefo-kill", "2:5:backward", "--save", str(save)],
        tmp_path,
    )  # fmt: skip
    assert rc == 0, real[-6000:]
    (record,) = _records(tmp_path)
    assert record["recovery_path"] == "peers+parity", record
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert len(schedule) == 1 and schedule[0].startswith("2:"), schedule


@pytest.mark.slow
def test_distributed_optimizer_replacement_rejoins_resharded(
    megatron_lm: Path, tmp_path: Path
) -> None:
    """--use-distributed-optimizer: rank 2 dies in its backward of iteration 4 (its shard
    rebuilt from parity, DP3); a warm standby replaces it and rejoins at a boundary, where the
    optimizer is re-sharded over DP4 from the members' snapshots: Megatron-LM's weight-hash
    check passes, and the run equals the simulated schedule (replica 2 failed, then back)."""
    argv = ["--train-iters", "30", "--use-distributed-optimizer",
            "--check-weight-hash-across-dp-replicas-interval", "5"]  # fmt: skip
    save = tmp_path / "real"
    rc, real = supervised(
        megatron_lm,
        [*argv, *MECEFO, "--mecefo-snapshot-interval", "1", "--mecefo-snapshot-redundancy", "1",
         "--mecefo-kill", "2:4:backward", "--save", str(save)],
        tmp_path, supervisor=["--replace", "after:1", "--standby", "1"],
    )  # fmt: skip
    assert rc == 0, real[-6000:]
    assert "optimizer re-sharded over 4 replicas from the shards of ranks" in real, real[-6000:]
    assert "healed; parameters and optimizer state identical on every data-parallel" in real
    assert "Weight hashes match after 30 iterations" in real and "do not match" not in real
    failure, rejoin = _records(tmp_path)
    assert failure["recovery_path"] == "peers+parity" and rejoin["recovery_path"] == "regrow"
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert len(schedule) == 1 and schedule[0].startswith("2:"), schedule
    assert schedule[0].count(":") == 2, schedule  # failed, then back


@pytest.mark.slow
def test_node0_lost_under_etcd(megatron_lm: Path, tmp_path: Path, etcd: EtcdCluster) -> None:
    """Two supervisors (2 ranks each, DP4), ``--store-mode etcd`` on a private 3-member etcd:
    node 0 (the leader: its supervisor, hot store, coordinator and ranks 0 and 1) is
    SIGKILLed at a random moment; node 1 wins the next term, restores the state from etcd,
    and Megatron-LM trains on in-process, to the parameters of the simulated run that drops
    replicas 0 and 1 there."""
    argv = ["--train-iters", "60"]
    save = tmp_path / "real"

    def kill_node0(procs: List[subprocess.Popen], logs: List[Path]) -> None:
        _wait_for(logs[1], "iteration        5/")  # Megatron-LM's last rank logs
        time.sleep(random.Random(11).uniform(0.0, 0.5))
        pids = _pids(tmp_path)
        os.killpg(procs[0].pid, signal.SIGKILL)
        for slot in (0, 1):
            os.kill(pids[slot], signal.SIGKILL)

    rc, real = supervised_nodes(
        megatron_lm, [*argv, *MECEFO, "--save", str(save)], tmp_path,
        ["--store-mode", "etcd", "--etcd", ",".join(etcd.endpoints), "--replace", "never"],
        kill_node0,
    )  # fmt: skip
    assert rc == [-9, 0], real[-6000:]
    assert "this node takes over with a membership store" in real, real[-6000:]
    assert "loading checkpoint" not in real
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert sorted(int(v.split(":")[0]) for v in schedule) == [0, 1], schedule


@pytest.mark.slow
def test_leader_dead_after_its_claim_leaves_the_step_prepared_under_etcd(
    megatron_lm: Path, tmp_path: Path, etcd: EtcdCluster
) -> None:
    """Two supervisors (2 ranks each, DP4), ``--store-mode etcd``: node 0 (the leader) dies
    at a point of the vote (``MECEFO_TEST_DIE_AT=after-claim:5``: the first iteration from 5
    on whose count its node vote completes, right after the commit is claimed on etcd and
    before the commit key). Nobody applied the step; ranks 2 and 3 keep it prepared, node 1
    takes over, the next world finds the commit claimed, and Megatron-LM's ranks apply their
    kept step in the re-entered ``pretrain()`` (the adapter's ``apply_prepared_step``), to
    the parameters of the simulated run that drops replicas 0 and 1 after that iteration."""
    argv = ["--train-iters", "30"]
    save = tmp_path / "real"
    rc, real = supervised_nodes(
        megatron_lm, [*argv, *MECEFO, "--save", str(save)], tmp_path,
        ["--store-mode", "etcd", "--etcd", ",".join(etcd.endpoints), "--replace", "never"],
        lambda procs, logs: None, node_env={0: {"MECEFO_TEST_DIE_AT": "after-claim:5"}},
    )  # fmt: skip
    assert rc == [-9, 0], real[-6000:]
    assert "in doubt on 2 rank(s), was committed: they apply their kept step" in real, real[-6000:]
    assert "loading checkpoint" not in real
    schedule = _check_against_simulated(megatron_lm, real, save, tmp_path, argv)
    assert sorted(int(v.split(":")[0]) for v in schedule) == [0, 1], schedule
