"""The coordinator's hot-store work grows with the nodes, not the ranks (issue 54, M1).

A real TCPStore and the real coordinator thread; its store client is wrapped to record every
request. 64 emulated nodes of 8 ranks: each node's supervisor writes one heartbeat key
(``hb/node/<id>``). A heartbeat pass with nothing new must be exactly three requests whatever
the number of ranks (before: 516 here, with a check per member for the ``err/`` scan), and an
event rereads only the slot it names, then decides with the generation's one error counter
(before: every slot, two or three requests each, and the ``err/`` scan).

A supervisor whose process is SIGKILLed closes its connection to the coordinator's liveness
listener: its ranks are declared dead at once, with a 30 s heartbeat timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, List, Tuple

from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.coordinator import Coordinator
from megatron_mecefo.recovery.heartbeat import Heartbeat
from megatron_mecefo.recovery.membership import MembershipStore

NODES, PER_NODE = 64, 8


class CountingStore:
    """A store client that records each request (its name and first key) and forwards it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: List[Tuple[str, str]] = []
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else ""
            key = first[0] if isinstance(first, list) and first else first
            with self.lock:
                self.calls.append((name, str(key)))
            return attr(*args, **kwargs)

        return call


def _supervisor(node: int) -> str:
    return f"{node}@node{node}:{1000 + node}"


def _emulate_job(store: str) -> MembershipStore:
    """A started job of NODES x PER_NODE ranks: layout, every rank ready under its node's
    supervisor, each node's heartbeat key."""
    ms = MembershipStore.connect(store)
    world = NODES * PER_NODE
    ms.set_json("layout", {"tp": 1, "pp": 1, "dp": world})
    for slot in range(world):
        ms.set_json(f"ready/{slot}/0", {"supervisor": _supervisor(slot // PER_NODE)})
    for node in range(NODES):
        ranks = {f"{s}/0": 1 for s in range(node * PER_NODE, (node + 1) * PER_NODE)}
        ms.store.set(f"hb/node/{_supervisor(node)}", json.dumps({"beat": 1, "ranks": ranks}))
    return ms


def _passes(calls: List[Tuple[str, str]]) -> List[List[Tuple[str, str]]]:
    """The requests split into the coordinator's passes (each starts by reading ``events``)."""
    found: List[List[Tuple[str, str]]] = []
    for call in calls:
        if call == ("add", "events"):
            found.append([])
        if found:
            found[-1].append(call)
    return found


def _wait(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_heartbeat_pass_and_an_event_cost_the_same_at_any_number_of_ranks(store: str) -> None:
    ms = _emulate_job(store)
    counting = CountingStore(MembershipStore.connect(store).store)
    cfg = RecoveryConfig(store=store, heartbeat_interval_s=0.1, heartbeat_timeout_s=30.0)
    coord = Coordinator(MembershipStore(counting, store), NODES * PER_NODE, cfg, log=lambda _: 0)
    coord.start()
    try:
        _wait(lambda: len(_passes(counting.calls)) >= 8, "the coordinator made no passes")
        with counting.lock:
            steady = _passes(counting.calls)[3:-1]  # complete passes after the start
        # Each: the event count, "done", the node keys (one multi_get for 64 nodes). Nothing
        # changed, so nothing is re-decided (before: the err/ scan, one check per member).
        nodes = f"hb/node/{_supervisor(0)}"
        expected = [("add", "events"), ("check", "done"), ("multi_get", nodes)]
        # A pass that comes before the heartbeat check falls due reads the event count only.
        checks = [one for one in steady if one != [("add", "events")]]
        assert checks, steady
        for one in checks:
            assert one == expected, f"{len(one)} requests in a heartbeat pass: {one[:12]}"
        # An event (a replacement of rank 5 is ready) rereads rank 5's keys only.
        with counting.lock:
            counting.calls.clear()
        event = f"event/{ms.events() + 1}"
        ms.store.set("inc/5", "1")
        ms.mark_ready(5, 1, {"supervisor": _supervisor(0)})
        _wait(lambda: (5, 1) in coord.ready, "the ready rank was not seen")
        _wait(lambda: len(_passes(counting.calls)) >= 2, "no pass after the event")
        with counting.lock:
            event_pass = _passes(counting.calls)[0]
        heartbeat_part = [("check", "done"), ("multi_get", nodes)]
        rest = [c for c in event_pass if c not in heartbeat_part]  # if the check fell due too
        # The event's key (check, multi_get), rank 5's inc (check, get), its dead keys of
        # incarnations 0 and 1 (check each), its new ready key (check, get); then the decision.
        assert sorted(rest) == sorted(
            [("add", "events"), ("check", event), ("multi_get", event),
             ("check", "inc/5"), ("get", "inc/5"), ("check", "dead/5/0"), ("check", "dead/5/1"),
             ("check", "ready/5/1"), ("get", "ready/5/1"), ("check", "stopping"),
             ("check", "err/0")]
        ), event_pass  # fmt: skip
    finally:
        coord.stop()


def test_a_killed_supervisor_is_declared_dead_at_once(store: str) -> None:
    """Node 3's supervisor (a process holding its liveness connection) is SIGKILLed: its
    ranks are declared dead and a failure generation is published well inside the 30 s
    heartbeat timeout. A SIGSTOPped one keeps its connection, and one that said it moves to
    another listener closes its own: nothing is declared for either."""
    ms = _emulate_job(store)
    cfg = RecoveryConfig(store=store, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0)
    coord = Coordinator(MembershipStore.connect(store), NODES * PER_NODE, cfg, log=lambda _: 0)
    coord.start()
    assert coord.listener is not None
    host, port = coord.listener.address.rsplit(":", 1)
    hold = (
        "import socket, sys, time\n"
        f"s = socket.create_connection(({host!r}, {port}))\n"
        "s.sendall((sys.argv[1] + '\\n').encode())\n"
        "print('held', flush=True)\n"
        "if sys.argv[2:] == ['bye']:\n"
        "    s.sendall(b'bye\\n')\n"
        "    sys.stdin.read()\n"
        "    sys.exit(0)\n"
        "time.sleep(600)\n"
    )
    procs = {
        node: subprocess.Popen([sys.executable, "-c", hold, _supervisor(node), *extra],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        for node, extra in ((3, []), (4, []), (5, ["bye"]))
    }
    try:
        for proc in procs.values():
            assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
        time.sleep(0.3)  # accepted and named
        os.kill(procs[4].pid, signal.SIGSTOP)  # hung: its socket stays open
        procs[5].communicate(timeout=30)  # said bye (it moves to a new leader), then exits
        killed = time.monotonic()
        os.kill(procs[3].pid, signal.SIGKILL)
        _wait(lambda: ms.generation_number() >= 1, "no failure generation", timeout=15.0)
        detected = time.monotonic() - killed
        gen = ms.generation(ms.generation_number())
        assert sorted(gen.lost) == list(range(3 * PER_NODE, 4 * PER_NODE)), gen
        assert detected < 15.0, f"a killed supervisor's node was found after {detected:.1f} s"
        info = ms.dead_info(3 * PER_NODE, 0)
        assert info is not None and info["reason"] == "supervisor connection closed"
        assert ms.dead_info(4 * PER_NODE, 0) is None, "a hung supervisor's node declared dead"
        assert ms.dead_info(5 * PER_NODE, 0) is None, "a supervisor that said bye declared dead"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        coord.stop()


def test_ranks_beat_through_their_supervisors_node_key(store: str, tmp_path: Path) -> None:
    """Real heartbeat threads: ranks beat into their supervisor's folder (no store request),
    the supervisor's beat writes one key for the node. A rank that stops beating is asked
    killed after the timeout; its sibling and its supervisor, still beating, are not."""
    folder = str(tmp_path)
    supervisor = "1@here:1"
    ms = MembershipStore.connect(store)
    ranks = {slot: Heartbeat(store, slot, 0, 0.05, folder=folder).start() for slot in (2, 3)}
    node = Heartbeat.of_supervisor(store, supervisor, 0.05, folder).start()
    try:
        for slot in ranks:
            ms.mark_ready(slot, 0, {"supervisor": supervisor})

        def node_key() -> dict:
            return json.loads(ms.get_str(f"hb/node/{supervisor}") or '{"ranks": {}}')

        _wait(lambda: min(node_key()["ranks"].get(f"{s}/0", 0) for s in ranks) >= 2,
              "the node key does not carry its ranks' beats")  # fmt: skip
        assert not ms.store.check(["hb/2/0"]) and not ms.store.check(["hb/3/0"])
        cfg = RecoveryConfig(store=store, heartbeat_interval_s=0.5, heartbeat_timeout_s=6.0)
        coord = Coordinator(MembershipStore.connect(store), 8, cfg, log=lambda _: 0)
        coord._rescan()
        t0 = time.monotonic()
        coord._check_heartbeats(t0)
        ranks[2].stop(join=True)  # rank 2 hangs; rank 3 and the supervisor beat on
        seen = node_key()
        _wait(lambda: node_key()["beat"] > seen["beat"] + 2, "the supervisor stopped beating")
        coord._check_heartbeats(t0 + 7.0)
        assert ms.get_str("kill/2/0") is not None, "a rank silent for the timeout not killed"
        assert ms.get_str("kill/3/0") is None, "a beating rank asked killed"
        assert ms.dead_info(2, 0) is None, "declared dead while its supervisor beats"
    finally:
        for beat in [*ranks.values(), node]:
            beat.stop(join=True)


def test_an_event_whose_key_never_lands_is_covered_by_a_full_rescan(store: str) -> None:
    """A writer killed between counting its event and writing its key (``notify``) leaves a
    hole: the coordinator waits for the key a moment, then rereads every slot, so the death
    written before the count is still found."""
    ms = _emulate_job(store)
    cfg = RecoveryConfig(store=store, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0)
    coord = Coordinator(MembershipStore.connect(store), NODES * PER_NODE, cfg, log=lambda _: 0)
    coord.start()
    try:
        _wait(lambda: (7, 0) in coord.ready, "the ranks were not seen")
        ms.set_json("dead/7/0", {"exit_code": -9})
        ms.store.add("events", 1)  # counted; its key event/<n> is never written
        _wait(lambda: (7, 0) in coord.dead, "a death behind a lost event key was missed")
        _wait(lambda: ms.generation_number() >= 1, "no failure generation")
        assert ms.generation(ms.generation_number()).lost == (7,)
    finally:
        coord.stop()
