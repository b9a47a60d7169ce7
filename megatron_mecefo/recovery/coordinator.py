"""The coordinator: the single writer of membership generations.

It runs as a thread of the first node's supervisor, next to the store it hosts. It watches
the deaths the supervisors report, the ranks' heartbeats, the collective errors the ranks
report, and the processes that are ready to (re)join, and publishes a new
:class:`~.membership.Generation` when the set of complete replicas changes:

* a member died (or stopped beating and was killed): a *failure* generation, effective at
  once; the survivors redo the in-flight iteration;
* a replica is complete again (its spares and replacements are ready): a *planned*
  generation, effective at an iteration boundary ``join_margin_iterations`` ahead;
* no replica is complete: an *abort* generation with the message to print.

Its work grows with the nodes, not the ranks: a node's supervisor writes one heartbeat key for
itself and its ranks (``hb/node/<id>``, :mod:`.heartbeat`), read in one ``multi_get`` per
check; an event rereads only the slots it names (``event/<n>``); the collective errors of a
generation are one counter (``err/<g>``). Each supervisor also holds a connection to the
coordinator's :class:`LivenessListener`: when it closes (the supervisor's process ended: the
kernel closes its sockets), the node's ranks are declared dead at once, not after the
heartbeat timeout (which still covers a hung node, whose sockets stay open).
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.membership import (
    CompleteReplicas,
    Generation,
    JobLayout,
    MembershipStore,
)

EVENTS_READ_MAX = 4096
"""More new events than this at once (a takeover's jump of the count, a start): one full
rescan rather than reading each event's key."""

LIVENESS_KEY = "liveness"
"""The hot store's key: ``HOST:PORT`` of the coordinator's :class:`LivenessListener`."""
LIVENESS_BYE = b"bye\n"
"""What a supervisor sends before it closes its liveness connection on purpose (it moves to
a new leader's listener): that close is no death."""


class Coordinator:
    """Publishes generations (see the module docstring).

    Args:
        store: A client of the membership store.
        world_size: Slots of the original job (all nodes).
        config: The recovery settings (heartbeat timeout, poll interval, join margin).
        log: Prints one line.
        join_at_boundary_only: See :attr:`join_at_boundary_only`.
        on_failure: Called (from the coordinator's thread) with the exception that ended the
            thread while the job runs; without it, the thread says so in one line and ends.
    """

    def __init__(
        self,
        store: MembershipStore,
        world_size: int,
        config: RecoveryConfig,
        log=print,
        join_at_boundary_only: bool = False,
        on_failure: Optional[Callable[[BaseException], None]] = None,
        leader_contact: Optional[Any] = None,
    ) -> None:
        self.ms = store
        self.on_failure = on_failure
        self.leader_contact = leader_contact
        """etcd mode: the leader's :class:`~.etcd_control.EtcdControl`. Silences are trusted
        only while it renews its lease: a leader whose own link is cut hears no node, and
        declared every one of them dead (all four nodes of a PP2 x DP2 job then exited, their
        deaths landing on etcd once the link came back inside the lease TTL). After a gap in
        its contact, silences count again from the gap's end."""
        self.join_at_boundary_only = join_at_boundary_only
        """Replacements join only at a planned boundary, never a failure's world: under the
        distributed optimizer the survivors rebuild the lost shards from their snapshots'
        parity, a collective a process without snapshots cannot take part in."""
        self.world_size = world_size
        self.cfg = config
        self.log = log
        self.assignment = CompleteReplicas()
        self.inc: Dict[int, int] = {s: 0 for s in range(world_size)}
        self.dead: Set[Tuple[int, int]] = set()
        self.ready: Set[Tuple[int, int]] = set()
        self._hb: Dict[Tuple[int, int], Tuple[int, float]] = {}
        self._supervisor_hb: Dict[str, Tuple[int, float]] = {}
        """A supervisor's beats as :attr:`_hb` holds a rank's: (count, when it was seen)."""
        self._supervisor_of: Dict[Tuple[int, int], str] = {}
        """A ready process's supervisor (its ``ready`` key names it), when it says."""
        self._hb_since = 0.0
        """No heartbeat counts as silent before this (``time.monotonic``): see
        :meth:`restart_heartbeat_clock`."""
        self._kill_requested: Dict[Tuple[int, int], float] = {}
        self._errors_seen: Dict[int, float] = {}
        self._progress_at: Dict[int, int] = {}  # the progress key when a generation was made
        self.gen: Optional[Generation] = None
        self._layout: Optional[JobLayout] = None
        self._pending = False
        """Re-decide on every poll (an error waiting for its timeout, a rejoin for progress)."""
        self._stop = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self._events_seen = -1
        """The last event whose key was read (:meth:`_scan_events`)."""
        self._hole: Optional[Tuple[int, float]] = None
        """An event counted but whose key was not there yet: (number, when first missed)."""
        self._aggregated: Set[str] = set()
        """Supervisors whose node key (``hb/node/<id>``) exists: their ranks beat through it."""
        self._closed: Set[str] = set()
        """Supervisors whose connection to the :class:`LivenessListener` closed."""
        self._closed_lock = threading.Lock()
        self._closed_seen = (0, 0, 0)
        self.listener: Optional[LivenessListener] = None

    # ------------------------------------------------------------------ life cycle
    def start(self, resume: bool = False) -> None:
        """Publish generation 0 and watch; with ``resume`` (etcd mode: a new leader that took over),
        go on from the current generation and the deaths, incarnations and ready processes
        the store holds."""
        if resume:
            self.gen = self.ms.generation(self.ms.generation_number())
            events = self.ms.events()  # counted first: a later event is read by its key
            self._rescan()
            self._events_seen = events
            self._pending = True  # decide on what the rescan found (a death to publish)
        else:
            first = Generation(
                number=0,
                replicas=(),
                members={s: 0 for s in range(self.world_size)},
                reason="start",
            )
            self.ms.publish(first)
            self.gen = first
        self._listen()
        self.thread = threading.Thread(target=self._run, name="mecefo-coordinator", daemon=True)
        self.thread.start()

    def restart_heartbeat_clock(self) -> None:
        """Count every process's heartbeat silence from now on (etcd mode: a new leader calls
        it once it has published its store's address). A takeover's coordinator starts before
        any rank can reach its store; silence counted from then made a live rank whose beats
        arrived only after the publication (etcd slow to answer) look hung, and it was
        SIGKILLed."""
        self._hb_since = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        if self.listener is not None:
            self.listener.close()

    def _listen(self) -> None:
        """Serve the :class:`LivenessListener` on the store's host and publish its address
        (none when the store's address is not ``HOST:PORT``)."""
        address = self.ms.address()
        host = address.rsplit(":", 1)[0] if ":" in address else ""
        if not host:
            return
        notifier = MembershipStore.connect(address, 10.0)
        self.listener = LivenessListener(host, lambda sup: self.supervisor_closed(sup, notifier))
        self.ms.store.set(LIVENESS_KEY, self.listener.address)

    def supervisor_closed(self, supervisor: str, notifier: Optional[MembershipStore]) -> None:
        """``supervisor``'s connection closed (its process ended): its ranks are declared dead
        at the next pass, which the event wakes (from the listener's thread)."""
        with self._closed_lock:
            self._closed.add(supervisor)
        if notifier is not None:
            try:
                notifier.notify(f"closed/{supervisor}")
            except Exception:  # noqa: BLE001 (the heartbeat check finds it within a second)
                pass

    def _run(self) -> None:
        # Idle when nothing happens: between heartbeat checks it waits in the store for the
        # next event's key (a client of its own: a waiting client holds its lock), so it
        # neither polls nor takes the store's server thread from the ranks. Only while a
        # decision is pending (an error waiting for its timeout, a rejoin for progress) does it
        # poll every ``poll_interval_s``.
        try:
            self._loop()
        finally:
            if self.listener is not None:
                self.listener.close()

    def _loop(self) -> None:
        waiter = MembershipStore.connect(self.cfg.store) if self.cfg.store else None
        last_hb = 0.0
        while not self._stop.is_set():
            try:
                events = self.ms.events()
                now = time.monotonic()
                changed = events != self._events_seen
                if changed:
                    self._scan_events(events)
                if now - last_hb >= self.cfg.heartbeat_interval_s:
                    stalled = max(
                        self.cfg.heartbeat_timeout_s / 2, 3 * self.cfg.heartbeat_interval_s
                    )
                    if last_hb and now - last_hb > stalled:
                        # This thread itself did not run (its process stopped or starved):
                        # it saw nothing meanwhile, which is no evidence of anyone's silence.
                        self.restart_heartbeat_clock()
                    last_hb = now
                    if self.ms.get_str("done") is not None:
                        return
                    known_dead = len(self.dead)
                    self._check_heartbeats(now)
                    # A check that found nothing changes no decision (before, every check
                    # re-decided: O(ranks) of CPU each second). A time-bound decision (an
                    # error's timeout, a rejoin's progress) is pending and polled.
                    changed = changed or len(self.dead) != known_dead
                known_dead = len(self.dead)
                self._check_closed()
                changed = changed or len(self.dead) != known_dead
                if changed or self._pending:
                    self._decide()
                if self.gen is not None and self.gen.abort:
                    return
                if self._pending or waiter is None:
                    time.sleep(self.cfg.poll_interval_s)
                else:
                    until_hb = last_hb + self.cfg.heartbeat_interval_s - time.monotonic()
                    waiter.wait_event_after(self._events_seen, until_hb)
            except Exception as err:  # noqa: BLE001 (whatever it is, it is said, never silent)
                # No generation is made while this thread is down, so nobody would recover
                # from a later death: the owner restarts it or hands the leadership over.
                if self._stop.is_set():
                    return
                if self.on_failure is not None:
                    self.on_failure(err)
                else:
                    self.log(f"[coordinator] stopped: {type(err).__name__}: {err}")
                return

    # ------------------------------------------------------------------ observation
    def layout(self) -> Optional[JobLayout]:
        if self._layout is None:
            d = self.ms.get_json("layout")
            self._layout = None if d is None else JobLayout(**d)
        return self._layout

    def _rescan(self) -> None:
        """Reread every slot (O(ranks): at a start, a takeover, or an event whose key is lost)."""
        for slot in range(self.world_size):
            self._rescan_slot(slot)

    def _rescan_slot(self, slot: int) -> None:
        text = self.ms.get_str(f"inc/{slot}")
        if text is not None:
            self.inc[slot] = int(text)
        for inc in range(self.inc[slot] + 1):
            key = (slot, inc)
            if key in self.dead:
                continue
            if self.ms.get_str(f"dead/{slot}/{inc}") is not None:
                self.dead.add(key)
                self.ready.discard(key)
            elif key not in self.ready:
                text = self.ms.get_str(f"ready/{slot}/{inc}")
                if text:
                    self.ready.add(key)
                    supervisor = _supervisor_named(text)
                    if supervisor is not None:
                        self._supervisor_of[key] = supervisor

    def _scan_events(self, events: int) -> None:
        """Reread the slots that the events after :attr:`_events_seen` up to ``events`` name
        (a death, a ready process): O(events), not O(ranks). An event counted whose key is not
        there yet (its writer between the count and the key) is awaited; if it is still
        missing at a later look (its writer died in between), or on a jump of the count (a
        takeover, a start), every slot is reread."""
        last = self._events_seen
        if last < 0 or events < last or events - last > EVENTS_READ_MAX:
            self._rescan()
            self._events_seen, self._hole = events, None
            return
        names = [f"event/{n}" for n in range(last + 1, events + 1)]
        store = self.ms.store
        if store.check(names):
            values = [v.decode() for v in store.multi_get(names)]
        else:  # a key not there yet: the events before it, then wait for it
            values = []
            for name in names:
                value = self.ms.get_str(name)
                if value is None:
                    break
                values.append(value)
        self._rescan_named(values)
        self._events_seen = last + len(values)
        if self._events_seen == events:
            self._hole = None
            return
        hole = self._events_seen + 1
        now = time.monotonic()
        if self._hole is None or self._hole[0] != hole:
            self._hole = (hole, now)
            self._pending = True  # look again (the key is awaited in the store)
        elif now - self._hole[1] >= max(self.cfg.poll_interval_s, 0.5):
            self._rescan()  # its writer died between the count and the key
            self._events_seen, self._hole = events, None
        else:
            self._pending = True

    def _rescan_named(self, keys: List[str]) -> None:
        slots = set()
        for key in keys:
            kind, _, rest = key.partition("/")
            if kind in ("dead", "ready") and rest.partition("/")[0].isdigit():
                slots.add(int(rest.partition("/")[0]))
        for slot in sorted(slots):
            self._rescan_slot(slot)

    def _check_closed(self) -> None:
        """The ranks of a supervisor whose connection closed (its process ended, and its ranks
        with it: they die with their parent) are dead: declared at once."""
        with self._closed_lock:
            closed = set(self._closed)
        seen = (len(closed), len(self.ready), len(self.dead))
        if not closed or self._closed_seen == seen:
            return  # nothing new: no supervisor closed, no rank became ready since
        self._closed_seen = seen
        lost = [k for k in sorted(self.ready - self.dead) if self._supervisor_of.get(k) in closed]
        if not lost or self.ms.get_str("done") is not None:
            return  # at the job's end every supervisor exits: no death
        for key in lost:
            slot, inc = key
            self.log(
                f"[coordinator] rank {slot} (incarnation {inc}): its supervisor's connection "
                f"closed (its process ended, node lost): dead"
            )
            self.ms.report_dead(
                slot, inc, {"exit_code": None, "reason": "supervisor connection closed", "t": 0}
            )
            self.dead.add(key)
            self.ready.discard(key)
        self._closed_seen = (len(closed), len(self.ready), len(self.dead))

    def _silence(self, seen: Dict, key: object, count: int, now: float) -> Optional[float]:
        """Seconds ``key``'s heartbeat ``count`` has not moved, once that reaches the timeout
        (else None); ``seen`` keeps (count, when it was seen) per key."""
        last = seen.get(key)
        if last is None or last[0] != count or last[1] < self._hb_since:
            seen[key] = (count, max(now, self._hb_since))
            return None
        silent = now - last[1]
        # A count of 0: no beat on this store yet, i.e. a new leader's store (the counters
        # are not restored) that the process is still reconnecting to. Every client of every
        # rank reconnects at once then, and a TCPStore stalls up to 5-10 s under such a
        # burst (measured): twice the timeout, so a live process is not killed for it.
        limit = self.cfg.heartbeat_timeout_s * (2 if count == 0 else 1)
        return silent if silent >= limit else None

    def _check_heartbeats(self, now: float) -> None:
        """A ready process whose heartbeat has not moved for the timeout is killed (by its
        supervisor); if nobody confirms the death within another timeout, the coordinator
        declares it dead itself. When its supervisor has not beaten for the timeout either
        (its node died or hangs: nobody will confirm), it is declared dead at once: a
        follower node's loss costs one heartbeat timeout, not two. Ranks that still beat under a
        supervisor silent for the timeout (it hangs: their votes wait on it for ever) are
        declared dead too, unless the job is stopping: the node is lost (issue 54, H1)."""
        contact = self.leader_contact
        if contact is not None:
            # Not in contact with etcd lately: this leader may be the one cut off; it decides
            # nothing on silences until it is back.
            if not contact.in_contact(now, self.cfg.heartbeat_timeout_s):
                return
            if contact.contact_regained_at > self._hb_since:
                self._hb_since = contact.contact_regained_at
        keys = sorted(self.ready - self.dead)
        supervisors = sorted({self._supervisor_of[k] for k in keys if k in self._supervisor_of})
        counts, supervisor_counts = self._beats(keys, supervisors)
        gone = {
            sup: silent
            for sup, count in zip(supervisors, supervisor_counts, strict=True)
            if (silent := self._silence(self._supervisor_hb, sup, count, now)) is not None
        }
        declare: List[Tuple[int, int]] = []
        unanswered: List[Tuple[int, int]] = []
        hung: List[Tuple[Tuple[int, int], float]] = []
        near = self.cfg.heartbeat_timeout_s - 2 * self.cfg.heartbeat_interval_s
        hb, since = self._hb, self._hb_since
        for key, count in zip(keys, counts, strict=True):
            if not gone:  # the common case, inline (16,384 ranks a second): a count that moved
                last = hb.get(key)
                if last is None or last[0] != count or last[1] < since:
                    hb[key] = (count, now if now > since else since)
                    continue
            slot, inc = key
            silent = self._silence(self._hb, key, count, now)
            if silent is None:
                # A rank of a lost node (its supervisor silent for the timeout) whose own
                # silence is a check or two short of it: it stopped with its node, its last
                # beat merely seen a check later. It goes with the node's other ranks, in
                # one failure generation, rather than in a second one a check later.
                supervisor_silent = gone.get(self._supervisor_of.get(key, ""))
                if supervisor_silent is not None:
                    if now - self._hb[key][1] >= near:
                        unanswered.append(key)
                    else:
                        hung.append((key, supervisor_silent))
                continue
            supervisor_silent = gone.get(self._supervisor_of.get(key, ""))
            if key not in self._kill_requested:
                # Asked also when its supervisor is silent: a hung one that wakes kills it.
                self._kill_requested[key] = now
                self.ms.set_json(f"kill/{slot}/{inc}", {"reason": "heartbeat", "silent_s": silent})
                self.ms.notify()
                self.log(
                    f"[coordinator] rank {slot} (incarnation {inc}): no heartbeat for "
                    f"{silent:.1f} s; asking its supervisor to SIGKILL it"
                )
            if supervisor_silent is not None:
                self.log(
                    f"[coordinator] rank {slot} (incarnation {inc}): its supervisor has not "
                    f"beaten for {supervisor_silent:.1f} s either (its node is lost): dead"
                )
                declare.append(key)
            elif now - self._kill_requested[key] > self.cfg.heartbeat_timeout_s:
                declare.append(key)
            else:
                unanswered.append(key)
        if hung and self.ms.get_str("stopping") is None:
            # Beating ranks whose supervisor is silent for the timeout: the supervisor hangs
            # (SIGSTOP, a frozen process). Their votes go through it (the node vote, its group
            # store), so they wait on it for ever, and nobody can kill or confirm them: the
            # node is lost (issue 54, H1). A supervisor that wakes kills them (the request).
            for (slot, inc), silent in hung:
                if (slot, inc) not in self._kill_requested:
                    self._kill_requested[(slot, inc)] = now
                    self.ms.set_json(
                        f"kill/{slot}/{inc}", {"reason": "supervisor hung", "silent_s": silent}
                    )
                self.log(
                    f"[coordinator] rank {slot} (incarnation {inc}): its supervisor has not "
                    f"beaten for {silent:.1f} s (hung): its node is lost, dead"
                )
                declare.append((slot, inc))
            self.ms.notify()
        if declare:
            # A node that died took its supervisor: its ranks fell silent together, but their
            # timeouts lapse a check apart. Every rank silent for the timeout whose kill request
            # is unanswered goes with them, so a node's death is one failure generation.
            declare += unanswered
        hung_keys = {key for key, _ in hung}
        for slot, inc in declare:
            reason = "supervisor hung" if (slot, inc) in hung_keys else "heartbeat, no supervisor"
            self.ms.report_dead(slot, inc, {"exit_code": None, "reason": reason, "t": 0})
            self.dead.add((slot, inc))
            self.ready.discard((slot, inc))

    def _beats(
        self, keys: List[Tuple[int, int]], supervisors: List[str]
    ) -> Tuple[List[int], List[int]]:
        """The heartbeat counts of ``keys`` and of ``supervisors``: one ``multi_get`` of the
        node keys (``hb/node/<id>``) for the ranks of supervisors that write one, and the
        per-rank counters (``hb/<slot>/<inc>``) of the others (ranks without a supervisor, or
        whose supervisor wrote no node key yet)."""
        store = self.ms.store
        for sup in supervisors:
            if sup not in self._aggregated and store.check([f"hb/node/{sup}"]):
                self._aggregated.add(sup)
        nodes = [sup for sup in supervisors if sup in self._aggregated]
        node_beats: Dict[str, dict] = {}
        if nodes:
            values = store.multi_get([f"hb/node/{sup}" for sup in nodes])
            node_beats = {sup: json.loads(v) for sup, v in zip(nodes, values, strict=True)}
        of = self._supervisor_of
        direct = [k for k in keys if of.get(k) not in node_beats] if node_beats else keys
        direct_sups = [sup for sup in supervisors if sup not in node_beats]
        found = self.ms.heartbeats(direct, direct_sups)
        by_key = dict(zip(direct, found[: len(direct)], strict=True))
        by_sup = dict(zip(direct_sups, found[len(direct) :], strict=True))
        ranks = {sup: beat["ranks"] for sup, beat in node_beats.items()}
        counts = [
            by_key[key] if key in by_key else ranks[of[key]].get(f"{key[0]}/{key[1]}", 0)
            for key in keys
        ]
        for sup, beat in node_beats.items():
            by_sup[sup] = int(beat["beat"])
        return counts, [by_sup[sup] for sup in supervisors]

    def alive_slots(self) -> List[int]:
        """Slots whose current process can train: not known dead, and either ready or a
        member of the current generation (a replacement still starting up is not)."""
        members = self.gen.members if self.gen is not None else {}
        return [
            s
            for s in range(self.world_size)
            if (s, self.inc[s]) not in self.dead
            and ((s, self.inc[s]) in self.ready or members.get(s) == self.inc[s])
        ]

    # ------------------------------------------------------------------ decisions
    def _decide(self) -> None:
        gen = self.gen
        assert gen is not None
        self._pending = False
        layout = self.layout()
        if layout is None:
            return  # the ranks have not started yet
        alive = self.alive_slots()
        lost = [s for s, i in gen.members.items() if (s, i) in self.dead]
        stopping = self.ms.get_str("stopping")
        if stopping is not None:
            # A supervisor got SIGINT/SIGTERM: the ranks save and stop. A death now is no
            # failure to recover from (no regroup, no rejoin): the job ends.
            if lost and self.ms.get_str("fatal") is None:
                self.ms.set_fatal(
                    f"rank {', '.join(map(str, lost))} died while the job stopped ({stopping}); "
                    "not recovered"
                )
            return
        if lost:
            time.sleep(0.05)  # let simultaneous deaths land in one generation
            self._scan_events(self.ms.events())
            alive = self._failure_world(self.alive_slots())
            lost = [s for s, i in gen.members.items() if (s, i) in self.dead]
            self._publish_change(layout, alive, lost, planned=False, reason="death")
            return
        if gen.number in self._errors_seen:
            self._pending = True
        if self._error_without_death(gen):
            alive = self._failure_world(alive)
            self._publish_change(layout, alive, [], planned=False, reason="collective error")
            return
        # Rejoin: a replica outside the generation whose slots are all alive and ready.
        ready_alive = [s for s in alive if (s, self.inc[s]) in self.ready]
        replicas, _ = self.assignment.assign(layout, ready_alive)
        if gen.number > 0 and set(replicas) - set(gen.replicas):
            progress = self.ms.get_str("progress")
            if progress is None or not self._established(gen, int(progress)):
                self._pending = True
                return
            self._publish_change(layout, ready_alive, [], planned=True, reason="rejoin")

    def _established(self, gen: Generation, progress: int) -> bool:
        """Whether a rejoin may supersede ``gen``: with :attr:`join_at_boundary_only`, a
        failure's world must first commit an iteration past the one it was made at (its
        survivors' rebuild from the snapshots' parity is a collective of that world)."""
        if not self.join_at_boundary_only or gen.at_iteration is not None:
            return True
        return progress > self._progress_at.get(gen.number, -1)

    def _failure_world(self, alive: List[int]) -> List[int]:
        """The slots a failure's world may hold: with :attr:`join_at_boundary_only`, the
        current members' processes only (a ready replacement waits for the rejoin)."""
        if not self.join_at_boundary_only:
            return alive
        members = self.gen.members if self.gen is not None else {}
        return [s for s in alive if members.get(s) == self.inc[s]]

    def _error_without_death(self, gen: Generation) -> bool:
        """A member reported a collective error in the current generation and no death has
        been found for a heartbeat timeout (and two checks) since: regroup the same members.

        The two checks: a lost node's death is found by the heartbeats up to two intervals
        past the timeout (its last beat is seen up to a check late, and the checks are an
        interval apart), while its peers' collectives error at once. Waiting just the timeout
        made a generation of the same members first, which waited for the dead node's ranks
        until the death's generation superseded it."""
        if gen.number in self._errors_seen:
            first = self._errors_seen[gen.number]
            wait = self.cfg.heartbeat_timeout_s + 2 * self.cfg.heartbeat_interval_s
            return time.monotonic() - first > wait
        # One key (the count of err/<g>/<slot>, report_error), not one per member.
        if self.ms.store.check([f"err/{gen.number}"]):
            self._errors_seen[gen.number] = time.monotonic()
        return False

    def _publish_change(
        self, layout: JobLayout, alive: List[int], lost: List[int], planned: bool, reason: str
    ) -> None:
        gen = self.gen
        assert gen is not None
        replicas, spares = self.assignment.assign(layout, alive)
        members = {s: self.inc[s] for r in replicas for s in layout.replica_slots(r)}
        # A slot joins when it was no member, or when a new process (incarnation) holds it: a
        # replacement that is up before a failure's generation is published joins in it.
        previous = gen.members if gen.number > 0 else {s: 0 for s in range(self.world_size)}
        at = None
        if planned:
            at = int(self.ms.get_str("progress") or 0) + self.cfg.join_margin_iterations
        abort = None
        if not replicas:
            dead = sorted(set(range(self.world_size)) - set(alive))
            abort = (
                f"every data-parallel replica has lost a rank (ranks without a live process: "
                f"{dead}); "
                "MeCeFO has no replica left to take over from, so training stops. Resume from "
                "the last checkpoint (--load), or run with more replicas"
            )
        new = Generation(
            number=gen.number + 1,
            replicas=tuple(replicas),
            members=members,
            spares=tuple(spares),
            joined=tuple(sorted(s for s, i in members.items() if previous.get(s) != i)),
            lost=tuple(sorted(lost)),
            at_iteration=at,
            reason=reason,
            abort=abort,
            layout={"tp": layout.tp, "pp": layout.pp, "dp": layout.dp},
        )
        self._progress_at[new.number] = int(self.ms.get_str("progress") or 0)
        self.ms.publish(new)
        self.gen = new
        what = f"at iteration boundary {at}" if planned else "now"
        self.log(
            f"[coordinator] generation {new.number} ({reason}, {what}): replicas "
            f"{list(new.replicas)}, {len(members)} ranks, lost {list(new.lost)}, joined "
            f"{list(new.joined)}, spares {list(new.spares)}"
            + (f"; ABORT: {abort}" if abort else "")
        )


def _supervisor_named(ready: str) -> Optional[str]:
    """The supervisor a ``ready`` key's JSON names (None: an older rank, or none named)."""
    try:
        info = json.loads(ready)
    except ValueError:
        return None
    supervisor = info.get("supervisor") if isinstance(info, dict) else None
    return supervisor if isinstance(supervisor, str) and supervisor else None


class LivenessListener:
    """A socket server thread on the coordinator's node that each supervisor holds one
    connection to (it sends its id, a line, and then nothing). The connection closes only when
    the supervisor's process ends (the kernel closes its sockets, SIGKILL included):
    ``on_closed(id)`` is called then, from this thread. A hung (SIGSTOPped) supervisor keeps
    it open; the heartbeat timeout covers that. One thread, one ``select`` for every node."""

    def __init__(self, host: str, on_closed: Callable[[str], None]) -> None:
        self.on_closed = on_closed
        self.server = socket.create_server((host, 0), backlog=1024)
        self.server.setblocking(False)
        self.address = f"{host}:{self.server.getsockname()[1]}"
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.server, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._run, name="mecefo-liveness", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        lines: Dict[socket.socket, bytes] = {}
        ids: Dict[socket.socket, str] = {}
        while not self._stop.is_set():
            try:
                ready = self._selector.select(timeout=0.2)
            except (OSError, ValueError):
                return  # closed
            for key, _ in ready:
                if key.data is None:
                    try:
                        conn, _ = self.server.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    self._selector.register(conn, selectors.EVENT_READ, "peer")
                    lines[conn] = b""
                    continue
                conn = key.fileobj  # type: ignore[assignment]
                try:
                    data = conn.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""  # reset: the peer's process ended
                if data:
                    lines[conn] += data
                    line, newline, rest = lines[conn].partition(b"\n")
                    if newline and conn not in ids:
                        ids[conn] = line.decode(errors="replace")
                        lines[conn] = rest
                    if conn in ids:
                        if LIVENESS_BYE in lines[conn]:
                            ids[conn] = ""  # it leaves on purpose: its close is no death
                        lines[conn] = lines[conn][-len(LIVENESS_BYE) :]
                    continue
                self._selector.unregister(conn)
                conn.close()
                lines.pop(conn, None)
                supervisor = ids.pop(conn, None)
                if supervisor and not self._stop.is_set():
                    self.on_closed(supervisor)
        for conn in list(lines):
            conn.close()

    def close(self) -> None:
        """Stop listening and close every connection (the supervisors then reconnect to the
        address a later coordinator publishes)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=2)
        self.server.close()
        self._selector.close()


def hold_liveness(
    ms: MembershipStore,
    supervisor: str,
    retry_s: float,
    stop: threading.Event,
    store_address: Optional[Callable[[], str]] = None,
) -> None:
    """A supervisor's side of :class:`LivenessListener` (a thread until ``stop``): connect to
    the address the store publishes, send ``supervisor``, and hold the connection; when it
    ends (the coordinator stopped, a new leader), look the address up again and reconnect.
    ``store_address``: the hot store's address as a client that follows the leader sees it
    (etcd mode; no request): when it moves and the store publishes another listener (a new
    leader's, also when the old one hangs and its connection stays open), this one says
    :data:`LIVENESS_BYE` and moves there. A connection it closes without saying so is this
    process's end, so nothing here closes one otherwise."""
    while not stop.is_set():
        try:
            address = ms.get_str(LIVENESS_KEY)
            if address:
                host, port = address.rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=5.0) as conn:
                    conn.sendall(f"{supervisor}\n".encode())
                    conn.settimeout(retry_s)
                    _hold(conn, ms, address, retry_s, stop, store_address)
        except Exception:  # noqa: BLE001 (no store or listener now: look again later)
            pass
        stop.wait(retry_s)


def _hold(conn: socket.socket, ms: MembershipStore, address: str, retry_s: float,
          stop: threading.Event, store_address: Optional[Callable[[], str]]) -> None:  # fmt: skip
    """Hold ``conn`` (to the listener at ``address``) until the listener closes it, or until
    the store publishes another listener (then say :data:`LIVENESS_BYE`)."""

    def where() -> str:
        try:
            return store_address() if store_address is not None else ""
        except Exception:  # noqa: BLE001
            return ""

    store = where()
    while not stop.is_set():
        try:
            if not conn.recv(64):
                return  # the listener closed
        except socket.timeout:
            if store_address is None or where() == store:
                continue
            store = where()
            try:
                published = ms.get_str(LIVENESS_KEY)
            except Exception:  # noqa: BLE001 (the new store not reached yet: look again)
                continue
            if published and published != address:
                conn.sendall(LIVENESS_BYE)
                return
        except OSError:
            return  # reset by the listener's end
