"""The supervisor: starts one node's ranks, keeps the survivors alive, reports deaths.

    python -m megatron_mecefo.recovery.supervisor --nproc-per-node 4 [--replace immediately] \\
        -- examples/pretrain_gpt/pretrain_gpt.py --mecefo <trainer flags>

Like torchrun it starts ``--nproc-per-node`` processes (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` set), but a rank's death does not tear the others down. The supervisor reaps
the process (waitpid: the death is known at once), writes its rank and exit status to the
membership store, prints one line, and starts a replacement when the policy says so
(``--replace never | immediately | after:SECONDS``). It also SIGKILLs a rank the coordinator
found silent (heartbeat timeout).

Multi-node: one supervisor per node. The first (``--node-rank 0``) hosts the membership store
(a TCPStore on ``--store-port``, 0 = any free port, written to ``--store-file``) and runs the
:mod:`~.coordinator`; the others join with ``--store HOST:PORT``. No training rank hosts the
store, so any rank, rank 0 included, can die. With ``--store-mode replicated`` node 1 serves a
standby store that takes over, with a coordinator of its own, when node 0 is lost
(:mod:`~.store_mirror`), and a new node 0 can rejoin there.

Exit status: 0 when training finished, 1 when it was aborted or could not start (the
one-line reason is printed), 2 on a bad flag or a rank's usage error at start-up, 130 / 143
when stopped by SIGINT / SIGTERM (docs/errors.md lists every error line).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Optional

from megatron_mecefo.errors import (
    ERROR_FILE_ENV,
    UserError,
    check_writable_dir,
    check_writable_file,
)
from megatron_mecefo.recovery.config import ENV, RecoveryConfig, RecoveryConfigError
from megatron_mecefo.recovery.records import append_jsonl
from megatron_mecefo.recovery.replacement import build_replacement
from megatron_mecefo.recovery.store_failover import store_addresses

_QUIET_CPP_LOG = False
"""Whether :func:`main` set ``TORCH_CPP_LOG_LEVEL`` for this process (not for its ranks)."""

PROG = "megatron_mecefo.recovery.supervisor"

WAIT_REPORT_S = 5.0
"""While waiting for nodes or for the store, a line every this many seconds."""


class SupervisorError(UserError):
    """An expected error of the supervisor (a store, a node, a file): one line, exit 1."""

    def __init__(self, message: str) -> None:
        super().__init__(message, usage=False)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (no usage dump), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{PROG}: error: {message} (--help lists the flags)", file=sys.stderr, flush=True)
        sys.exit(2)


class _Signals:
    """SIGINT / SIGTERM: the first asks the supervisor's loop to stop every rank and standby
    (it notes the signal; the loop acts within half a heartbeat interval); a second one kills
    them at once and exits. Neither raises inside the loop (a KeyboardInterrupt used to end in
    a traceback, a second one in a C++ ``terminate called`` abort at interpreter exit)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.supervisor: Optional["Supervisor"] = None

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    @staticmethod
    def code(signum: int) -> int:
        return 128 + signum

    def _handle(self, signum: int, _frame: object) -> None:
        sup = self.supervisor
        running = sup is not None and (sup.children or sup.standby)
        if self.signum is None and running:
            self.signum = signum  # the loop stops the ranks (and lets them save, if they can)
            return
        name = signal.Signals(signum).name
        ended = 0
        if sup is not None:
            for child in [*sup.children.values(), *sup.standby]:
                _kill(child.proc.pid)
                ended += 1
        what = "second " if self.signum is not None else ""
        line = f"stopped by a {what}{name}"
        line += f": {ended} rank and standby processes killed now" if ended else ""
        print(f"[supervisor node {sup.node if sup else 0}] {line}", flush=True)
        os._exit(self.code(self.signum or signum))


SIGNALS = _Signals()


@dataclass
class Child:
    """One rank process of this node."""

    slot: int
    inc: int
    proc: subprocess.Popen
    started: float


class ExitWatch:
    """Sleeps until a child process exits or a timeout passes, on Linux pidfds (no polling:
    the supervisor wakes a few times a second instead of a hundred, and its CPU is taken from
    the ranks on a shared node). Without pidfds (an old kernel) it sleeps in short steps."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self.selector = selectors.DefaultSelector()
        self.fds: Dict[int, int] = {}

    def add(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return  # polled instead
        self.fds[pid] = fd
        self.selector.register(fd, selectors.EVENT_READ, pid)

    def discard(self, pid: int) -> None:
        fd = self.fds.pop(pid, None)
        if fd is not None:
            self.selector.unregister(fd)
            os.close(fd)

    def wait(self, timeout_s: float, pids: List[int]) -> None:
        """Return when one of ``pids`` has exited (readable pidfd) or after ``timeout_s``."""
        if any(pid not in self.fds for pid in pids):
            timeout_s = min(timeout_s, self.poll_s)
        self.selector.select(max(timeout_s, 0.0))


def _die_with_parent() -> None:
    """Child pre-exec: a new session (kill by process group) that dies with the supervisor
    (PR_SET_PDEATHSIG), so killing a node's supervisor takes its ranks with it."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Start one node's training ranks; survive rank deaths (MeCeFO).",
    )
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument(
        "--store",
        default=None,
        metavar="HOST:PORT",
        help="store of node 0; a rejoining node after node 0's loss: HOST:PORT,HOST:PORT (the "
        "primary and the standby, as node 1's --store-file holds them)",
    )
    p.add_argument(
        "--store-host",
        default="127.0.0.1",
        help="node 0 (and node 1's standby store): address to serve on",
    )
    p.add_argument("--store-port", type=int, default=0, help="node 0: 0 = any free port")
    p.add_argument(
        "--store-file",
        default=None,
        help="node 0: write HOST:PORT here; node 1 with --store-mode replicated: the primary's "
        "and the standby's, HOST:PORT,HOST:PORT",
    )
    p.add_argument(
        "--store-mode",
        default="single",
        choices=("single", "replicated"),
        help="single: node 0 alone serves the membership store (its loss ends the job); "
        "replicated: node 1 serves a standby that takes over when node 0 is lost (every node "
        "passes the same mode; needs --nnodes >= 2)",
    )
    d = RecoveryConfig()
    p.add_argument("--replace", default=d.replace, help="never | immediately | after:SECONDS")
    p.add_argument("--orphan", default=d.orphan, choices=("wait", "exit"))
    p.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval_s)
    p.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s)
    p.add_argument("--collective-timeout", type=float, default=d.collective_timeout_s)
    p.add_argument("--init-timeout", type=float, default=d.init_timeout_s)
    p.add_argument("--join-margin", type=int, default=d.join_margin_iterations)
    p.add_argument("--records", default=None, help="JSONL file for the recovery records")
    p.add_argument("--max-replacements", type=int, default=8, help="per slot")
    p.add_argument(
        "--replace-ranks",
        default=None,
        metavar="R1,R2,...",
        help="only these (original) ranks get replacements; default: every rank",
    )
    p.add_argument("--pid-file", default=None, help="append 'SLOT INCARNATION PID' per rank")
    p.add_argument(
        "--standby",
        type=int,
        default=0,
        help="warm standby processes per node (imported, waiting): a replacement then takes "
        "over a dead rank's slot in about a second instead of a cold start",
    )
    p.add_argument(
        "--rejoin",
        action="store_true",
        help="this node replaces a lost one in a running job (same --node-rank, --store of "
        "node 0): its ranks start as the next incarnation once the old ones are known dead",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py [args]")
    return p


class Supervisor:
    """See the module docstring."""

    def __init__(self, args: argparse.Namespace, config: RecoveryConfig) -> None:
        self.args = args
        self.cfg = config
        self.replacement = build_replacement(config.replace)
        self.node = args.node_rank
        self.world_size = args.nnodes * args.nproc_per_node
        self.slots = list(
            range(self.node * args.nproc_per_node, (self.node + 1) * args.nproc_per_node)
        )
        self.children: Dict[int, Child] = {}
        self.pending: List[tuple] = []  # (start_at, slot, inc)
        self.replacements: Dict[int, int] = {s: 0 for s in self.slots}
        self.server = None
        self.coordinator = None
        self.standby_store = None  # node 1 in the replicated mode: a StandbyStore
        self.hosts_store = self.node == 0 and not args.rejoin
        """Whether this node's supervisor serves the store the job uses now (and so waits for
        the other nodes before it exits): node 0, or node 1 once its standby took over."""
        self.killed: Dict[tuple, float] = {}
        self.standby: List[Child] = []
        self._standby_count = 0
        self.exits = ExitWatch(config.poll_interval_s)
        self._generation: Optional[tuple] = None  # (number, its abort reason)
        self._events_seen = -1
        self._steady: Optional[tuple] = None  # (CPU seconds, iteration) once training runs
        self.stopping: Optional[int] = None  # the signal that stops this node, once acted on
        self.stop_deadline = 0.0  # then: when the ranks that still run are killed
        self.startup_code: Optional[int] = None  # a rank of this node failed at start-up
        self.error_dir = ""  # where ranks leave their error lines (made by run)

    def log(self, line: str) -> None:
        print(f"[supervisor node {self.node}] {line}", flush=True)

    # ------------------------------------------------------------------ store
    def open_store(self) -> None:
        a = self.args
        if not self.hosts_store:  # before importing torch: a wrong address is said in a second
            self.cfg.store = a.store
            self._wait_for_store()
        import torch.distributed as dist

        from megatron_mecefo.recovery.membership import MembershipStore

        if self.hosts_store:
            try:
                self.server = dist.TCPStore(
                    a.store_host,
                    a.store_port,
                    None,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=self.cfg.init_timeout_s),
                )
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
        if a.store_mode == "replicated" and len(store_addresses(self.cfg.store)) == 1:
            self._open_standby()
        # For trainers without MeCeFO's session (e.g. Megatron-LM's pretrain_gpt.py): a
        # torchrun-style env:// rendezvous on a second store of node 0 (agent-store mode).
        if self.hosts_store:
            self.rdzv = dist.TCPStore(a.store_host, 0, None, is_master=True,
                                      wait_for_workers=False)  # fmt: skip
            self.ms.store.set("rdzv", f"{a.store_host}:{self.rdzv.port}")
        deadline = time.monotonic() + self.cfg.init_timeout_s
        while (rdzv := self.ms.get_str("rdzv")) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.rdzv_address = rdzv or "127.0.0.1:0"
        if self.hosts_store:
            self.ms.set_json("world_size", self.world_size)
            self._wait_for_nodes()
            self._start_coordinator(self.cfg.store, resume=False)

    def _start_coordinator(self, address: str, resume: bool) -> None:
        from megatron_mecefo.recovery.coordinator import Coordinator
        from megatron_mecefo.recovery.membership import MembershipStore

        self.coordinator = Coordinator(
            MembershipStore.connect(address, self.cfg.init_timeout_s),
            self.world_size,
            self.cfg,
            log=lambda line: print(line, flush=True),
            join_at_boundary_only="--use-distributed-optimizer" in self.args.command,
        )
        self.coordinator.start(resume=resume)

    def _open_standby(self) -> None:
        """The replicated mode: node 1 serves the standby store and mirrors node 0's into it;
        every node then hands its ranks both addresses (they fail over on node 0's loss)."""
        from megatron_mecefo.recovery.membership import MembershipStore
        from megatron_mecefo.recovery.store_mirror import StandbyStore, wait_for_standby

        a = self.args
        primary = self.cfg.store
        if self.node == 1 and not a.rejoin:
            try:
                self.standby_store = StandbyStore(
                    a.store_host, 0, primary, a.nnodes, a.nproc_per_node, self.cfg, self.log,
                    on_takeover=self._take_over,
                )  # fmt: skip
            except Exception as err:  # noqa: BLE001 (torch's DistNetworkError and kin)
                raise SupervisorError(
                    f"--store-mode replicated: cannot serve the standby store on "
                    f"{a.store_host} ({_first_line(err)}); pass --store-host with this node's "
                    "hostname or address"
                ) from None
            self.ms.store.set("standby", self.standby_store.address)
            self.standby_store.start()
            self.log(f"standby membership store at {self.standby_store.address}")
        standby = wait_for_standby(self.ms, self.cfg.init_timeout_s)
        if standby is None:
            raise SupervisorError(
                f"--store-mode replicated: node 1 published no standby store within "
                f"--init-timeout={self.cfg.init_timeout_s:g}s; start node 1's supervisor with "
                "--store-mode replicated too"
            )
        self.cfg.store = f"{primary},{standby}"
        self.ms = MembershipStore.connect(self.cfg.store, self.cfg.init_timeout_s)
        if self.node == 1 and a.store_file:
            _write_atomically(a.store_file, self.cfg.store)

    def _take_over(self) -> None:
        """Node 1, on the standby's thread: node 0 is lost; coordinate from the standby."""
        self.hosts_store = True
        assert self.standby_store is not None
        self._start_coordinator(self.standby_store.address, resume=True)

    def _wait_for_store(self) -> None:
        """Until node 0's store accepts a connection: a line every few seconds, and one error
        line naming the address at --init-timeout (a wrong --store used to end in a
        traceback)."""
        # A list (a node rejoining after node 0's loss): the standby, which serves now.
        host, port = store_addresses(self.cfg.store)[-1].rsplit(":", 1)
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
                self.ms.set_fatal(f"nodes {_ranks(missing)} never joined")
                raise SupervisorError(
                    f"node {_ranks(missing)} of --nnodes={nnodes} did not join within "
                    f"--init-timeout={self.cfg.init_timeout_s:g}s (joined: {names}); start "
                    f"its supervisor with --node-rank {missing[0]} --store {self.cfg.store}, or "
                    "lower --nnodes"
                )
            if now - said >= WAIT_REPORT_S:
                said = now
                self.log(
                    f"waiting for nodes: joined {names}; missing {_ranks(missing)} "
                    f"({now - t0:.0f} of --init-timeout={self.cfg.init_timeout_s:g}s)"
                )
            time.sleep(0.1)

    # ------------------------------------------------------------------ processes
    def spawn(self, slot: int, inc: int) -> None:
        """Start rank ``slot`` (incarnation ``inc``), from a warm standby when one is up."""
        self.ms.store.set(f"inc/{slot}", str(inc))
        if self.standby and inc > 0:
            child = self.standby.pop(0)
            self.ms.set_json(f"assign/{self.node}/{child.slot}", self.assignment(slot, inc))
            self.children[slot] = Child(slot, inc, child.proc, time.time())
            self.ms.set_json(f"pid/{slot}/{inc}", {"pid": child.proc.pid, "node": self.node})
            self._log_pid(slot, inc, child.proc.pid)
            self.log(f"standby pid {child.proc.pid} replaces rank {slot} (incarnation {inc})")
            self.spawn_standby()
            return
        self._start(slot, inc)
        if inc:
            self.log(f"started a replacement for rank {slot} (incarnation {inc})")

    def assignment(self, slot: int, inc: int) -> Dict[str, int]:
        """What a warm standby becomes: rank ``slot``, incarnation ``inc``, and the slot's
        ``LOCAL_RANK`` on this node (its device), as a rank started for the slot has."""
        return {"slot": slot, "inc": inc, "local_rank": self._local_rank(slot)}

    def _local_rank(self, slot: int) -> int:
        return slot - self.slots[0]

    def spawn_standby(self) -> None:
        """A process that imports everything and waits for ``assign/<node>/<id>``."""
        sid = self._standby_count
        self._standby_count += 1
        proc = self._start(-1, 0, standby=sid)
        self.standby.append(Child(sid, 0, proc, time.time()))

    def _log_pid(self, slot: int, inc: int, pid: int) -> None:
        if self.args.pid_file:
            with open(self.args.pid_file, "a") as f:
                f.write(f"{slot} {inc} {pid}\n")

    def _start(self, slot: int, inc: int, standby: Optional[int] = None) -> subprocess.Popen:
        env = dict(os.environ)
        if _QUIET_CPP_LOG:
            del env["TORCH_CPP_LOG_LEVEL"]
        env.update(
            RANK=str(slot),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self._local_rank(slot)),
            LOCAL_WORLD_SIZE=str(len(self.slots)),
            MASTER_ADDR=self.rdzv_address.rsplit(":", 1)[0],
            MASTER_PORT=self.rdzv_address.rsplit(":", 1)[1],
            TORCHELASTIC_USE_AGENT_STORE="True",
            MECEFO_RECOVERY_SLOT=str(slot),
            MECEFO_RECOVERY_INC=str(inc),
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            PYTHONUNBUFFERED="1",
        )
        env[ENV] = self.cfg.to_env()
        env[ERROR_FILE_ENV] = self.error_dir
        if standby is not None:
            env["MECEFO_RECOVERY_STANDBY"] = f"{self.node}/{standby}"
            env["LOCAL_RANK"] = "-1"  # no device until a slot is assigned (await_assignment)
        proc = subprocess.Popen(
            [sys.executable, *self.command], env=env, preexec_fn=_die_with_parent
        )
        self.exits.add(proc.pid)
        self._log_pid(slot if standby is None else -1 - standby, inc, proc.pid)
        if standby is None:
            self.children[slot] = Child(slot, inc, proc, time.time())
            self.ms.set_json(f"pid/{slot}/{inc}", {"pid": proc.pid, "node": self.node})
        return proc

    def _reap(self) -> None:
        for slot, child in list(self.children.items()):
            code = child.proc.poll()
            if code is None:
                continue
            del self.children[slot]
            self.exits.discard(child.proc.pid)
            # What the rank left in its process group (e.g. the multiprocessing helpers of a
            # checkpoint save: a supervised rank ends with os._exit, before their finalizers)
            # would hold the launcher's stdout open: Slurm's srun step would never end.
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            finished = self.ms.get_str("done") is not None
            info = {
                "exit_code": code,
                "signal": signal.Signals(-code).name if code < 0 else None,
                "t": time.time(),
                "node": self.node,
                "pid": child.proc.pid,
            }
            if code == 0 and (finished or self.ms.get_str(f"left/{slot}/{child.inc}") is None):
                continue  # a normal exit
            why = info["signal"] or f"exit code {code}"
            if self.stopping is not None:  # stopped by a signal: a death is no failure now
                if self._saving():  # died during its save: said and reported, not recovered
                    self.log(f"rank {slot} (pid {child.proc.pid}) died while stopping: {why}")
                    self.ms.report_dead(slot, child.inc, info)  # the coordinator ends the job
                continue
            startup = self._startup_failure(slot, child.proc.pid, code)
            if startup is not None:
                if self.ms.get_str("fatal") is None:
                    self.ms.set_fatal(startup)
                self.startup_code = 2 if code == 2 else 1
                return
            self.ms.report_dead(slot, child.inc, info)
            if self.ms.get_str("layout") is None and self.ms.get_str("fatal") is None:
                # No rank runs megatron_mecefo.recovery.session (yet): nothing can regroup.
                # Which of the two it is cannot be told from here: say both.
                self.ms.set_fatal(
                    f"rank {slot} (pid {child.proc.pid}) died: {why}, and no rank runs MeCeFO's "
                    "in-process recovery (megatron_mecefo.recovery.session: the example trainer "
                    "and Megatron-LM's pretrain_gpt.py with patches/megatron-lm-*.patch run it), "
                    "so every rank is stopped now instead of hanging until the collective "
                    "timeout. If it failed at start-up, its output is above: fix it and launch "
                    "again. If this trainer does not run MeCeFO's in-process recovery, resume "
                    "from the last checkpoint: relaunch with --load <your --save directory>",
                )
                return
            progress = self.ms.get_str("progress")
            when = (
                f"in training (after iteration {progress})"
                if progress
                else "before its first iteration"
            )
            said = self._error_line(slot)  # an expected error after training started
            self.log(
                f"rank {slot} (pid {child.proc.pid}, incarnation {child.inc}) died: {why} {when}"
                + (f" ({said})" if said else "")
                + "; reported to the membership store"
            )
            delay = self.replacement.delay_s(slot)
            if self.args.replace_ranks and slot not in self.args.replace_ranks:
                delay = None
            if delay is not None and not finished and self._abort() is None:
                if self.replacements[slot] < self.args.max_replacements:
                    self.replacements[slot] += 1
                    self.pending.append((time.monotonic() + delay, slot, child.inc + 1))

    def _startup_failure(self, slot: int, pid: int, code: int) -> Optional[str]:
        """The line for a rank that exited before training started (no iteration committed)
        with an expected error (its line, from ``MECEFO_ERROR_DIR``) or a usage exit (2);
        None for a death in training. A start-up failure has nothing to resume."""
        if self.ms.get_str("progress") is not None:
            return None
        line = self._error_line(slot)
        if line is None and code != 2:
            return None
        what = line or "a usage error (exit code 2; the rank's output is above)"
        return (
            f"start-up failure: rank {slot} (pid {pid}) exited with code {code} before "
            f"training started: {what} -- nothing to resume: fix it and launch again"
        )

    def _error_line(self, slot: int) -> Optional[str]:
        """The error line rank ``slot`` left instead of printing it (``errors.fail``)."""
        try:
            with open(os.path.join(self.error_dir, f"{slot}.err")) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def _rejoin_incarnation(self, slot: int) -> int:
        """The incarnation a rejoining node starts ``slot`` as: one above the last, once that
        one is known dead (reported by its supervisor, or declared by the coordinator after
        two heartbeat timeouts when the supervisor died with it). It waits as long as the
        job runs, so a hot spare can be started before any failure."""
        said = False
        while True:
            if self._abort() is not None or self.ms.get_str("done") is not None:
                self.log(f"rejoin: rank {slot} not started: the job has already ended")
                raise SystemExit(1)
            inc = int(self.ms.get_str(f"inc/{slot}") or 0)
            if self.ms.dead_info(slot, inc) is not None:
                self.replacements[slot] += 1
                self.log(f"rejoin: rank {slot} starts as incarnation {inc + 1}")
                return inc + 1
            if not said:
                said = True
                self.log(f"rejoin: waiting until rank {slot} (incarnation {inc}) is known dead")
            time.sleep(0.2)

    def _kill_requests(self) -> None:
        for slot, child in self.children.items():
            key = (slot, child.inc)
            if key in self.killed:
                continue
            if self.ms.get_str(f"kill/{slot}/{child.inc}") is not None:
                self.killed[key] = time.time()
                self.log(f"SIGKILL rank {slot} (pid {child.proc.pid}): heartbeat timeout")
                _kill(child.proc.pid)

    def _abort(self) -> Optional[str]:
        fatal = self.ms.get_str("fatal")
        if fatal:
            return fatal
        number = self.ms.generation_number()
        if number < 0:
            return None
        if self._generation is None or self._generation[0] != number:  # published once
            self._generation = (number, self.ms.generation(number).abort)
        return self._generation[1]

    def run(self) -> int:
        self.t_start = time.monotonic()
        self.error_dir = tempfile.mkdtemp(prefix="mecefo_errors_")
        self.open_store()
        self.command = self.args.command
        if self.args.rejoin:
            # Standbys first: they import while the node waits for its old ranks' death, and
            # then take the slots in about a second (a hot spare node).
            for _ in range(self.args.standby):
                self.spawn_standby()
        for slot in self.slots:
            self.spawn(slot, self._rejoin_incarnation(slot) if self.args.rejoin else 0)
        for _ in range(0 if self.args.rejoin else self.args.standby):
            self.spawn_standby()
        last_kill_check = 0.0
        try:
            while True:
                if SIGNALS.signum is not None and self.stopping is None:
                    self._begin_stop(SIGNALS.signum)
                if self.stopping is not None and not self.children:
                    return self._end_stop()
                if self.stopping is not None and time.monotonic() > self.stop_deadline:
                    for child in self.children.values():  # past the grace: no save now
                        _kill(child.proc.pid)
                self._reap()
                now = time.monotonic()
                for item in [p for p in self.pending if p[0] <= now]:
                    self.pending.remove(item)
                    self.spawn(item[1], item[2])
                if now - last_kill_check > self.cfg.heartbeat_interval_s / 2:
                    last_kill_check = now
                    self._note_steady_cpu()
                    # Kill requests, new generations and a fatal error are events: one round
                    # trip when nothing happened.
                    events = self.ms.events()
                    if events != self._events_seen:
                        self._events_seen = events
                        self._kill_requests()
                        abort = self._abort()
                        if abort and self.stopping is None:
                            return self._aborted(abort)
                for child in list(self.standby):
                    if self.stopping is not None:
                        break
                    if child.proc.poll() is not None:  # a standby that died: start another
                        self.standby.remove(child)
                        self.exits.discard(child.proc.pid)
                        self.spawn_standby()
                if not self.children and self.pending and self.ms.get_str("done") is not None:
                    # A rank died after the last iteration: its replacement (due in --replace
                    # seconds) would have nothing to do, and the node would wait for it.
                    self.pending.clear()
                if not self.children and not self.pending and self.stopping is None:
                    if self.ms.get_str("done") is not None:
                        return self._finish_node()
                    if self.ms.get_str("layout") is None and self._abort() is None:
                        # A trainer without MeCeFO's session (Megatron-LM): no rank sets
                        # "done"; every rank of this node exited 0 and none died (no fatal).
                        return self._finish_node()
                    deadline = time.monotonic() + self.cfg.heartbeat_timeout_s
                    while time.monotonic() < deadline:  # the coordinator's verdict, if any
                        abort = self._abort()
                        if abort:
                            return self._aborted(abort)
                        time.sleep(0.05)
                    self.log("every rank of this node has exited and training is not done")
                    return 1
                # Until a child exits, the next replacement is due or the next store check.
                now = time.monotonic()
                wake = last_kill_check + self.cfg.heartbeat_interval_s / 2
                wake = min([wake, *(p[0] for p in self.pending)]) - now
                pids = [c.proc.pid for c in [*self.children.values(), *self.standby]]
                self.exits.wait(wake, pids)
        finally:
            everyone = list(self.children.values()) + self.standby
            for child in everyone:
                _kill(child.proc.pid)
            for child in everyone:
                child.proc.wait()
            if self.coordinator is not None:
                self.coordinator.stop()
            if self.standby_store is not None:
                self.standby_store.stop()
            self._record_cost()

    def _aborted(self, abort: str) -> int:
        """The last line of an aborted job; a start-up failure is an error line of its own."""
        if abort.startswith("start-up failure"):
            print(f"{PROG}: error: {abort}", file=sys.stderr, flush=True)
            return self.startup_code or 1
        self.log(f"training aborted: {abort}")
        return 1

    def _begin_stop(self, signum: int) -> None:
        """The first SIGINT / SIGTERM: a trainer with --exit-signal-handler gets SIGTERM and
        saves at its next iteration boundary (its deaths are not recovered meanwhile); any
        other is stopped now. Standbys go at once, and the other nodes are told."""
        self.stopping = signum
        self.pending.clear()
        for child in self.standby:
            _kill(child.proc.pid)
        name = signal.Signals(signum).name
        try:
            self.ms.store.set("stopping", name)
            if self.node == 0 and self.ms.get_str("fatal") is None and not self._saving():
                self.ms.set_fatal(f"stopped by {name} on node 0")
        except Exception:  # noqa: BLE001 (node 0's store may be gone; stop this node anyway)
            pass
        if self._saving():
            self.log(
                f"{name}: passing SIGTERM to {len(self.children)} ranks (--exit-signal-handler:"
                " they save at the next iteration boundary and exit); a second signal kills now"
            )
            for child in self.children.values():
                try:
                    os.kill(child.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            self.stop_deadline = time.monotonic() + STOP_GRACE_S
        else:
            for child in self.children.values():
                _kill(child.proc.pid)
            self.stop_deadline = time.monotonic()

    def _saving(self) -> bool:
        return "--exit-signal-handler" in self.command

    def _end_stop(self) -> int:
        name = signal.Signals(self.stopping).name
        n = len(self.slots)
        if self._saving() and self._done():
            self.log(f"stopped by {name}: {n} ranks saved and exited (--exit-signal-handler)")
            return 0
        if self._saving():
            self.log(
                f"stopped by {name}: {n} ranks ended before their save completed (a rank died "
                "while stopping, or the grace ran out); the last complete checkpoint is kept"
            )
            return SIGNALS.code(self.stopping)
        self.log(
            f"stopped by {name}: {n} ranks and {len(self.standby)} standbys ended; nothing saved "
            "since the last checkpoint (the trainer's --exit-signal-handler --save DIR saves "
            "first)"
        )
        return SIGNALS.code(self.stopping)

    def _done(self) -> bool:
        try:
            return self.ms.get_str("done") is not None
        except Exception:  # noqa: BLE001
            return False

    def _note_steady_cpu(self) -> None:
        """Once training is past its first iterations (imports, connecting, compiling), note
        this process's CPU and the iteration, so :meth:`_record_cost` can give the CPU of the
        armed supervisor per iteration without its start-up."""
        if self._steady is None and self.cfg.records_file:
            progress = int(self.ms.get_str("progress") or 0)
            if progress >= STEADY_FROM_ITERATION:
                self._steady = (_cpu_s(), progress)

    def _record_cost(self) -> None:
        """The supervisor's own CPU (its loop, the coordinator and, on node 0, the store's
        server thread), for the armed-cost account of ``benchmarks/recovery_latency.py``."""
        if not self.cfg.records_file:
            return
        record = {"type": "supervisor_cost", "node": self.node, "cpu_s": _cpu_s(),
                  "wall_s": time.monotonic() - self.t_start}  # fmt: skip
        if self._steady is not None:
            try:  # node 0's store may be gone already (this node finished after it)
                last = int(self.ms.get_str("progress") or 0)
            except Exception:  # noqa: BLE001 (a statistic, never a reason to fail the exit)
                last = None
            if last is not None:
                record["steady"] = {"cpu_s": record["cpu_s"] - self._steady[0],
                                    "iterations": last - self._steady[1]}  # fmt: skip
        append_jsonl(self.cfg.records_file, record)

    def _finish_node(self) -> int:
        """Every rank of this node finished; the store's host keeps it up for the others (a
        lost node 0 counts as done)."""
        if self.standby_store is not None and not self.hosts_store:
            self.standby_store.stop()  # node 0 closes its store once every node is done
        self.ms.store.add("nodes_done", 1)
        if self.hosts_store:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                done = int(self.ms.store.add("nodes_done", 0))
                if done + int(self.ms.store.add("nodes_lost", 0)) >= self.args.nnodes:
                    break
                time.sleep(0.05)
        return 0


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _check_port_free(host: str, port: int) -> None:
    """Node 0's store port, tried before torch is imported (the store's own bind error, later,
    covers a port taken in between)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds
        try:
            probe.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise SupervisorError(
                    f"--store-port {port}: the address {host}:{port} is already in use "
                    "(another job or supervisor?); pass another --store-port, or 0 for any "
                    "free port"
                ) from None
            raise SupervisorError(
                f"--store-host {host}: cannot serve the membership store at {host}:{port} "
                f"({err.strerror}); pass a --store-host of this machine (its hostname or one "
                "of its addresses)"
            ) from None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _ranks(numbers: List[int]) -> str:
    return ", ".join(str(n) for n in numbers)


STOP_GRACE_S = 120.0
"""How long ranks with --exit-signal-handler get to save and exit before they are killed."""

STEADY_FROM_ITERATION = 5
"""The armed-cost account leaves out the iterations before this one (start-up)."""


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the child leads its own session
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    args.command = command
    try:
        cfg = validate(args)
    except UserError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    global _QUIET_CPP_LOG
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:
        # The supervisor uses torch for the store alone. Its coordinator waits in the store
        # between heartbeat checks, and c10 logs two warnings at each wait that times out
        # (twice a second). Its ranks keep the user's setting (Supervisor._start).
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        _QUIET_CPP_LOG = True
    supervisor = Supervisor(args, cfg)
    SIGNALS.supervisor = supervisor
    try:
        return supervisor.run()
    except SupervisorError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    finally:
        if supervisor.error_dir:
            shutil.rmtree(supervisor.error_dir, ignore_errors=True)


def validate(args: argparse.Namespace) -> RecoveryConfig:
    """Every flag against the others and the world, before any process starts.

    Raises:
        RecoveryConfigError: A bad flag (exit 2); the message names it and the fix.
    """
    command = args.command
    if not command:
        raise RecoveryConfigError("no command: add -- script.py [args] after the flags")
    if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise RecoveryConfigError(
            f"--nproc-per-node={args.nproc_per_node} --nnodes={args.nnodes} --node-rank="
            f"{args.node_rank}: need >= 1 process, >= 1 node and 0 <= node rank < nodes"
        )
    world = args.nproc_per_node * args.nnodes
    if args.replace_ranks:
        try:
            ranks = {int(r) for r in args.replace_ranks.split(",")}
        except ValueError:
            raise RecoveryConfigError(
                f"--replace-ranks={args.replace_ranks}: expected comma-separated ranks"
            ) from None
        bad = sorted(r for r in ranks if not 0 <= r < world)
        if bad:
            raise RecoveryConfigError(
                f"--replace-ranks={args.replace_ranks}: rank {_ranks(bad)} does not exist "
                f"(world size {world}: ranks 0..{world - 1}); name existing ranks"
            )
        if args.replace == "never":
            raise RecoveryConfigError(
                f"--replace-ranks={args.replace_ranks} has no effect with --replace never; add "
                "--replace immediately or --replace after:SECONDS"
            )
        args.replace_ranks = ranks
    for flag, value in (("--max-replacements", args.max_replacements),
                        ("--standby", args.standby)):  # fmt: skip
        if value < 0:
            raise RecoveryConfigError(f"{flag}={value}: must be >= 0; pass 0 or more")
    if not 0 <= args.store_port <= 65535:
        raise RecoveryConfigError(
            f"--store-port={args.store_port}: not a TCP port; pass 1..65535, or 0 for any free one"
        )
    if args.node_rank == 0 and args.store_port:
        _check_port_free(args.store_host, args.store_port)
    if args.store is not None:
        addresses = store_addresses(args.store)
        for address in addresses:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise RecoveryConfigError(
                    f"--store {args.store}: expected HOST:PORT of node 0's membership store (as "
                    "its supervisor prints it, or its --store-file holds)"
                )
        if len(addresses) > 2 or (len(addresses) == 2 and not args.rejoin):
            raise RecoveryConfigError(
                f"--store {args.store}: two addresses (primary,standby) are for a node that "
                "rejoins after node 0's loss (--rejoin); pass node 0's HOST:PORT otherwise"
            )
    if args.store_mode == "replicated" and args.nnodes < 2:
        raise RecoveryConfigError(
            f"--store-mode replicated --nnodes={args.nnodes}: the standby store lives on node "
            "1; use --store-mode single on one node"
        )
    if args.rejoin and not args.store:
        raise RecoveryConfigError(
            f"--rejoin --node-rank={args.node_rank}: a rejoining node needs --store: node 0's "
            "HOST:PORT, or after node 0's loss (--store-mode replicated) the primary's and the "
            "standby's HOST:PORT,HOST:PORT that node 1's --store-file holds"
        )
    if args.rejoin and args.node_rank == 0 and args.store_mode != "replicated":
        raise RecoveryConfigError(
            "--rejoin --node-rank=0: node 0 hosts the store in --store-mode single, so it "
            "cannot be lost and come back; run every node with --store-mode replicated"
        )
    if args.node_rank > 0 and not args.store:
        raise RecoveryConfigError(
            f"--node-rank={args.node_rank} needs --store HOST:PORT (node 0's store)"
        )
    if args.node_rank == 0 and args.store and not args.rejoin:
        raise RecoveryConfigError(
            f"--store {args.store} with --node-rank 0: node 0 hosts the store (--store-host, "
            "--store-port); drop --store, or pass the node rank of this node"
        )
    script = command[0]
    if script != "-m" and script.endswith(".py") and not os.path.isfile(script):
        raise RecoveryConfigError(
            f"{script}: no such file (the command after --); pass the trainer's path, e.g. "
            "-- examples/pretrain_gpt/pretrain_gpt.py"
        )
    for flag, path in (("--records", args.records), ("--pid-file", args.pid_file)):
        if path:
            check_writable_file(flag, path)
    if args.store_file:
        check_writable_dir("--store-file", os.path.dirname(os.path.abspath(args.store_file)))
    return RecoveryConfig(
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        collective_timeout_s=args.collective_timeout,
        init_timeout_s=args.init_timeout,
        replace=args.replace,
        orphan=args.orphan,
        join_margin_iterations=args.join_margin,
        records_file=os.path.abspath(args.records) if args.records else None,
    ).validate()


if __name__ == "__main__":
    SIGNALS.install()  # before anything slow: a Ctrl-C now is one line too
    threading.current_thread().name = "supervisor"
    sys.exit(main())
