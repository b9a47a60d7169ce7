"""Node 0's loss, store side, on real TCPStores: the failover client, the commit vote's outcome
across the takeover, and the standby's copy and takeover. The primary store runs in a child
process, so that killing it closes its sockets as a lost node's supervisor does."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_mecefo.recovery import commit
from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.coordinator import Coordinator
from megatron_mecefo.recovery.membership import Generation, MembershipStore
from megatron_mecefo.recovery.store_failover import PRIMARY_KEY, FailoverStore, StoreFailedOver
from megatron_mecefo.recovery.store_mirror import StandbyStore
from megatron_mecefo.recovery.supervisor import build_parser, validate

SERVE = (
    "import sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, None, True, "
    "wait_for_workers=False); print(s.port, flush=True); time.sleep(600)"
)


@pytest.fixture
def primary():
    """A TCPStore served by a child process: ``(address, process)``; killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.kill()
        proc.wait()


def _standby_server():
    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))  # fmt: skip


def _take_over(standby: dist.TCPStore, generation: int = 0) -> None:
    client = MembershipStore.connect(f"127.0.0.1:{standby.port}", 10)
    client.store.set(PRIMARY_KEY, json.dumps({"node": 1, "generation": generation}))


def test_a_call_after_the_primary_dies_is_repeated_on_the_standby(primary) -> None:
    address, proc = primary
    standby = _standby_server()
    store = FailoverStore([address, f"127.0.0.1:{standby.port}"], 10)
    store.set("x", "primary")
    assert store.get("x") == b"primary" and not store.failed_over
    standby.set("x", "standby")
    _take_over(standby)
    proc.kill()
    proc.wait()
    assert store.get("x") == b"standby"  # the same call, on the standby
    assert store.failed_over and store.address == f"127.0.0.1:{standby.port}"
    # A wait that times out is no failure: DistStoreError passes through, no switch.
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(milliseconds=50))


def test_raise_on_failover_and_no_switch_before_the_takeover(primary) -> None:
    address, proc = primary
    standby = _standby_server()
    store = FailoverStore([address, f"127.0.0.1:{standby.port}"], 1.5, raise_on_failover=True)
    proc.kill()
    proc.wait()
    # The standby has not taken over: the client waits for it (here 1.5 s), then gives up.
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.add("n", 1)
    assert time.monotonic() - t0 >= 1.0 and not store.failed_over
    _take_over(standby)
    with pytest.raises(StoreFailedOver):
        store.add("n", 1)
    assert store.failed_over and store.add("n", 1) == 1  # not repeated: counted once
    # A client made after the takeover starts at the standby (no connect timeout on node 0).
    late = FailoverStore([address, f"127.0.0.1:{standby.port}"], 10)
    assert late.failed_over and late.get("n") == b"1"


def test_the_standby_outcome_decides_a_vote_cut_by_the_failover(primary) -> None:
    """A commit claimed on the standby stands for every member; one not claimed there is
    aborted, and a committer that comes later finds the abort and does not apply the step."""
    address, _ = primary
    standby = _standby_server()
    both = f"{address},127.0.0.1:{standby.port}"
    committer = MembershipStore.connect(both, 10)
    assert commit.vote(committer, 1, 7, 0, [0], 0.01)  # a one-member vote: commit
    local = MembershipStore.connect(f"127.0.0.1:{standby.port}", 10)
    assert local.get_str("outcome/1/7") == commit.COMMIT
    assert commit.resolve_after_failover(local, 1, 7) is True
    # Iteration 8: the primary was lost before any commit claim; a reader claims the abort.
    assert commit.resolve_after_failover(local, 1, 8) is False
    assert commit.vote(committer, 1, 8, 0, [0], 0.01) is False  # its claim comes second
    assert local.get_str("outcome/1/8") == commit.ABORT
    assert not committer.store.check(["commit/1/8"])  # never announced on the primary
    commit.forget(committer, 1, 7)
    assert local.get_str("outcome/1/7") is None


def test_without_the_standby_the_primary_serves_alone(primary) -> None:
    """Node 1 (the standby's host) lost: durable writes and the commit go to the primary alone,
    and a later loss of the primary is no failover (it raises)."""
    address, proc = primary
    standby = _standby_server()
    ms = MembershipStore.connect(f"{address},127.0.0.1:{standby.port}", 3)
    ms.set_durable("progress", "5")
    del standby  # the standby's server closes (node 1 lost)
    ms.set_durable("progress", "6")
    assert commit.vote(ms, 1, 7, 0, [0], 0.01) is True
    assert ms.get_str("progress") == "6" and ms.store.standby_lost
    late = MembershipStore.connect(",".join(ms.store.addresses), 3)
    late.set_durable("logged", "6")  # the standby tried again: lost
    assert late.store.standby_lost and late.get_str("progress") == "6"
    proc.kill()
    proc.wait()
    with pytest.raises(dist.DistNetworkError):
        ms.get_str("progress")


def _config() -> RecoveryConfig:
    return RecoveryConfig(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, collective_timeout_s=1.0,
        init_timeout_s=5.0,
    ).validate()  # fmt: skip


def test_the_standby_copies_the_state_and_takes_over_when_the_primary_dies(primary) -> None:
    """Two nodes of two ranks: the standby copies generations, incarnations, deaths and the
    committed iteration; on the primary's death it declares node 0's ranks dead, and a
    coordinator resumed there publishes the failure generation numbered after the last."""
    address, proc = primary
    cfg = _config()
    taken = []
    standby = StandbyStore("127.0.0.1", 0, address, 2, 2, cfg, print, lambda: taken.append(1))
    ms = MembershipStore.connect(f"{address},{standby.address}", 10)
    ms.set_json("layout", {"tp": 1, "pp": 1, "dp": 4})
    ms.store.set("inc/3", "1")
    for slot in range(4):
        ms.mark_ready(slot, 1 if slot == 3 else 0, {})
    ms.report_dead(3, 0, {"exit_code": -9})
    gen = Generation(1, (0, 1, 2, 3), {0: 0, 1: 0, 2: 0, 3: 1}, layout={"tp": 1, "pp": 1, "dp": 4})
    ms.publish(gen)
    ms.set_durable("progress", "41")
    standby.start()
    local = standby.local
    deadline = time.monotonic() + 10
    while local.get_str("ready/3/1") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert local.generation_number() == 1 and local.get_str("progress") == "41"
    assert local.dead_info(3, 0) == {"exit_code": -9} and local.get_str("inc/3") == "1"
    assert not taken
    proc.kill()
    proc.wait()
    while not taken and time.monotonic() < deadline:
        time.sleep(0.05)
    assert taken and standby.took_over
    assert [local.dead_info(s, 0)["reason"] for s in (0, 1)] == ["node 0 lost"] * 2
    assert json.loads(local.get_str(PRIMARY_KEY))["generation"] == 1
    coordinator = Coordinator(MembershipStore.connect(standby.address, 10), 4, cfg, log=print)
    coordinator.start(resume=True)
    try:
        while local.generation_number() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        new = local.generation(2)
        assert new.lost == (0, 1) and new.replicas == (2, 3) and new.at_iteration is None
    finally:
        coordinator.stop()
    # The ranks' clients fail over to the standby and see the same generation.
    assert ms.generation_number() == 2 and ms.address() == standby.address


def test_no_takeover_after_the_job_ended(primary) -> None:
    address, proc = primary
    taken = []
    standby = StandbyStore("127.0.0.1", 0, address, 2, 1, _config(), print,
                           lambda: taken.append(1)).start()  # fmt: skip
    MembershipStore.connect(address, 10).store.set("done", "1")
    time.sleep(0.5)  # one copy (every heartbeat interval)
    proc.kill()
    proc.wait()
    standby.thread.join(timeout=10)
    assert not standby.thread.is_alive() and not taken
    assert not standby.local.store.check([PRIMARY_KEY])


def _parse(flags: list):
    """The supervisor's flags with a trainer command (``-m trainer``: no file to check)."""
    args = build_parser().parse_args([*flags, "--", "-m", "trainer"])
    args.command = args.command[1:]  # as main() drops the "--"
    return args


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nnodes", "1", "--store-mode", "replicated"], "--store-mode replicated --nnodes=1"),
        (["--nnodes", "2", "--node-rank", "0", "--rejoin", "--store", "h:1"],
         "--rejoin --node-rank=0: node 0 hosts the store in --store-mode single"),
        (["--nnodes", "2", "--node-rank", "1", "--store", "h:1,h:2"],
         "two addresses (primary,standby) are for a node that rejoins"),
    ],
)  # fmt: skip
def test_store_mode_flags_are_checked(flags: list, message: str) -> None:
    from megatron_mecefo.recovery.config import RecoveryConfigError

    args = _parse(["--nproc-per-node", "1", *flags])
    with pytest.raises(RecoveryConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(args)


def test_a_new_node0_may_rejoin_in_the_replicated_mode() -> None:
    args = _parse(["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "0", "--rejoin",
                   "--store", "h:1,h:2", "--store-mode", "replicated"])  # fmt: skip
    assert validate(args).store == ""  # accepted (the store is opened at run time)
