"""The membership store as one node's supervisor sees it: hosting it (node 0), joining it (the
other nodes), the etcd mode's election and takeover, the coordinator that runs beside the
store, and the end of the job on the store's host.

No training rank hosts the store, so any rank, rank 0 included, can die. Node 0 serves a
TCPStore on ``--store-host:--store-port`` (and a second one for torchrun-style ``env://``
rendezvous of trainers without MeCeFO's session) and runs the :mod:`~.coordinator`. With
``--store-mode etcd``, the supervisors elect a leader on etcd (:mod:`~.etcd_control`); the
leader serves the store and coordinates, and when its term ends another node takes over with
the state restored from etcd (:mod:`~.store_etcd`), again and again. A term ends when its lease
expires (a hung or cut-off leader: the TTL), or at once when a follower finds the leader's
store refusing connections (a dead process: :meth:`StoreHost._watch_leader`).

The supervisor's loop (:mod:`.supervisor`) uses the :class:`StoreHost` through
:meth:`StoreHost.open`, :meth:`StoreHost.finish_node` and :meth:`StoreHost.close`, and the
:class:`~.membership.MembershipStore` client that :meth:`StoreHost.open` returns.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.store_forwarding import serve
from megatron_mecefo.recovery.supervisor_args import SupervisorError, rank_list

if TYPE_CHECKING:
    from megatron_mecefo.recovery.membership import MembershipStore

WAIT_REPORT_S = 5.0
"""While waiting for nodes or for the store, a line every this many seconds."""

LOST_NODES_EVERY_S = 0.5
"""At the job's end, the store's host looks for lost nodes this often (it waits for the rest)."""

LEADER_WATCH_S = 1.0
"""A follower re-reads the leader's store address on etcd at least this often."""

LEADERLESS_GRACE_S = 2.0
"""Node 0 of a fresh job deletes the keys of an unfinished run under its prefix only when no
leader was elected there for this long (a takeover elects one within moments)."""

REFUSAL_LASTS_S = 0.5
"""A follower deposes a leader whose store refuses connections only when the refusals last
this long (a first refusal and another at least this much later, none accepted between), and
the leader's heartbeat on etcd (its lease's renewals) is stale too: a firewall's REJECT, or
a restart of the listener, is no death."""

COORDINATOR_RESTARTS = 3
"""``--store-mode single``: how many times a failed coordinator thread is restarted (each
said in one line) before the job stops; etcd mode hands the leadership over instead."""


class StoreHost:
    """This node's part in the membership store: host, leader (etcd mode) or client.

    Args:
        args: The supervisor's parsed flags (``--store*``, ``--nnodes``, ``--node-rank``,
            ``--rejoin``, the command).
        config: The recovery config; :meth:`open` sets its ``store`` to the address(es) the
            ranks connect to.
        log: Prints one supervisor line.
    """

    def __init__(
        self, args: argparse.Namespace, config: RecoveryConfig, log: Callable[[str], None]
    ) -> None:
        self.args = args
        self.cfg = config
        self.log = log
        self.node = args.node_rank
        self.world_size = args.nnodes * args.nproc_per_node
        self.server = None
        self.rdzv = None
        self.coordinator = None
        self.hosts_store = self.node == 0 and not args.rejoin
        """Whether this node's supervisor serves the store the job uses now (and so waits for
        the other nodes before it exits): node 0, or the etcd mode's leader once it took
        over."""
        self.ms: Optional["MembershipStore"] = None
        self._coordinator_store = ""
        self._coordinator_restarts = 0
        self.rdzv_address = "127.0.0.1:0"
        """The ``env://`` rendezvous (``MASTER_ADDR:MASTER_PORT``) of the ranks."""
        self.control: Optional[Any] = None
        """``--store-mode etcd``: this node's :class:`~.etcd_control.EtcdControl`."""
        self.hot_address = ""
        """``--store-mode etcd``: the hot store this node serves as the leader."""
        self._closing = threading.Event()
        self._finishing = threading.Event()
        """Set when this node's ranks finished: its watch of the leader's store ends (the
        leader's store closes at the job's end, which is no death)."""
        self.on_control_lost: Optional[Callable[[str], None]] = None
        """Called once (from a background thread) when the leadership or etcd is lost."""
        self.on_job_ended: Optional[Callable[[str], None]] = None
        """Called once (from a background thread) when this node wins a term after the end."""

    def open(self) -> "MembershipStore":
        """Serve or reach the store (etcd mode: elect or follow the leader), publish this
        node and set up the rendezvous; on the store's host, wait for every node and start the
        coordinator.

        Returns:
            The membership store client of this supervisor.

        Raises:
            SupervisorError: The store cannot be served or reached, or a node never joined.
        """
        a = self.args
        if a.store_mode == "etcd":
            return self._open_etcd()
        if not self.hosts_store:  # before importing torch: a wrong address is said in a second
            self.cfg.store = a.store
            self._wait_for_store()

        from megatron_mecefo.recovery.membership import MembershipStore

        if self.hosts_store:
            try:
                self.server = serve(a.store_host, a.store_port, self.cfg.init_timeout_s)
            except Exception as err:  # noqa: BLE001 (torch's DistNetworkError and kin)
                address = f"{a.store_host}:{a.store_port}"
                if "in use" in str(err).lower():
                    raise SupervisorError(
                        f"--store-port {a.store_port}: the address {address} is already in use "
                        "(another job or supervisor?); pass another --store-port, or 0 for any "
                        "free port"
                    ) from None
                raise SupervisorError(
                    f"cannot serve the membership store at {address} ({_first_line(err)}); "
                    "pass a --store-host of this machine (its hostname or one of its addresses)"
                ) from None
            self.cfg.store = f"{a.store_host}:{self.server.port}"
            if a.store_file:
                _write_atomically(a.store_file, self.cfg.store)
            self.log(f"membership store at {self.cfg.store} (outside every training rank)")
        try:
            self.ms = MembershipStore.connect(self.cfg.store, self.cfg.init_timeout_s)
        except Exception as err:  # noqa: BLE001
            raise SupervisorError(
                f"--store {self.cfg.store}: cannot connect to the membership store "
                f"({_first_line(err)}); check the address node 0's supervisor printed"
            ) from None
        self.ms.store.set(f"node/{self.node}", socket.gethostname())
        self._serve_rdzv_and_coordinate(self.cfg.store)
        return self.ms

    def finish_node(self) -> None:
        """Every rank of this node finished; the store's host keeps it up for the other nodes
        until each has finished too or is known lost (:meth:`_lost_nodes`), at most 30 s."""
        assert self.ms is not None
        self._finishing.set()
        self.ms.store.add("nodes_done", 1)
        if self.hosts_store:
            deadline = time.monotonic() + 30
            lost, looked = 0, 0.0
            while time.monotonic() < deadline:
                done = int(self.ms.store.add("nodes_done", 0))
                if done + lost >= self.args.nnodes:
                    break
                if time.monotonic() - looked >= LOST_NODES_EVERY_S:
                    looked = time.monotonic()
                    lost = self._lost_nodes()
                    continue
                time.sleep(0.05)

    def _lost_nodes(self) -> int:
        """How many other nodes are lost: every rank of the node, in its current incarnation,
        declared dead by someone other than its supervisor (``exit_code`` None: the
        coordinator, its supervisor silent or its kill request unanswered; or a leader that
        took over from that node). A lost node's supervisor never says it finished; a node
        that rejoined in its place runs a newer incarnation, and says it itself."""
        assert self.ms is not None
        nproc = self.args.nproc_per_node
        lost = 0
        for node in range(self.args.nnodes):
            if node == self.node:
                continue
            for slot in range(node * nproc, (node + 1) * nproc):  # a living node: one look
                inc = int(self.ms.get_str(f"inc/{slot}") or 0)
                info = self.ms.dead_info(slot, inc)
                if info is None or info.get("exit_code") is not None:
                    break
            else:
                lost += 1
        return lost

    def close(self) -> None:
        """Stop the coordinator, if this node runs it (etcd mode: the campaign, and the
        leadership, resigned)."""
        self._closing.set()
        if self.coordinator is not None:
            self.coordinator.stop()
        if self.control is not None:
            try:
                if self.control.term is not None and not self.control.lost.is_set():
                    self.control.resign()
            except Exception:  # noqa: BLE001 (etcd gone: the lease expires by itself)
                pass
            self.control.close()

    # ------------------------------------------------------------------ etcd mode
    def _open_etcd(self) -> "MembershipStore":
        """``--store-mode etcd``: node 0 campaigns first and, once elected, serves the hot
        store and runs the coordinator; every other node joins through etcd, watches the
        leader's store, and campaigns in the background, to take over when the leader's term
        ends."""

        from megatron_mecefo.recovery.etcd_control import (
            ControlError,
            EtcdControl,
            NotElected,
            lease_ttl_s,
        )
        from megatron_mecefo.recovery.membership import MembershipStore
        from megatron_mecefo.recovery.store_etcd import (
            HOT_STORE,
            LEADER_NODE,
            RUN_KEY,
            etcd_address,
            register_control,
            run_token,
        )
        from megatron_mecefo.recovery.store_forwarding import StoreFailedOver

        a = self.args
        prefix = etcd_prefix(a)
        ttl = lease_ttl_s(self.cfg.heartbeat_timeout_s)  # a floor: load cannot cost the lease
        self.cfg.store = etcd_address(a.etcd_endpoints, prefix, ttl)
        self.control = EtcdControl(a.etcd_endpoints, prefix, ttl, on_lost=self._control_lost)
        register_control(self.cfg.store, self.control)
        try:
            if self.hosts_store:
                # A fresh job: nothing of an earlier run under its prefix, and never the keys
                # of a job that still runs there (fenced: deleted only while nobody leads).
                wait_s = self.control.ttl_s + LEADERLESS_GRACE_S
                self._clear_prefix(prefix, wait_s)
                try:
                    self.control.campaign(self.candidate, wait_s)
                except NotElected:  # another job's node 0 claimed the prefix meanwhile
                    raise SupervisorError(self._prefix_taken(prefix, wait_s)) from None
                self.control.put_fenced(LEADER_NODE, str(self.node))
                # This run's token, before its store is published: the clients that know it
                # never follow a store of another run under this prefix.
                run = uuid.uuid4().hex[:16]
                self.control.put_fenced(RUN_KEY, run)
                self.cfg.store = etcd_address(a.etcd_endpoints, prefix, ttl, run)
                register_control(self.cfg.store, self.control)
                self.server = serve(a.store_host, a.store_port, self.cfg.init_timeout_s)
                self.hot_address = f"{a.store_host}:{self.server.port}"
                self.control.put_fenced(HOT_STORE, self.hot_address)
                self.log(
                    f"membership store at {self.hot_address}, elected leader on etcd "
                    f"{','.join(a.etcd_endpoints)} (term {self.control.term.number})"
                )
            deadline = time.monotonic() + self.cfg.init_timeout_s
            self.ms = MembershipStore.connect(self.cfg.store, self.cfg.init_timeout_s)
            while not (self.hosts_store or a.rejoin) and _ended(self.ms):
                # An earlier run's store, up a little after its end: joining it would end this
                # node's ranks at once ("training finished"). This job's node 0 deletes it and
                # publishes its own store; a store that stays ended is said as no leader's.
                if time.monotonic() > deadline:
                    raise StoreFailedOver("only an ended run's store was published")
                time.sleep(0.2)
                left = max(deadline - time.monotonic(), 1.0)
                self.ms = MembershipStore.connect(self.cfg.store, left)
            if not self.hosts_store and (run := run_token(self.control)):
                # The run this node joined (its token is written before its store): from
                # here on, this supervisor and its ranks follow no store of another run.
                self.cfg.store = etcd_address(a.etcd_endpoints, prefix, ttl, run)
                register_control(self.cfg.store, self.control)
                self.ms = MembershipStore.connect(self.cfg.store, self.cfg.init_timeout_s)
            if a.store_file:  # any node: what a node that joins or rejoins passes as --store
                _write_atomically(a.store_file, self.cfg.store)
        except SupervisorError:
            raise
        except ControlError as err:
            raise SupervisorError(f"--etcd {','.join(a.etcd_endpoints)}: {err}") from None
        except StoreFailedOver:  # a follower found no leader's store under the prefix
            raise SupervisorError(
                f"node {self.node}: no leader published a membership store under {prefix} on "
                f"etcd {','.join(a.etcd_endpoints)} within --init-timeout="
                f"{self.cfg.init_timeout_s:g}s; start node 0's supervisor with the same "
                f"{prefix_source(a)} as this node"
            ) from None
        except Exception as err:  # noqa: BLE001 (torch's DistNetworkError and kin)
            raise SupervisorError(
                f"--store-mode etcd: cannot serve or reach the membership store "
                f"({_first_line(err)}); pass a --store-host of this machine"
            ) from None
        if not self.hosts_store and not a.rejoin:
            # Another job under the same prefix (or this node started twice): joining would
            # hand this node's slots to that job's world.
            joined = self.ms.get_str(f"node/{self.node}")
            if joined is not None:
                raise SupervisorError(
                    f"node {self.node} of the job under the etcd key prefix {prefix} has "
                    f"already joined (on {joined}): another job uses this prefix, or this node "
                    f"was started twice; export MECEFO_JOB_ID=<a name unique to each job> on "
                    "every node of it (or pass --rejoin for a node that replaces a lost one)"
                )
        self.ms.store.set(f"node/{self.node}", socket.gethostname())
        self._serve_rdzv_and_coordinate(self.hot_address)
        if not self.hosts_store:
            threading.Thread(target=self._campaign, name="mecefo-campaign", daemon=True).start()
            threading.Thread(
                target=self._watch_leader, name="mecefo-leader-watch", daemon=True
            ).start()
        return self.ms

    def _clear_prefix(self, prefix: str, wait_s: float) -> None:
        """Node 0 of a fresh job: delete the keys of an earlier run under ``prefix``, in one
        etcd transaction that requires ``leader`` to be absent, so that a live job's keys are
        never deleted. A leader's lease that outlives its job (a crashed run) expires within
        the TTL: wait up to ``wait_s`` for that. A run that ended without ``done`` or
        ``fatal`` and has no leader may be in a takeover: its next leader is elected within
        moments, so its keys are deleted only when ``leader`` stayed absent (and
        ``hot_store`` unchanged) for :data:`LEADERLESS_GRACE_S`.

        Raises:
            SupervisorError: A leader held the prefix for all of ``wait_s``.
        """
        from megatron_mecefo.recovery.etcd_transport import (
            cmp_mod,
            cmp_version,
            op_delete_prefix,
            op_get,
            txn_kv,
        )
        from megatron_mecefo.recovery.store_etcd import HOT_STORE

        c = self.control
        assert c is not None
        leader, hot = c.leader_key, c.key(HOT_STORE)
        ended = [c.key("kv/done"), c.key("kv/fatal")]
        deadline = time.monotonic() + wait_s
        while True:
            r = c.conn.txn("read the job's prefix", [], [op_get(k) for k in (leader, hot, *ended)],
                           [])  # fmt: skip
            lead, store = txn_kv(r, 0), txn_kv(r, 1)
            unfinished = store is not None and txn_kv(r, 2) is None and txn_kv(r, 3) is None
            if lead is None and unfinished:  # a takeover under way looks like this, briefly
                c.conn.watch_once(leader, r.header.revision + 1, LEADERLESS_GRACE_S)
            if lead is None:
                same = [cmp_version(leader, 0)]
                same.append(cmp_mod(hot, store.mod_revision) if store else cmp_version(hot, 0))
                d = c.conn.txn(
                    "clear the keys of an earlier run", same, [op_delete_prefix(c.key(""))], []
                )
                if d.succeeded:
                    return
                continue  # something moved: look again
            left = deadline - time.monotonic()
            if left <= 0:
                holder = lead.value.decode(errors="replace")
                raise SupervisorError(self._prefix_taken(prefix, wait_s, holder))
            c.conn.watch_once(leader, r.header.revision + 1, min(left, 1.0))

    def _prefix_taken(self, prefix: str, wait_s: float, holder: str = "") -> str:
        """The line of a node 0 whose key prefix holds a live job."""
        by = f" (its leader {holder} kept its lease for {wait_s:.0f} s)" if holder else ""
        return (
            f"the etcd key prefix {prefix} holds a live job{by}: two jobs on one etcd need "
            f"different ids (this one's comes from its {prefix_source(self.args)}); export "
            "MECEFO_JOB_ID=<a name unique to this job> on every node of this job, or stop the "
            "other job"
        )

    def _serve_rdzv_and_coordinate(self, coordinator_store: str) -> None:
        """The end of opening, in every store mode: the ``env://`` rendezvous address, and on
        the store's host the job size, every node, and the coordinator on
        ``coordinator_store``."""

        a = self.args
        # For trainers without MeCeFO's session (e.g. Megatron-LM's pretrain_gpt.py): a
        # torchrun-style env:// rendezvous on a second store of node 0 (agent-store mode).
        if self.hosts_store:
            self.rdzv = serve(a.store_host, 0)
            self.ms.store.set("rdzv", f"{a.store_host}:{self.rdzv.port}")
        deadline = time.monotonic() + self.cfg.init_timeout_s
        while (rdzv := self.ms.get_str("rdzv")) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.rdzv_address = rdzv or "127.0.0.1:0"
        if self.hosts_store:
            self.ms.set_json("world_size", self.world_size)
            self._wait_for_nodes()
            self._start_coordinator(coordinator_store, resume=False)

    @property
    def candidate(self) -> str:
        return f"node{self.node}@{socket.gethostname()}:{os.getpid()}"

    def _campaign(self) -> None:
        """A non-leader's background campaign (bounded waits, so that a lost quorum is said
        within the TTL); the winner takes over."""
        from megatron_mecefo.recovery.etcd_control import ControlError, NotElected

        assert self.control is not None
        while not self._closing.is_set():
            try:
                self.control.campaign(self.candidate, max(self.control.ttl_s, 2.0))
            except NotElected:
                continue
            except ControlError as err:
                if not self._closing.is_set():
                    self._control_lost(str(err))
                return
            except Exception as err:  # noqa: BLE001 (e.g. gRPC's "Channel closed" at shutdown)
                # A campaign thread that died silently would leave this node unable ever to
                # lead: outside a shutdown it is said in one line and the node exits.
                if not self._closing.is_set():
                    self._control_lost(f"etcd campaign failed: {type(err).__name__}: {err}")
                return
            if self._closing.is_set():
                return
            try:
                self._take_over_etcd()
            except Exception as err:  # noqa: BLE001 (fenced or etcd lost: one line, exit)
                import traceback

                where = traceback.extract_tb(err.__traceback__)[-1]
                self._control_lost(
                    f"takeover failed: {type(err).__name__}: {err} "
                    f"({os.path.basename(where.filename)}:{where.lineno})"
                )
            return

    def _watch_leader(self) -> None:
        """A follower's watch of the leader's store, so that a leader's *certain* death ends its
        term at once rather than when its lease expires (up to the heartbeat timeout).

        It holds a TCP connection to the store (it sends nothing: the server keeps it idle).
        When the leader's process dies, its kernel closes the connection and its listening
        socket; a reconnect is then refused (ECONNREFUSED: the host is up, nothing listens).
        Only that refusal counts: the follower revokes the lease of the term that published
        the store (:meth:`~.etcd_control.EtcdControl.end_term_of`) and the campaigns elect
        the next leader. A silent leader (hung, cut off, its host down) refuses nothing:
        connects time out or hang, and its lease expires after the TTL as before."""
        from megatron_mecefo.recovery.etcd_control import ControlError
        from megatron_mecefo.recovery.store_etcd import hot_store

        c = self.control
        assert c is not None
        sock: Optional[socket.socket] = None
        watched, ended = "", ""
        refused_since: Optional[float] = None  # the first of the refusals in a row
        while not (self._closing.is_set() or self._finishing.is_set() or self.hosts_store):
            if c.term is not None:  # this node won the next term: it leads, nothing to watch
                break
            try:
                address = hot_store(c)
            except ControlError:  # no quorum: the campaign and the stores say it
                time.sleep(0.2)
                continue
            if address != watched:
                if sock is not None:
                    sock.close()
                sock, watched, refused_since = None, address, None
            if not address or address == ended:  # a takeover is under way
                time.sleep(0.05)
                continue
            if sock is None:
                sock, refused = _connect(address)
                if refused:
                    now = time.monotonic()
                    refused_since = now if refused_since is None else refused_since
                    if now - refused_since >= REFUSAL_LASTS_S and self._end_dead_term(address):
                        ended = address
                    else:
                        time.sleep(0.1)  # re-read hot_store, connect again
                    continue
                refused_since = None  # accepted, or no answer: the refusals did not last
                if sock is None:  # a timeout or an unreachable host: no certainty
                    time.sleep(0.2)
                    continue
            try:
                readable, _, _ = select.select([sock], [], [], LEADER_WATCH_S)
                if not readable:
                    continue  # alive (or silent): re-read the address
                closed = sock.recv(64) == b""
            except OSError:  # reset
                closed = True
            if closed:  # the next turn's reconnect tells a dead leader from a closed link
                sock.close()
                sock = None
                time.sleep(0.01)
        if sock is not None:
            sock.close()

    def _end_dead_term(self, address: str) -> bool:
        """The leader's store at ``address`` refused connections for :data:`REFUSAL_LASTS_S`:
        revoke its term's lease if its heartbeat on etcd is stale too (no renewal of its
        lease for over a second; it renews every half second). True when the term is over
        (revoked here, or no longer the one that published ``address``); False when the
        leader's heartbeat is fresh or etcd did not answer (the caller looks again)."""
        import json

        from megatron_mecefo.recovery.etcd_control import ControlError
        from megatron_mecefo.recovery.store_etcd import HOT_STORE

        c = self.control
        assert c is not None
        note = json.dumps({"store": address, "by": self.node, "t": time.time(),
                           "why": "its store refused connections"})  # fmt: skip
        try:
            leader, _ = c.conn.get(c.leader_key)
            if leader is None:
                return True  # no term to end: the campaigns elect the next leader
            silent = c.lease_silent_s(leader.lease)
            if silent is not None and silent < 1:
                return False  # it renewed its lease within the last second: alive
            term = c.end_term_of(HOT_STORE, address, note)
        except ControlError:  # no quorum: the keepalive and the campaign say it, once
            return False
        if term is not None and not self._closing.is_set():
            self.log(
                f"the leader's store at {address} refuses connections (its process is dead): "
                f"revoked the lease of {term.candidate} (term {term.number}); electing the next "
                "leader now"
            )
        return True

    def _take_over_etcd(self) -> None:
        """This node won a term: fence the old store, serve a new one with the state restored
        from etcd, declare the old leader's ranks dead, coordinate, publish the address."""
        import json

        from megatron_mecefo.recovery.etcd_control import Fenced
        from megatron_mecefo.recovery.membership import MembershipStore
        from megatron_mecefo.recovery.store_etcd import (
            HOT_STORE,
            LEADER_NODE,
            hot_store,
            restore,
            run_of,
            run_token,
        )
        from megatron_mecefo.recovery.store_forwarding import PRIMARY_KEY, tcp_client

        c = self.control
        assert c is not None and c.term is not None
        a = self.args
        t0 = time.time()
        run, ours = run_token(c), run_of(self.cfg.store)
        if ours and run != ours:  # the prefix was cleared for another job: not ours to lead
            raise Fenced(f"the etcd key prefix {c.prefix} holds another run now (not run {ours})")
        old = hot_store(c)
        c.put_fenced(HOT_STORE, "")  # from now on no client of the old store writes to etcd
        kv, _ = c.conn.get(c.key(LEADER_NODE))
        old_node = int(kv.value) if kv is not None else 0
        c.put_fenced(LEADER_NODE, str(self.node))
        self.server = serve(a.store_host, 0, self.cfg.init_timeout_s)
        self.hot_address = f"{a.store_host}:{self.server.port}"
        local = MembershipStore(tcp_client(self.hot_address, self.cfg.init_timeout_s))
        number = restore(c, local.store)
        ended = local.get_str("done") or local.get_str("fatal") or local.get_str("stopping")
        if ended or (number >= 0 and local.generation(number).abort):
            self._job_ended("elected leader after the job ended: nothing to take over")
            return
        kv, _ = c.conn.get(c.key("ended"))
        note = json.loads(kv.value) if kv is not None else {}
        revoked = note.get("store") == old and bool(old)
        cause = (
            f"its store refused connections: node {note.get('by')} revoked its etcd lease"
            if revoked
            else "its etcd lease expired"
        )
        self.log(
            f"leader node {old_node} lost ({cause}; its store was {old}); "
            f"this node takes over with a membership store at {self.hot_address} "
            f"(term {c.term.number}, generation {number})"
        )
        nproc = a.nproc_per_node
        for slot in range(old_node * nproc, (old_node + 1) * nproc):
            inc = int(local.get_str(f"inc/{slot}") or 0)
            if local.dead_info(slot, inc) is None:
                info = json.dumps({"exit_code": None, "reason": f"leader node {old_node} lost",
                                   "t": t0, "node": old_node})  # fmt: skip
                info = c.create_fenced(f"kv/dead/{slot}/{inc}", info)  # the first stands
                local.store.set(f"dead/{slot}/{inc}", info)
        # Past any event count a supervisor saw on an earlier store: each then looks again.
        local.store.add("events", (c.term.number + 1) << 20)
        takeover = {"node": self.node, "t": t0, "generation": number, "term": c.term.number,
                    "cause": "revoked" if revoked else "expired"}  # fmt: skip
        local.store.set(PRIMARY_KEY, json.dumps(takeover))
        local.notify()
        self.hosts_store = True
        self._start_coordinator(self.hot_address, resume=True)
        c.put_fenced(HOT_STORE, self.hot_address)
        # The ranks find this store only now: their heartbeats' silence counts from here.
        self.coordinator.restart_heartbeat_clock()

    def _job_ended(self, line: str) -> None:
        """This node won a term after the job ended (a late spare): its supervisor exits 0
        with one line (:attr:`on_job_ended`) instead of calling the old leader's store."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.on_job_ended is not None:
            self.on_job_ended(line)
        else:
            self.log(line)

    def _control_lost(self, line: str) -> None:
        """The leadership or etcd is lost: this node's ranks are stopped and the supervisor
        exits with one line (:attr:`on_control_lost`), having written nothing more."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.on_control_lost is not None:
            self.on_control_lost(line)

    def _start_coordinator(self, address: str, resume: bool) -> None:
        from megatron_mecefo.recovery.coordinator import Coordinator
        from megatron_mecefo.recovery.membership import MembershipStore

        if self.args.store_mode == "etcd":  # the leader's own client, fenced on its term
            from megatron_mecefo.recovery.store_etcd import EtcdStore

            ms = MembershipStore(EtcdStore(self.cfg.store, self.cfg.init_timeout_s,
                                           pinned=address))  # fmt: skip
        else:
            ms = MembershipStore.connect(address, self.cfg.init_timeout_s)
        self._coordinator_store = address
        self.coordinator = Coordinator(
            ms,
            self.world_size,
            self.cfg,
            log=lambda line: print(line, flush=True),
            join_at_boundary_only="--use-distributed-optimizer" in self.args.command,
            on_failure=self._coordinator_failed,
            leader_contact=self.control,
        )
        self.coordinator.start(resume=resume)

    def _coordinator_failed(self, err: BaseException) -> None:
        """The coordinator's thread ended on ``err`` while the job runs (called from it).
        Without it no death would ever make a generation, so it is never left down: in etcd
        mode this node resigns its lease (another node takes over at once, with the state on
        etcd) and stops with one line; with a single store (nobody to take over) the thread
        is restarted from the store's state, each time with one line, at most
        :data:`COORDINATOR_RESTARTS` times, and then the job stops with that line."""
        if self._closing.is_set():
            return
        what = f"{type(err).__name__}: {_first_line(err)}"
        if self.control is not None:
            try:
                self.control.resign()
                handed = "resigned its etcd lease: another node takes over now"
            except Exception:  # noqa: BLE001 (etcd unreachable: the lease expires instead)
                handed = f"its etcd lease expires within {self.control.ttl_s} s: another node "
                handed += "takes over then"
            self._control_lost(f"the coordinator thread failed ({what}); this node {handed}")
            return
        self._coordinator_restarts += 1
        if self._coordinator_restarts > COORDINATOR_RESTARTS:
            line = (f"the coordinator thread failed {self._coordinator_restarts} times, the "
                    f"last with {what}; no generation can be made without it")  # fmt: skip
            self.log(line)
            try:
                assert self.ms is not None
                self.ms.set_fatal(line)
            except Exception:  # noqa: BLE001 (the store itself failed: the ranks see it)
                pass
            return
        self.log(
            f"the coordinator thread failed ({what}); restarted from the store's state "
            f"({self._coordinator_restarts} of {COORDINATOR_RESTARTS})"
        )
        self._start_coordinator(self._coordinator_store, resume=True)

    def _wait_for_store(self) -> None:
        """Until node 0's store accepts a connection: a line every few seconds, and one error
        line naming the address at --init-timeout (a wrong --store used to end in a
        traceback)."""
        host, port = self.cfg.store.strip().rsplit(":", 1)
        try:
            socket.getaddrinfo(host, int(port))
        except OSError as err:
            raise SupervisorError(
                f"--store {self.cfg.store}: cannot resolve the host {host!r} ({err.strerror}); "
                "pass the HOST:PORT node 0's supervisor printed (or wrote to its --store-file)"
            ) from None
        t0 = time.monotonic()
        said = t0 - WAIT_REPORT_S
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=2.0):
                    return
            except OSError as err:
                error = err.strerror or str(err)
            now = time.monotonic()
            if now - t0 >= self.cfg.init_timeout_s:
                raise SupervisorError(
                    f"--store {self.cfg.store}: the membership store did not answer within "
                    f"--init-timeout={self.cfg.init_timeout_s:g}s ({error}); start node 0's "
                    "supervisor first, and pass the HOST:PORT it printed"
                )
            if now - said >= WAIT_REPORT_S:
                said = now
                self.log(f"waiting for the membership store at {self.cfg.store} ({error})")
            time.sleep(0.2)

    def _wait_for_nodes(self) -> None:
        """Node 0: until every node's supervisor has joined the store, a line every few
        seconds naming the joined and the missing nodes; at --init-timeout, one error line
        naming the missing ones (node 0 used to wait past it with no message)."""
        assert self.ms is not None
        nnodes = self.args.nnodes
        t0 = time.monotonic()
        said = t0 - WAIT_REPORT_S
        while True:
            joined = {n: self.ms.get_str(f"node/{n}") for n in range(nnodes)}
            missing = [n for n, host in joined.items() if host is None]
            if not missing:
                if nnodes > 1:
                    self.log(f"all {nnodes} nodes joined")
                return
            names = ", ".join(f"{n} ({host})" for n, host in joined.items() if host is not None)
            now = time.monotonic()
            if now - t0 >= self.cfg.init_timeout_s:
                self.ms.set_fatal(f"nodes {rank_list(missing)} never joined")
                a = self.args
                if a.store_mode == "etcd":  # the nodes find each other by the key prefix
                    how = (
                        f"--store-mode etcd --etcd {','.join(a.etcd_endpoints)} and the same "
                        f"{prefix_source(a)} as this node (key prefix {etcd_prefix(a)})"
                    )
                else:
                    how = f"--store {self.cfg.store}"
                raise SupervisorError(
                    f"node {rank_list(missing)} of --nnodes={nnodes} did not join within "
                    f"--init-timeout={self.cfg.init_timeout_s:g}s (joined: {names}); start "
                    f"its supervisor with --node-rank {missing[0]} {how}, or lower --nnodes"
                )
            if now - said >= WAIT_REPORT_S:
                said = now
                self.log(
                    f"waiting for nodes: joined {names}; missing {rank_list(missing)} "
                    f"({now - t0:.0f} of --init-timeout={self.cfg.init_timeout_s:g}s)"
                )
            time.sleep(0.1)


def etcd_job_id(args: argparse.Namespace) -> str:
    """The job's id on etcd: ``MECEFO_JOB_ID``, else Slurm's job id, else a digest of what
    every node of one job passes alike and two different jobs do not: ``--nnodes``,
    ``--nproc-per-node`` and the trainer's command (``cmd-<12 hex digits>``). Never a flag
    that one node may pass and another not (``--store-port``, ``--store-host``)."""
    job = os.environ.get("MECEFO_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job:
        return job
    what = json.dumps([args.nnodes, args.nproc_per_node, list(args.command)])
    return "cmd-" + hashlib.sha1(what.encode()).hexdigest()[:12]


def etcd_prefix(args: argparse.Namespace) -> str:
    """The job's key prefix on etcd: ``/mecefo/<job id>`` (:func:`etcd_job_id`)."""
    return f"/mecefo/{etcd_job_id(args)}"


def prefix_source(args: argparse.Namespace) -> str:
    """What the job's id comes from, as a message names it (after "the same")."""
    for name in ("MECEFO_JOB_ID", "SLURM_JOB_ID"):
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return "command, --nnodes and --nproc-per-node (no MECEFO_JOB_ID: the prefix is their digest)"


def _ended(ms: "MembershipStore") -> bool:
    """Whether the run whose store ``ms`` reaches has ended (``done`` or ``fatal`` set)."""
    return ms.get_str("done") is not None or ms.get_str("fatal") is not None


def _connect(address: str) -> "tuple[Optional[socket.socket], bool]":
    """(a connection to ``HOST:PORT`` or None, whether it was refused: ECONNREFUSED, the one
    answer that says nothing listens there while the host is up)."""
    host, port = address.rsplit(":", 1)
    try:
        return socket.create_connection((host, int(port)), timeout=LEADER_WATCH_S), False
    except ConnectionRefusedError:
        return None, True
    except OSError:
        return None, False


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
