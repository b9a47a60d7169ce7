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
store, so any rank, rank 0 included, can die. With ``--store-mode etcd --etcd HOST:PORT,...``
the supervisors elect a leader on etcd that serves the store and coordinates; any node, the
leader's included, can be lost, again and again, while etcd keeps a quorum
(:mod:`~.store_etcd`), and a new node 0 can rejoin.

This module is the supervisor's loop: it starts, reaps and replaces the ranks of its node and
acts on the store's events. Its other roles have a module each: the flags and their checks
(:mod:`.supervisor_args`), starting, watching and killing processes (:mod:`.processes`),
SIGINT / SIGTERM (:mod:`.signals`), hosting or joining the membership store (etcd mode: the
election and the takeover) and the coordinator (:mod:`.store_host`), and its own CPU for the
armed-cost account (:mod:`.cost_account`).

Exit status: 0 when training finished, 1 when it was aborted or could not start (the
one-line reason is printed), 2 on a bad flag or a rank's usage error at start-up, 130 / 143
when stopped by SIGINT / SIGTERM (docs/errors.md lists every error line).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Dict, List, Optional

from megatron_mecefo.errors import ERROR_FILE_ENV, UserError
from megatron_mecefo.recovery import node_vote_host
from megatron_mecefo.recovery.config import ENV, RecoveryConfig
from megatron_mecefo.recovery.coordinator import hold_liveness
from megatron_mecefo.recovery.cost_account import STEADY_FROM_ITERATION, SupervisorCost
from megatron_mecefo.recovery.heartbeat import BEAT_DIR_ENV, SUPERVISOR_ENV, Heartbeat
from megatron_mecefo.recovery.processes import (
    Child,
    ExitWatch,
    kill,
    kill_group,
    quiet_cpp_log,
    rank_environment,
    start_process,
)
from megatron_mecefo.recovery.replacement import build_replacement
from megatron_mecefo.recovery.signals import SIGNALS
from megatron_mecefo.recovery.store_host import WAIT_REPORT_S, StoreHost
from megatron_mecefo.recovery.supervisor_args import (
    PROG,
    SupervisorError,
    build_parser,
    validate,
)

if TYPE_CHECKING:
    from megatron_mecefo.recovery.membership import MembershipStore

__all__ = [
    "PROG",
    "SIGNALS",
    "STEADY_FROM_ITERATION",
    "STOP_GRACE_S",
    "WAIT_REPORT_S",
    "Child",
    "ExitWatch",
    "Supervisor",
    "SupervisorError",
    "build_parser",
    "main",
    "validate",
]

STOP_GRACE_S = 120.0
"""How long ranks with --exit-signal-handler get to save and exit before they are killed."""


class Supervisor:
    """See the module docstring."""

    ms: "MembershipStore"
    """This supervisor's client of the membership store (set by :meth:`open_store`)."""

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
        self.store_host = StoreHost(args, config, self.log)
        self.store_host.on_control_lost = self._control_lost
        self.store_host.on_job_ended = self._job_ended
        self.killed: Dict[tuple, float] = {}
        self.standby: List[Child] = []
        self._standby_count = 0
        self.exits = ExitWatch(config.poll_interval_s)
        self._generation: Optional[tuple] = None  # (number, its abort reason)
        self._events_seen = -1
        self.cost = SupervisorCost(config.records_file, self.node)
        self.stopping: Optional[int] = None  # the signal that stops this node, once acted on
        self.stop_deadline = 0.0  # then: when the ranks that still run are killed
        self.startup_code: Optional[int] = None  # a rank of this node failed at start-up
        self.error_dir = ""  # where ranks leave their error lines (made by run)
        self.id = f"{self.node}@{socket.gethostname()}:{os.getpid()}"
        """Names this supervisor's heartbeat, which its ranks name in their ``ready`` key."""
        self.beat: Optional[Heartbeat] = None
        self.beat_dir = ""
        """Where this node's ranks beat (:data:`BEAT_DIR_ENV`); this supervisor's beat writes
        their counts and its own to one store key (``hb/node/<id>``)."""
        self._liveness_stop = threading.Event()

    def log(self, line: str) -> None:
        print(f"[supervisor node {self.node}] {line}", flush=True)

    def _control_lost(self, line: str) -> None:
        """``--store-mode etcd``, from a background thread: this node was deposed (its lease
        expired: hung, cut off), lost etcd, or its coordinator failed. Its ranks are killed
        at once and the supervisor exits with one line (:func:`control_lost_line`), so
        nothing more is written by this node."""
        self.log(control_lost_line(line, self._kill_everyone()))
        os._exit(1)  # the main thread may be in a store call to a lost store: no unwinding

    def _kill_everyone(self) -> int:
        """SIGKILL every rank and standby of this node (and what they started); how many."""
        everyone = list(self.children.values()) + list(self.standby)
        for child in everyone:
            kill_group(child.proc.pid)
            kill(child.proc.pid)
        return len(everyone)

    def _watch_declared_dead(self) -> None:
        """``--store-mode etcd``, a thread: a node cut off from the leader but not from etcd
        is declared dead by the leader (its supervisor and ranks fell silent there), while
        its own calls to the leader's store hang. It learns it from etcd: once every rank
        this node holds is recorded dead by someone else (no exit code: the coordinator or
        a takeover), it stops with one line and exits 1 (its writes are refused anyway)."""
        from megatron_mecefo.recovery.etcd_control import ControlError

        c = self.store_host.control
        assert c is not None
        while True:
            time.sleep(self.cfg.heartbeat_interval_s)
            if self.stopping is not None:
                return
            # Every rank this supervisor holds, exited ones too: cut off from the leader, a
            # rank fails its collectives and exits while the main loop hangs in a store call.
            running = [(s, ch.inc) for s, ch in list(self.children.items())]
            if not running:
                continue
            try:
                # Serializable: every node looks each interval; a moment's lag costs nothing.
                found = c.conn.range(c.key("kv/dead/"), prefix=True, serializable=True).kvs
            except ControlError:
                continue  # etcd unreachable: the keepalive or the campaign says so
            declared = {}
            for kv in found:
                slot, inc = kv.key.decode().rsplit("/", 2)[-2:]
                info = _json_or_none(kv.value)
                if info is not None and info.get("exit_code") is None:
                    declared[(int(slot), int(inc))] = info
            if all(key in declared for key in running):
                reason = declared[running[0]].get("reason", "no reason given")
                self._declared_dead(sorted(s for s, _ in running), str(reason))
                return

    def _declared_dead(self, slots: List[int], reason: str) -> None:
        """Stop this node: its ranks were declared dead by the leader. Through the same
        once-only path as a lost lease (:meth:`_control_lost`: one line, exit 1)."""
        control = self.store_host.control
        if control is not None and control.term is not None and not control.lost.is_set():
            try:
                control.resign()  # this node led: the next leader need not wait for the TTL
            except Exception:  # noqa: BLE001 (the lease then expires by itself)
                pass
        self.store_host._control_lost(
            f"this node was declared dead: ranks {', '.join(map(str, slots))} were declared "
            f"dead by the leader ({reason}), which this node could not reach while etcd could"
        )

    def _job_ended(self, line: str) -> None:
        """``--store-mode etcd``, from a background thread: this node won a term after the job
        ended (a late spare). Its processes are ended and the supervisor exits 0 with one line,
        rather than calling the old leader's store, which is gone."""
        everyone = list(self.children.values()) + list(self.standby)
        for child in everyone:
            kill_group(child.proc.pid)
            kill(child.proc.pid)
        self.log(f"{line}; exiting")
        os._exit(0)  # the main thread may be in a call to the old store: no unwinding

    def open_store(self) -> None:
        """Host or join the membership store, or lead it on etcd (:mod:`.store_host`)."""
        self.ms = self.store_host.open()
        # This node's liveness: a rank silent for the heartbeat timeout whose supervisor is
        # silent too (the node died or hangs) is declared dead at once (coordinator.py). The
        # ranks beat into beat_dir; this beat writes theirs and its own in one key.
        self.beat_dir = os.path.join(self.error_dir or tempfile.mkdtemp(), "beats")
        os.makedirs(self.beat_dir, exist_ok=True)
        self.beat = Heartbeat.of_supervisor(
            self.cfg.store, self.id, self.cfg.heartbeat_interval_s, self.beat_dir
        ).start()
        # A connection to the coordinator's liveness listener, held while this process lives:
        # when it is killed, the kernel closes it and the coordinator declares this node's
        # ranks dead at once (a hang keeps it open: the heartbeat timeout covers that).
        from megatron_mecefo.recovery.membership import MembershipStore

        liveness_ms = MembershipStore.connect(self.cfg.store, self.cfg.init_timeout_s)
        threading.Thread(
            target=hold_liveness,
            args=(liveness_ms, self.id, self.cfg.heartbeat_interval_s, self._liveness_stop,
                  self.beat.ms.address if self.beat.ms is not None else None),  # fmt: skip
            name="mecefo-liveness",
            daemon=True,
        ).start()
        self.node_vote = node_vote_host.host(
            self.cfg.store, self.node, self.cfg.poll_interval_s, self.args.nnodes,
            self.cfg.vote_group_size, self.args.store_host,
        )  # fmt: skip
        if self.store_host.control is not None:
            threading.Thread(
                target=self._watch_declared_dead, name="mecefo-declared-dead", daemon=True
            ).start()

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
        env = rank_environment()
        rdzv_address = self.store_host.rdzv_address
        env.update(
            RANK=str(slot),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self._local_rank(slot)),
            LOCAL_WORLD_SIZE=str(len(self.slots)),
            MASTER_ADDR=rdzv_address.rsplit(":", 1)[0],
            MASTER_PORT=rdzv_address.rsplit(":", 1)[1],
            TORCHELASTIC_USE_AGENT_STORE="True",
            MECEFO_RECOVERY_SLOT=str(slot),
            MECEFO_RECOVERY_INC=str(inc),
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            PYTHONUNBUFFERED="1",
        )
        env[ENV] = self.cfg.to_env()
        env[ERROR_FILE_ENV] = self.error_dir
        env[SUPERVISOR_ENV] = self.id
        if self.beat_dir:
            env[BEAT_DIR_ENV] = self.beat_dir
        env.update(node_vote_host.rank_env(getattr(self, "node_vote", None), len(self.slots)))
        if standby is not None:
            env["MECEFO_RECOVERY_STANDBY"] = f"{self.node}/{standby}"
            env["LOCAL_RANK"] = "-1"  # no device until a slot is assigned (await_assignment)
        proc = start_process(self.command, env)
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
            kill_group(child.proc.pid)  # what the rank left in its process group
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
            if self.ms.get_str("fatal") is not None:
                # A rank that set the job's fatal message exits with it (e.g. a world with
                # no trained state): the job ends with that one line, not a death to recover.
                continue
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
        a heartbeat timeout when the supervisor died or hangs with it). It waits as long as the
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
                kill(child.proc.pid)

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
        self.cost.start()
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
                        kill(child.proc.pid)
                self._reap()
                now = time.monotonic()
                for item in [p for p in self.pending if p[0] <= now]:
                    self.pending.remove(item)
                    self.spawn(item[1], item[2])
                if now - last_kill_check > self.cfg.heartbeat_interval_s / 2:
                    last_kill_check = now
                    self.cost.note_steady_cpu(self.ms)
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
                kill(child.proc.pid)
            for child in everyone:
                child.proc.wait()
            if self.beat is not None:
                # Joined before the stores go: a daemon thread left in a store call while the
                # interpreter tears the stores down can abort the exit (below, __main__).
                self.beat.stop(join=True)
            self.store_host.close()
            self.cost.record(self.ms)

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
            kill(child.proc.pid)
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
                kill(child.proc.pid)
            self.stop_deadline = time.monotonic()

    def _saving(self) -> bool:
        return "--exit-signal-handler" in self.command

    def _end_stop(self) -> int:
        name = signal.Signals(self.stopping).name
        n = len(self.slots)
        if self._saving() and self._done():
            self.log(f"stopped by {name}: {n} ranks saved and exited (--exit-signal-handler)")
            # As at the end of training: the store's host stays up until every node has read
            # "done". A leader that left first made a later node's read fail, and that node
            # said its ranks "ended before their save completed" (test-slurm, once).
            try:
                return self._finish_node()
            except Exception:  # noqa: BLE001 (the host left after its 30 s: saved all the same)
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

    def _finish_node(self) -> int:
        """Every rank of this node finished; the store's host keeps it up for the others."""
        self.store_host.finish_node()
        return 0


def control_lost_line(line: str, killed: int) -> str:
    """The last line of a node whose etcd leadership or connection is lost: what it knows.
    A node that no etcd member answered cannot tell a lost quorum from its own lost links, so
    it never says the quorum is lost; NOSPACE stops every node until its space is freed."""
    if "etcd NOSPACE" in line:
        after = "the job stops: etcd refuses every write until its space is freed"
    elif "this node lost etcd" in line:
        after = "this node lost etcd; the other nodes go on if they still reach an etcd quorum"
    else:
        after = "the other nodes go on if they still reach an etcd quorum"
    return f"{line}; {killed} processes of this node killed, exiting ({after})"


def _json_or_none(text: bytes) -> Optional[dict]:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


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
    quiet_cpp_log()  # the supervisor's own c10 log; its ranks keep the user's setting
    supervisor = Supervisor(args, cfg)
    SIGNALS.supervisor = supervisor
    try:
        return supervisor.run()
    except SupervisorError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    except RuntimeError as err:
        from megatron_mecefo.recovery.etcd_transport import ControlError

        if not isinstance(err, ControlError):
            raise
        # e.g. etcd's NOSPACE on a death this node reports: one line, as any other end.
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        if supervisor.error_dir:
            shutil.rmtree(supervisor.error_dir, ignore_errors=True)


if __name__ == "__main__":
    SIGNALS.install()  # before anything slow: a Ctrl-C now is one line too
    threading.current_thread().name = "supervisor"
    code = main()
    # End here, as the ranks do (generations._exit_now): the interpreter's teardown of the
    # supervisor's C++ store objects, with a daemon thread still in a store call (the
    # supervisor's heartbeat, new in this version, was never stopped), aborted ("terminate
    # called without an active exception", SIGABRT) in 2 of ~180 supervised runs of a `make
    # test`, after the job had finished and reported. Other daemon threads (the node vote,
    # etcd's keepalive) may still be in calls here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)
