"""A joiner in a rejoin's rendezvous leaves it when training finished before the switch.

A rejoin announced for an iteration past the last one is never reached: its members never
arrive. The joiner used to wait there for ever (and its supervisor with it)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import torch.distributed as dist
from conftest import free_port

from megatron_mecefo.recovery.membership import Generation, MembershipStore
from megatron_mecefo.recovery.session import RecoverySession


def _session(port: int) -> SimpleNamespace:
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return SimpleNamespace(ms=MembershipStore(client), slot=1, sleep=lambda: time.sleep(0.01))


def test_rendezvous_ends_when_training_is_done() -> None:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    gen = Generation(number=2, replicas=(0, 1), members={0: 0, 1: 1}, at_iteration=14)
    MembershipStore(server).publish(gen)
    session = _session(port)
    out: list = []
    t = threading.Thread(target=lambda: out.append(RecoverySession.rendezvous(session, gen)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # member 0 has not arrived: still waiting
    server.set("done", "1")
    t.join(timeout=5)
    assert not t.is_alive() and out == [False]


def test_rendezvous_meets_every_member() -> None:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    gen = Generation(number=2, replicas=(0, 1), members={0: 0, 1: 1}, at_iteration=14)
    MembershipStore(server).publish(gen)
    server.set("arrive/2/0", "1")
    assert RecoverySession.rendezvous(_session(port), gen) is True
