"""``supervisor --rejoin`` (a lost node that comes back, examples/slurm/rejoin_node.sh) without
training: its flag checks, and the incarnation it starts a slot as, on a real TCPStore. The
whole path (Slurm, a node killed, the rejoin step healed) is ``make test-slurm``."""

from __future__ import annotations

import time

import pytest

from megatron_mecefo.recovery import supervisor
from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.membership import MembershipStore


@pytest.mark.parametrize("flags", [["--nnodes", "2", "--node-rank", "0"], ["--nnodes", "2",
                                   "--node-rank", "1"]])  # fmt: skip
def test_rejoin_needs_a_store_and_a_node_rank_above_zero(flags, capsys) -> None:
    argv = ["--nproc-per-node", "1", *flags, "--rejoin", "--", "train.py"]
    assert supervisor.main(argv) == 2
    assert "--rejoin --node-rank=" in capsys.readouterr().err


def _rejoiner(store: str) -> supervisor.Supervisor:
    args = supervisor.build_parser().parse_args(
        ["--nproc-per-node", "1", "--nnodes", "4", "--node-rank", "3", "--store", store,
         "--rejoin", "--", "train.py"]  # fmt: skip
    )
    cfg = RecoveryConfig(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, collective_timeout_s=1.0,
        init_timeout_s=2.0,
    )  # fmt: skip
    sup = supervisor.Supervisor(args, cfg.validate())
    sup.ms = MembershipStore.connect(store, 10)
    return sup


def test_rejoin_starts_the_next_incarnation_once_the_last_is_dead(store: str) -> None:
    ms = MembershipStore.connect(store, 10)
    ms.store.set("inc/3", "1")  # incarnation 1 replaced 0 earlier; now the node is lost
    ms.report_dead(3, 0, {"exit_code": -9})
    sup = _rejoiner(store)
    t0 = time.monotonic()
    ms.report_dead(3, 1, {"exit_code": None, "reason": "heartbeat, no supervisor"})
    assert sup._rejoin_incarnation(3) == 2
    assert time.monotonic() - t0 < 5


def test_rejoin_waits_for_the_death_then_gives_up_when_the_job_ends(store: str) -> None:
    import threading

    ms = MembershipStore.connect(store, 10)
    ms.store.set("inc/3", "0")
    declared = threading.Timer(1.0, ms.report_dead, (3, 0, {"exit_code": None}))
    declared.start()
    t0 = time.monotonic()
    assert _rejoiner(store)._rejoin_incarnation(3) == 1  # a hot spare waits for the death
    assert time.monotonic() - t0 >= 0.9
    ms.store.set("inc/3", "1")
    ms.store.set("done", "1")
    with pytest.raises(SystemExit) as exc:
        _rejoiner(store)._rejoin_incarnation(3)
    assert exc.value.code == 1
