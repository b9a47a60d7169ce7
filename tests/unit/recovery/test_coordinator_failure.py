"""A coordinator thread that fails while the job runs is never left down. With a single store
(nobody can take over) the store's host restarts it from the store's state, with one line, and
the restarted coordinator makes the generation the failure was in the way of; after
``COORDINATOR_RESTARTS`` failures the job stops with one line (the fatal message). Real
TCPStore, real ``StoreHost`` and ``Coordinator``; the failure is injected by wrapping the
coordinator's store client (the etcd mode's handover: ``tests/integration/recovery/
test_etcd_edges.py``)."""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any, List

import pytest
import torch.distributed as dist

from megatron_mecefo.recovery import store_host as store_host_module
from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.membership import MembershipStore
from megatron_mecefo.recovery.store_host import StoreHost


def _host(address: str, lines: List[str]) -> StoreHost:
    args = argparse.Namespace(store_mode="single", node_rank=0, nnodes=1, nproc_per_node=1,
                              rejoin=False, command=["train.py"])  # fmt: skip
    cfg = RecoveryConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
    cfg.store = address
    host = StoreHost(args, cfg, log=lines.append)
    host.ms = MembershipStore.connect(address, 10.0)
    return host


def _wait(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


RESTARTS = getattr(store_host_module, "COORDINATOR_RESTARTS", 3)


@pytest.mark.parametrize("failures", [1, RESTARTS + 1])
def test_a_failed_coordinator_is_restarted_or_ends_the_job(
    failures: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)  # fmt: skip
    address = f"127.0.0.1:{server.port}"
    lines: List[str] = []
    host = _host(address, lines)
    client = MembershipStore.connect(address, 10.0)
    left = [failures]
    publish = MembershipStore.publish

    def failing_publish(self: MembershipStore, gen: Any) -> None:
        if gen.number > 0 and left[0] > 0:
            left[0] -= 1
            raise RuntimeError(f"injected: the write of gen/{gen.number} failed")
        publish(self, gen)

    monkeypatch.setattr(MembershipStore, "publish", failing_publish)
    try:
        host._start_coordinator(address, resume=False)
        first = host.coordinator
        assert first is not None
        client.set_json("layout", {"tp": 1, "pp": 1, "dp": 1})
        client.mark_ready(0, 0, {})
        client.report_dead(0, 0, {"exit_code": -9, "reason": "test"})  # needs generation 1
        said = [x for x in lines if "coordinator thread failed" in x]
        if failures <= RESTARTS:
            _wait(lambda: client.generation_number() == 1, f"no generation 1: {lines}")
            said = [x for x in lines if "coordinator thread failed" in x]
            assert len(said) == failures and "restarted" in said[0], lines
            assert "injected: the write of gen/1 failed" in said[0], lines
            assert host.coordinator is not first  # the restarted one published it
        else:
            _wait(lambda: client.get_str("fatal") is not None, f"no fatal message: {lines}")
            fatal = client.get_str("fatal")
            assert f"failed {failures} times" in fatal and "injected" in fatal, fatal
            assert client.generation_number() == 0
    finally:
        host._closing.set()
        if host.coordinator is not None:
            host.coordinator.stop()
        del server
