"""The standby membership store: node 1's copy of the membership state, and the takeover
when node 0 (its supervisor, its store, its coordinator) is lost.

In the replicated mode node 1's supervisor serves a second TCPStore. A thread of it copies the
membership state from the primary: whenever an event is counted there (a death, a ready
process, an error, a kill request, a new generation) and at least every heartbeat interval
(the committed iteration). The coordinator writes every generation to the standby before the
primary, and the commit vote claims its outcome there (:mod:`.commit`), so neither can be
lost with node 0. The per-iteration keys (votes, heartbeats, the worlds' rendezvous) stay on
the primary only.

The primary is lost when a call to it fails: its server's sockets closed (the process or the
node died), or no answer within a heartbeat timeout (a node gone without closing its sockets:
power, network). Unless the job had ended, the standby then
declares node 0's ranks dead, marks itself the primary (:data:`~.store_failover.PRIMARY_KEY`,
which the clients' :class:`~.store_failover.FailoverStore` waits for), and node 1's supervisor
starts a coordinator on it that goes on from the copied state: the survivors regroup in a
failure generation, as after any death. One takeover per job: afterwards node 1 holds the only
store.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, Optional, Set

from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.membership import MembershipStore
from megatron_mecefo.recovery.store_failover import PRIMARY_KEY, tcp_client

COPIED_KEYS = (
    "gen", "layout", "world_size", "progress", "logged", "done", "fatal", "stopping", "rdzv",
    "standby", "nodes_done",
)  # fmt: skip
"""Keys copied as they change (the per-slot and per-node keys are listed in :meth:`_copy`)."""

ONCE = ("dead/", "ready/", "gen/", "node/")
"""Prefixes of keys written once: copied once."""


class StandbyStore:
    """Serves the standby store and mirrors the primary into it (see the module docstring).

    Args:
        host: Address to serve on (this node's).
        port: Port (0: any free one).
        primary: ``HOST:PORT`` of node 0's store.
        nnodes: Nodes of the job.
        nproc_per_node: Ranks per node (node 0's slots are ``0 .. nproc_per_node - 1``).
        config: The recovery settings (heartbeat interval and timeout, init timeout).
        log: Prints one line.
        on_takeover: Called on the mirror thread once this store is the primary.
    """

    def __init__(
        self,
        host: str,
        port: int,
        primary: str,
        nnodes: int,
        nproc_per_node: int,
        config: RecoveryConfig,
        log: Callable[[str], None],
        on_takeover: Callable[[], None],
    ) -> None:
        import torch.distributed as dist

        self.server = dist.TCPStore(
            host, port, None, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=config.init_timeout_s),
        )  # fmt: skip
        self.address = f"{host}:{self.server.port}"
        self.primary = primary
        self.nnodes, self.nproc = nnodes, nproc_per_node
        self.cfg = config
        self.log = log
        self.on_takeover = on_takeover
        self.local = MembershipStore(tcp_client(self.address, config.init_timeout_s))
        self._copied: Set[str] = set()  # keys written once (deaths, ready marks, generations)
        self._stop = threading.Event()
        self.took_over: Optional[str] = None
        """Why the standby took over (``None``: it has not)."""
        self.thread = threading.Thread(target=self._run, name="mecefo-standby", daemon=True)

    def start(self) -> StandbyStore:
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop mirroring (this node finished: the primary's closing is no loss), and wait for
        the thread to leave its store wait: a thread still in a C++ wait when the interpreter
        exits aborts the process ("terminate called without an active exception")."""
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=self.cfg.heartbeat_interval_s + 5.0)

    # ------------------------------------------------------------------ mirror
    def _run(self) -> None:
        from torch.distributed import DistError

        # Calls to the primary time out after a heartbeat timeout: a node 0 that is gone
        # without closing its sockets (power, network) is taken for lost then.
        timeout = self.cfg.heartbeat_timeout_s
        try:
            primary = MembershipStore(tcp_client(self.primary, timeout))
            waiter = MembershipStore(tcp_client(self.primary, timeout))
        except DistError as err:  # node 0 died before the mirror started
            return self._take_over(f"cannot connect ({_first_line(err)})")
        last_events, last_copy = -1, 0.0
        reason = ""
        while not self._stop.is_set():
            try:
                events = primary.events()
                now = time.monotonic()
                if events != last_events or now - last_copy >= self.cfg.heartbeat_interval_s:
                    last_events, last_copy = events, now
                    self._copy(primary)
                waiter.wait_event_after(last_events, self.cfg.heartbeat_interval_s)
            except DistError as err:  # closed, reset, or no answer within the timeout
                reason = _first_line(err)
                break
        if not self._stop.is_set():
            self._take_over(reason)

    def _copy(self, primary: MembershipStore) -> None:
        """Copy the membership keys that changed: each key read once per copy, and a key
        written once (a death, a ready mark, a generation, a node) once per job."""
        values: Dict[str, Optional[str]] = {}

        def read(key: str) -> Optional[str]:
            if key not in self._copied and key not in values:
                values[key] = primary.get_str(key)
            return values.get(key)

        for key in (*COPIED_KEYS, *(f"node/{k}" for k in range(self.nnodes))):
            read(key)
        for slot in range(self.nnodes * self.nproc):
            for i in range(int(read(f"inc/{slot}") or 0) + 1):
                read(f"dead/{slot}/{i}")
                read(f"ready/{slot}/{i}")
        for g in range(int(values.get("gen") or -1) + 1):
            read(f"gen/{g}")
        for key, value in values.items():
            if value is None:
                continue
            self.local.store.set(key, value)
            if key.startswith(ONCE):
                self._copied.add(key)

    # ------------------------------------------------------------------ takeover
    def _take_over(self, reason: str) -> None:
        ms = self.local
        ended = ms.get_str("done") or ms.get_str("fatal") or ms.get_str("stopping")
        number = ms.generation_number()
        if ended or (number >= 0 and ms.generation(number).abort):
            return  # node 0 closed its store after the job ended: nothing to take over
        t0 = time.time()
        self.log(
            f"node 0's membership store at {self.primary} is lost ({reason}); the standby "
            f"store at {self.address} takes over"
        )
        for slot in range(self.nproc):  # node 0's ranks die with their supervisor
            inc = int(ms.get_str(f"inc/{slot}") or 0)
            if ms.dead_info(slot, inc) is None:
                info = {"exit_code": None, "reason": "node 0 lost", "t": t0}
                ms.set_json(f"dead/{slot}/{inc}", info)
        ms.store.add("nodes_lost", 1)
        # Past any event count a supervisor saw on the primary: each then looks again.
        ms.store.add("events", 1 << 20)
        takeover = {"node": 1, "t": t0, "reason": reason, "generation": number}
        ms.store.set(PRIMARY_KEY, json.dumps(takeover))
        ms.notify()
        self.took_over = reason
        self.on_takeover()


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def wait_for_standby(ms: MembershipStore, timeout_s: float) -> Optional[str]:
    """The standby's ``HOST:PORT`` once node 1 has published it (``None`` at the timeout)."""
    ms.wait_for("standby", timeout_s)
    return ms.get_str("standby")
