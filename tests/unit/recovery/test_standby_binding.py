"""A promoted warm standby takes its slot's ``LOCAL_RANK`` (so its device) with the slot: the
supervisor's assignment carries it and ``generations.await_assignment`` sets it, before the
trainer touches CUDA. On a GPU node with 8 ranks, a replacement used to keep the standby's
``LOCAL_RANK=0`` and bind to GPU 0."""

from __future__ import annotations

import os
import threading

import pytest

from megatron_mecefo.recovery import supervisor
from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.generations import await_assignment
from megatron_mecefo.recovery.membership import MembershipStore


def _supervisor(node: int, slots: int = 4) -> supervisor.Supervisor:
    args = supervisor.build_parser().parse_args(
        ["--nproc-per-node", str(slots), "--nnodes", "2", "--node-rank", str(node),
         "--store", "127.0.0.1:1", "--", "train.py"]  # fmt: skip
    )
    cfg = RecoveryConfig(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, collective_timeout_s=1.0,
        init_timeout_s=2.0,
    )  # fmt: skip
    return supervisor.Supervisor(args, cfg.validate())


@pytest.mark.parametrize("node", [0, 1])
def test_assignment_carries_the_slots_local_rank(node: int) -> None:
    """Node 1 of two with 4 slots each holds ranks 4..7: rank 6 is its LOCAL_RANK 2."""
    sup = _supervisor(node)
    for local in range(4):
        slot = 4 * node + local
        assert sup.assignment(slot, 3) == {"slot": slot, "inc": 3, "local_rank": local}


def test_standby_takes_the_assigned_identity(store: str, monkeypatch) -> None:
    """The standby blocks in the store until its assignment appears, then is rank 6,
    incarnation 1, LOCAL_RANK 2 in its own environment (what the trainer and Megatron-LM read
    to pick the device)."""
    monkeypatch.setenv("LOCAL_RANK", "-1")
    for key in ("RANK", "MECEFO_RECOVERY_SLOT", "MECEFO_RECOVERY_INC"):
        monkeypatch.delenv(key, raising=False)
    writer = MembershipStore.connect(store, 10)
    late = threading.Timer(0.3, writer.set_json, ("assign/1/0", _supervisor(1).assignment(6, 1)))
    late.start()
    try:
        await_assignment(MembershipStore.connect(store, 10), "1/0", timeout_s=10)
    finally:
        late.join()
    assert (os.environ["RANK"], os.environ["MECEFO_RECOVERY_SLOT"]) == ("6", "6")
    assert (os.environ["MECEFO_RECOVERY_INC"], os.environ["LOCAL_RANK"]) == ("1", "2")


def test_standby_exits_when_the_job_ends_first(store: str) -> None:
    ms = MembershipStore.connect(store, 10)
    ms.store.set("done", "1")
    with pytest.raises(SystemExit) as stop:
        await_assignment(ms, "0/0", timeout_s=10)
    assert stop.value.code == 0
