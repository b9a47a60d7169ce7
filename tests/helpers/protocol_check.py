"""An explicit-state model checker of the recovery control plane: every interleaving, crash and
hang of a small job, over in-memory stores.

Two designs are configurations of it:

* :class:`MirrorDesign` (``old``): the primary/standby TCPStore mirror of the removed
  ``--store-mode replicated``, as the code had it before issue 43 removed it
  (``store_mirror.py``, ``store_failover.py``, the coordinator's ``set_durable`` publish, the
  vote of :mod:`~megatron_mecefo.recovery.commit` with its standby claim and
  ``_after_failover``). The mirror is gone from the package and is modelled here only, so that
  the checker is shown to find its generation rollback.
* :class:`EtcdDesign` (``new``, issue 43 item 1): the control state on etcd v3
  (:mod:`fake_etcd`): a leader elected with a lease, every leader write a transaction fenced on
  its leader key, generation ``n + 1`` written only if ``gen`` was not changed since the leader
  read ``n`` (compare on ``mod_revision``), every member write to etcd conditioned on the
  member's own lease, leases that expire when their holder hangs or dies. The commit vote runs
  on the leader's hot TCPStore (an in-memory store per leader, lost when its leader crashes or
  exits, silent while it hangs): the counter, the commit key and the first abort's decision
  of :mod:`~megatron_mecefo.recovery.commit`, no etcd request per iteration (the design of
  issue 43, before the outcome claims that ``StagedDesign``'s ``claims`` models). A takeover
  publishes a generation and ``hot_store`` (the new leader's empty store and the generation
  it took over at); a member whose vote the move cut off is in doubt and does not apply the
  step (a vote of a later generation is cast again on the new store), and the regroup's heal
  settles it.

* :class:`StagedDesign` (issue 54 item 9, finding M2): the code as it is, where the two above
  model a safer system: PP x DP stages with the real heal per data-parallel group (``ShardLost``),
  the group and node votes on the leader's hot store, members without leases, the takeover's
  publish in the code's steps, calls to a hung GroupStore or vote server that never return,
  the ECONNREFUSED revoke. Its ``prepared`` / ``deadlines`` / ``claims`` switch on the issue
  54 design (a prepared step resolved by the next world, ``prepared.resolve``; vote waits with
  deadlines; outcomes claimed on etcd, ``commit.claim``); off, it is the code before them,
  which the checker shows to end in ``ShardLost`` (C1) and to wedge (H1), and without the
  claims to split an outcome (``agreement``). What it leaves out is listed in
  ``docs/protocol-check.md``.

**What is real code and what is a model.** Real: :class:`~megatron_mecefo.recovery.membership.
Generation` (every published generation is its JSON, parsed back with ``from_json``),
:class:`~megatron_mecefo.recovery.membership.JobLayout` and :class:`~megatron_mecefo.recovery.
membership.CompleteReplicas` (the coordinator's next membership), the commit vote's constants
and keys (``ABORT_WEIGHT``, ``COMMIT``/``ABORT``, ``_votes_key`` ...; the removed mirror's
``PRIMARY_KEY`` is a copy). Models (step machines written from the code, one store request
per step, so that the explorer owns the interleaving): the coordinator's scan/decide/publish,
the standby's copy thread and takeover, the failover client, the vote (``vote``, ``abort``,
``_outcome``, ``_commit``, ``resolve_after_failover``, ``AsyncVoter._after_failover``), the
rendezvous and the heal's choice of a source, the gradient all-reduce (a pool of
contributions per world and iteration, not a store request), and the samples (each member
processes the samples its view of the generation assigns it; a committed step holds the
samples of every contribution it reduced). Abstractions: a multi-key read of the mirror
(``_copy``'s reads, ``_rescan``) is one step; a member reads ``gen`` and its record in one step;
a store wait that can time out is a nondeterministic choice; time is abstract (a lease may
expire, a call to a hung store may time out, whenever the holder or the store is hung).

**Faults.** Any running actor may crash or hang after any of its steps (a hung one may resume
later: SIGCONT, a healed partition; a partitioned actor is a hung one as far as the store
sees), within a budget of ``faults`` crashes and hangs per run; the old design also has node
faults (node 0: its rank, its coordinator and the primary store at once). Every order of the
actors' requests is explored (each store is linearizable, so the orders of requests are the
orders of messages).

**Invariants**, checked on every transition (:data:`INVARIANTS`).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import (
    Dict,
    FrozenSet,
    Hashable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
)

from fake_etcd import KV, Compare, FakeEtcd, Get, Put, Range

from megatron_mecefo.recovery.commit import (
    ABORT,
    ABORT_WEIGHT,
    COMMIT,
    _commit_key,
    _decision_key,
    _votes_key,
)
from megatron_mecefo.recovery.group_vote import _keys as _group_keys
from megatron_mecefo.recovery.group_vote import groups_of, two_level
from megatron_mecefo.recovery.membership import CompleteReplicas, Generation, JobLayout
from megatron_mecefo.recovery.prepared import RESOLVED_KEY, applied_by_someone, resolve, settle
from megatron_mecefo.recovery.state.heal import NoTrainedState, ShardLost, heal_plan, heal_target

PRIMARY_KEY = "primary"
"""The removed mirror's takeover mark on the standby (``store_failover.PRIMARY_KEY`` was this)."""


def _outcome_key(generation: int, iteration: int) -> str:
    """The removed mirror's outcome claim key (``commit._outcome_key`` was this)."""
    return f"outcome/{generation}/{iteration}"


INVARIANTS = {
    "generations_only_increase": "the generation number of every store, and every generation "
    "number a member reads, never goes down",
    "one_leader_per_term": "every generation number is written with one content by one leader, "
    "which holds the leadership when its write lands",
    "agreement": "no member applies the step of an iteration that another member of the same "
    "generation aborts",
    "same_state": "members at the same committed iteration hold the same state (after a regroup "
    "every member is at the target iteration or healed to it)",
    "samples_exactly_once": "every applied step holds each sample of its iteration exactly once, "
    "and no member applies an iteration twice",
    "fenced_changes_nothing": "a member whose lease has ended (declared dead) lands no write on "
    "etcd (etcd design; what it does on the hot store is bound by agreement)",
    "progress": "when no step is possible, every running member has finished or exited (checked "
    "only while some coordinator can still lead)",
}


# ---------------------------------------------------------------------------------- explorer
@dataclass
class Report:
    """What one exploration found."""

    design: str
    states: int
    transitions: int
    violation: Optional[str]
    trace: List[str]
    complete: bool
    """Every reachable state explored (no violation and no state bound hit)."""
    seconds: float
    detail: str = ""

    def summary(self) -> str:
        what = f"violation {self.violation!r}" if self.violation else "no violation"
        scope = "all reachable states" if self.complete else "stopped early"
        return (
            f"{self.design}: {what}; {self.states} distinct states, {self.transitions} "
            f"transitions ({scope}), {self.seconds:.1f} s"
        )

    def show(self) -> None:
        """Print the summary, and the violation's trace and last state (pytest -s)."""
        print(f"\n{self.summary()}")
        if self.violation:
            print(f"  {self.violation}: {INVARIANTS[self.violation]}")
            for i, step in enumerate(self.trace, 1):
                print(f"  {i:2d}. {step}")
            print(f"  state: {self.detail}")


def explore(
    model: "Design",
    check: Optional[Sequence[str]] = None,
    max_states: int = 2_000_000,
) -> Report:
    """Breadth-first search of ``model``'s states with a visited set; stops at the first
    violation of an invariant named in ``check`` (all by default) and returns its trace, the
    shortest one."""
    names = set(INVARIANTS if check is None else check)
    t0 = time.perf_counter()
    init = model.initial()
    parent: Dict[Hashable, Tuple[Optional[Hashable], str]] = {init: (None, "start")}
    queue = deque([init])
    transitions = 0

    def trace(state: Hashable) -> List[str]:
        steps = []
        while state is not None:
            state, label = parent[state]
            steps.append(label)
        return steps[::-1][1:]

    while queue:
        state = queue.popleft()
        progress = False
        for label, nxt, is_fault in model.successors(state):
            transitions += 1
            progress = progress or not is_fault
            if nxt in parent:
                continue
            parent[nxt] = (state, label)
            bad = [v for v in model.violations(state, nxt) if v in names]
            if bad:
                return Report(model.name, len(parent), transitions, bad[0], trace(nxt), False,
                              time.perf_counter() - t0, model.describe(nxt))  # fmt: skip
            if len(parent) >= max_states:
                return Report(model.name, len(parent), transitions, None, [], False,
                              time.perf_counter() - t0)  # fmt: skip
            queue.append(nxt)
        if not progress and not model.finished(state):
            kind = model.stuck(state)
            if kind in names:
                return Report(model.name, len(parent), transitions, kind, trace(state), False,
                              time.perf_counter() - t0, model.describe(state))  # fmt: skip
    return Report(model.name, len(parent), transitions, None, [], True, time.perf_counter() - t0)


class Design:
    """The interface :func:`explore` drives."""

    name = "design"

    def initial(self) -> Hashable:
        raise NotImplementedError

    def successors(self, state: Hashable) -> Iterator[Tuple[str, Hashable, bool]]:
        """(label, next state, whether the step is a fault) for every enabled step."""
        raise NotImplementedError

    def violations(self, prev: Hashable, state: Hashable) -> List[str]:
        raise NotImplementedError

    def finished(self, state: Hashable) -> bool:
        """Whether a state without progress steps is fine (see ``progress``)."""
        raise NotImplementedError

    def describe(self, state: Hashable) -> str:
        return repr(state)

    def stuck(self, state: Hashable) -> str:
        """The invariant a state without progress steps violates (``progress``; the staged
        design tells ``wedged`` apart)."""
        return "progress"


# ---------------------------------------------------------------------------------- shared
@lru_cache(maxsize=None)
def parse(text: str) -> Generation:
    """The real ``Generation.from_json`` (cached: the explorer parses the same few often)."""
    return Generation.from_json(text)


def next_generation(layout: JobLayout, gen: Generation, alive: Sequence[int]) -> Generation:
    """The coordinator's failure generation after ``gen`` for the ``alive`` slots: the real
    ``CompleteReplicas`` assignment (as ``Coordinator._publish_change`` makes it)."""
    replicas, spares = CompleteReplicas().assign(layout, sorted(alive))
    members = {s: 0 for r in replicas for s in layout.replica_slots(r)}
    return Generation(
        number=gen.number + 1,
        replicas=tuple(replicas),
        members=members,
        spares=tuple(spares),
        lost=tuple(sorted(set(gen.members) - set(alive))),
        reason="death",
        abort=None if replicas else "every data-parallel replica has lost a rank",
        published_at=0.0,
        layout={"tp": layout.tp, "pp": layout.pp, "dp": layout.dp},
    )


def first_generation(layout: JobLayout) -> Generation:
    slots = list(range(layout.world_size))
    replicas, _ = CompleteReplicas().assign(layout, slots)
    return Generation(number=0, replicas=tuple(replicas), members={s: 0 for s in slots},
                      reason="start", published_at=0.0,
                      layout={"tp": layout.tp, "pp": layout.pp, "dp": layout.dp})  # fmt: skip


def my_samples(slot: int, gen: Generation, n_samples: int) -> Tuple[int, ...]:
    """The samples of an iteration that ``slot`` processes in ``gen`` (a model of the takeover
    plan: a replica's own sample, and those of missing replicas spread over the members)."""
    replicas = list(gen.replicas)
    owner = {s: (s if s in replicas else replicas[s % len(replicas)]) for s in range(n_samples)}
    return tuple(s for s in range(n_samples) if owner[s] == slot)


RUN, HUNG, CRASHED, DONE, EXITED = "run", "hung", "crashed", "done", "exited"


def member_violations(members: Sequence, n_samples: int) -> List[str]:
    """State invariants on the members (both designs)."""
    out = []
    full = tuple(range(n_samples))
    for m in members:
        if m.lastread < m.maxseen:
            out.append("generations_only_increase")
        if len(m.ledger) != m.committed or any(step != full for step in m.ledger):
            out.append("samples_exactly_once")
    live = [m for m in members if m.status in (RUN, HUNG, DONE)]
    by_it: Dict[int, tuple] = {}
    for m in live:
        if by_it.setdefault(m.committed, m.ledger) != m.ledger:
            out.append("same_state")
    return out


def decision_violations(decisions: FrozenSet[Tuple[int, int, str]]) -> List[str]:
    outcomes: Dict[Tuple[int, int], set] = {}
    for g, i, what in decisions:
        outcomes.setdefault((g, i), set()).add(what)
    return ["agreement"] if any(len(v) > 1 for v in outcomes.values()) else []


def publish_violations(published: FrozenSet[tuple], seen: FrozenSet[tuple]) -> List[str]:
    """``published``: (number, content, writer, whether the writer held the leadership when
    its write landed); ``seen``: (number, content) of every generation a member adopted."""
    contents: Dict[int, str] = {}
    for number, content in seen:
        if contents.setdefault(number, content) != content:
            return ["one_leader_per_term"]  # members run two different generations ``number``
    for number, content, _, held in published:
        if not held:
            return ["one_leader_per_term"]  # a deposed leader's write landed
        if contents.get(number, content) != content:
            return ["one_leader_per_term"]  # a generation in use rewritten by another leader
    return []


def heal(arrivals: Dict[int, Tuple[int, tuple]]) -> Tuple[int, tuple]:
    """The heal's choice (``RecoverySession.on_built``): the highest committed iteration among
    the world's members, and the state of the first member (in rank order) at it."""
    target = max(c for c, _ in arrivals.values())
    source = min(s for s, (c, _) in arrivals.items() if c == target)
    return target, arrivals[source][1]


# ================================================================================== new design
class EMember(NamedTuple):
    status: str
    pc: str
    lease: int
    cur: int = -1
    """The generation this member is in (or waits to leave)."""
    gen: str = ""
    """Its JSON."""
    committed: int = 0
    ledger: tuple = ()
    grads: tuple = ()
    want: str = ""
    maxseen: int = -1
    lastread: int = -1
    hot: int = 0
    """The hot store (its leader's index) this member's client talks to."""


class ELeader(NamedTuple):
    status: str
    pc: str
    lease: int = 0
    term: int = 0
    watch: tuple = ()
    pending: str = ""
    seen_mod: int = 0
    fresh: bool = False
    """Elected after another leader: its first publish is the takeover (a new generation and
    ``hot_store`` naming its own, new store)."""


class EState(NamedTuple):
    etcd: tuple
    members: Tuple[EMember, ...]
    leaders: Tuple[ELeader, ...]
    pool: FrozenSet[tuple]
    """All-reduce contributions: (generation, iteration, slot, samples)."""
    published: FrozenSet[tuple]
    decisions: FrozenSet[tuple]
    seen: FrozenSet[tuple]
    faults: int
    fenced_acted: bool = False
    """A member whose lease had ended wrote to the store or advanced its state."""
    hot: Tuple[Optional[tuple], ...] = ()
    """The hot TCPStore of each candidate (sorted key/value pairs; None: never served)."""


@dataclass
class EtcdDesign(Design):
    """The new design (module docstring); the switches turn one of its rules off, to show the
    checker catches what each rule prevents.

    Abstractions of the hot path: the first abort's ``add`` and its decision key are one step;
    the members read the generation on etcd (the real ones read the hot store, which the
    coordinator writes after etcd); the takeover's generation is the old one's members (the
    model's leaders run no ranks; the real takeover declares the old leader's ranks dead)."""

    n_members: int = 3
    n_candidates: int = 2
    iterations: int = 1
    faults: int = 2
    fencing: bool = True
    """Leader writes compare the leader key's create revision with the leader's term."""
    gen_compare: bool = True
    """Generation ``n + 1`` is written only if ``gen``'s mod revision is the one read with ``n``."""
    doubt_decides: bool = False
    """The rule shown wrong: a member in doubt (its hot store moved during the vote) claims
    ABORT on etcd (create-if-absent, first claim stands) and decides what stands, while the
    members that committed on the hot store claimed nothing."""
    member_fencing: bool = True
    """Every member request compares the member's key with its lease."""
    name: str = "etcd"
    layout: JobLayout = field(init=False)

    def __post_init__(self) -> None:
        self.layout = JobLayout(tp=1, pp=1, dp=self.n_members)

    # ------------------------------------------------------------------ states
    def initial(self) -> EState:
        """Generation 0's world formed, every member in iteration 1's all-reduce, coordinator 0
        elected (the other candidates campaign when the leader key goes)."""
        etcd = FakeEtcd()
        gen0 = first_generation(self.layout)
        st = EState((), (), (), frozenset(), frozenset(), frozenset(),
                    frozenset({(0, gen0.to_json())}), 0)  # fmt: skip
        members = []
        for m in range(self.n_members):
            lease = etcd.grant(10.0)
            etcd.put(f"member/{m}", "up", lease)
            members.append(EMember(RUN, "allreduce", lease, cur=0, gen=gen0.to_json(),
                                   maxseen=0, lastread=0))  # fmt: skip
            st = st._replace(pool=st.pool | {(0, 1, m, my_samples(m, gen0, self.n_members))})
        etcd.put("gen", gen0.to_json())
        lease = etcd.grant(5.0)
        term = etcd.put("leader", "0", lease)
        etcd.put("hot_store", "0:-1")  # the store's leader, the generation it took over at
        leaders = [ELeader(RUN, "lead", lease, term, _ewatch(etcd))]
        leaders += [ELeader(RUN, "campaign") for _ in range(1, self.n_candidates)]
        hot = ((),) + (None,) * (self.n_candidates - 1)
        st = st._replace(etcd=etcd.freeze(), members=tuple(members), leaders=tuple(leaders),
                         hot=hot)  # fmt: skip
        return canonical(st)

    def describe(self, state: EState) -> str:
        etcd = FakeEtcd.thaw(state.etcd)
        gen = parse(etcd.get("gen").value)
        return (
            f"gen {gen.number} members {sorted(gen.members)}; members "
            + ", ".join(f"{i}:{m.status}/{m.pc}@{m.committed}" for i, m in enumerate(state.members))
            + "; leaders "
            + ", ".join(f"{i}:{c.status}/{c.pc}" for i, c in enumerate(state.leaders))
        )

    def finished(self, state: EState) -> bool:
        if not any(c.status == RUN for c in state.leaders):
            return True  # nobody left to lead (every candidate crashed, hung or deposed)
        return all(m.status != RUN for m in state.members)

    def violations(self, prev: EState, state: EState) -> List[str]:
        out = member_violations(state.members, self.n_members)
        if _egen(state.etcd) < _egen(prev.etcd):
            out.append("generations_only_increase")
        out += decision_violations(state.decisions)
        if state.fenced_acted:
            out.append("fenced_changes_nothing")
        return out + publish_violations(state.published, state.seen)

    # ------------------------------------------------------------------ successors
    def successors(self, st: EState) -> Iterator[Tuple[str, EState, bool]]:
        for label, nxt, fault in self._successors(st):
            yield label, canonical(nxt), fault

    def _successors(self, st: EState) -> Iterator[Tuple[str, EState, bool]]:
        live = FakeEtcd.thaw(st.etcd)
        ended = {me.lease for me in st.members if not live.alive(me.lease)}
        for m, me in enumerate(st.members):
            if me.status == RUN:
                for label, nxt in self._member(st, m):
                    # Its etcd writes are what a fence must stop. Its hot-store requests are
                    # not fenced (a TCPStore knows no leases): a rank resumed after it was
                    # declared dead can still add the vote of its old generation, or read its
                    # outcome, and the counter makes that outcome every member's (agreement).
                    if me.lease in ended and nxt.etcd[1] != st.etcd[1]:
                        nxt = nxt._replace(fenced_acted=True)
                    yield f"member {m}: {label}", nxt, False
        for c, ld in enumerate(st.leaders):
            if ld.status == RUN:
                step = self._leader(st, c)
                if step is not None:
                    yield f"coordinator {c}: {step[0]}", step[1], False
                elif ld.lease and not live.alive(ld.lease):
                    # Idle with its lease gone (it hung past the TTL and resumed): its keepalive
                    # (EtcdControl._keep_alive, every TTL/3) finds the lease expired and the node
                    # exits (store_host._control_lost). Without this step a resumed deposed
                    # leader would idle for ever and count as one that can still lead.
                    yield f"coordinator {c}: its keepalive finds the lease gone; exits", self._set(
                        st, "coordinator", c, ld._replace(status=EXITED)
                    ), False
        # Faults: crash or hang a running actor; resume or crash a hung one; a lease expires
        # when its holder has crashed or hangs.
        etcd = FakeEtcd.thaw(st.etcd)
        actors = [("member", m, a) for m, a in enumerate(st.members)] + [
            ("coordinator", c, a) for c, a in enumerate(st.leaders)
        ]
        for kind, i, a in actors:
            if a.status in (CRASHED, HUNG) and a.lease and etcd.alive(a.lease):
                e = etcd.copy()
                e.expire(a.lease)
                yield f"{kind} {i}: its lease {a.lease} expires", st._replace(
                    etcd=e.freeze()
                ), False
            if a.status == HUNG:
                yield f"{kind} {i}: resumes", self._set(st, kind, i, a._replace(status=RUN)), True
            if a.status in (RUN, HUNG) and st.faults < self.faults:
                for what, status in (("crashes", CRASHED), ("hangs", HUNG)):
                    if status == HUNG and a.status == HUNG:
                        continue
                    nxt = self._set(st, kind, i, a._replace(status=status))
                    yield f"{kind} {i}: {what}", nxt._replace(faults=st.faults + 1), True

    @staticmethod
    def _set(st: EState, kind: str, i: int, actor: tuple) -> EState:
        if kind == "member":
            return st._replace(members=st.members[:i] + (actor,) + st.members[i + 1 :])
        return st._replace(leaders=st.leaders[:i] + (actor,) + st.leaders[i + 1 :])

    # ------------------------------------------------------------------ a member
    def _member(self, st: EState, m: int) -> Iterator[Tuple[str, EState]]:
        """One store request of member ``m`` (a transaction conditioned on its lease: a member
        declared dead changes nothing and exits)."""
        me = st.members[m]
        etcd = FakeEtcd.thaw(st.etcd)
        mine = [Compare(f"member/{m}", "lease", "==", me.lease)] if self.member_fencing else []
        fenced = not etcd.alive(me.lease)
        gen_now = _egen(st.etcd)

        def done(new: EMember, e: FakeEtcd = etcd, **changes) -> EState:
            return _eset(st, m, new, e, **changes)

        def exited(why: str) -> Tuple[str, EState]:
            return f"finds its lease gone; exits ({why})", done(me._replace(status=EXITED))

        job_done = etcd.get("done") is not None
        if me.pc == "read_gen":  # wait for a generation newer than the current one
            if not (fenced or gen_now > me.cur or job_done):
                return
            r = etcd.txn(mine, [Get("gen"), Get("done"), Get("hot_store")])
            if not r.succeeded:
                yield exited("read gen")
                return
            if r.responses[1] is not None:  # wait_for_membership: training finished
                yield "finds the job done; stops", done(me._replace(status=DONE, grads=()))
                return
            text = r.responses[0].value
            gen = parse(text)
            # The generation is read from the store that published it: the hot store etcd
            # names (a stale store has not got it; its client moves on first).
            hot = int(r.responses[2].value.split(":")[0])
            seen = me._replace(maxseen=max(me.maxseen, gen.number), lastread=gen.number, hot=hot)
            if gen.abort or m not in gen.members:
                yield f"reads generation {gen.number}: not a member; exits", done(
                    seen._replace(status=EXITED)
                )
                return
            yield f"reads generation {gen.number}", done(
                seen._replace(pc="arrive", cur=gen.number, gen=text),
                seen=st.seen | {(gen.number, text)},
            )
        elif me.pc == "arrive":
            state = json.dumps([me.committed, me.ledger])
            r = etcd.txn(mine, [Put(f"arrive/{me.cur}/{m}", state)])
            if not r.succeeded:
                yield exited("arrive")
                return
            yield f"arrives in generation {me.cur}", done(me._replace(pc="await_world"), etcd)
        elif me.pc == "await_world":
            gen = parse(me.gen)
            arrived = {kv.key for kv in etcd.range(f"arrive/{me.cur}/")}
            complete = all(f"arrive/{me.cur}/{s}" in arrived for s in gen.members)
            if not (fenced or complete or gen_now > me.cur or job_done):
                return
            r = etcd.txn(mine, [Range(f"arrive/{me.cur}/"), Get("gen"), Get("done")])
            if not r.succeeded:
                yield exited("rendezvous")
                return
            if r.responses[2] is not None and not complete:
                yield "finds the job done; stops", done(me._replace(status=DONE, grads=()))
                return
            if parse(r.responses[1].value).number > me.cur:
                yield "sees a newer generation before its world formed", done(
                    me._replace(pc="read_gen")
                )
                return
            arrivals = {int(kv.key.rsplit("/", 1)[1]): json.loads(kv.value)
                        for kv in r.responses[0]}  # fmt: skip
            target, ledger = heal({s: (c, tuple(tuple(x) for x in ld))
                                   for s, (c, ld) in arrivals.items()})  # fmt: skip
            new = me._replace(committed=target, ledger=ledger)
            yield f"world {me.cur} formed; healed to iteration {target}", self._train(
                st, m, new, etcd
            )
        elif me.pc == "allreduce":
            gen = parse(me.gen)
            i = me.committed + 1
            got = {c for c in st.pool if c[0] == me.cur and c[1] == i and c[2] in gen.members}
            if len(got) == len(gen.members):  # the all-reduce completes: vote on the hot store
                grads = tuple(sorted(s for c in got for s in c[3]))
                voter = me._replace(grads=grads)
                if self._reachable(st, me.hot):
                    key = _votes_key(me.cur, i)
                    count = int(_get(st.hot[me.hot], key) or 0) + 1
                    hot = _hot_set(st, me.hot, key, count)
                    if count == len(gen.members):  # completes the count: announce, commit
                        nxt, what = voter._replace(pc="commit_set"), "completes the count"
                        yield f"all-reduce of iteration {i} done; votes ({what})", done(
                            nxt, hot=hot
                        )
                    elif count >= ABORT_WEIGHT:  # an abort came first (it found this missing)
                        yield f"all-reduce of iteration {i} done; votes after an abort", (
                            self._decide(st._replace(hot=hot), m, voter, ABORT, etcd)
                        )
                    else:
                        yield f"all-reduce of iteration {i} done; votes ({count})", done(
                            voter._replace(pc="hot_wait"), hot=hot
                        )
                yield from self._doubt(st, m, voter, f"all-reduce of iteration {i} done")
            if fenced or gen_now > me.cur:  # the watchdog: a newer generation ends the world
                e = FakeEtcd.thaw(st.etcd)
                r = e.txn(mine, [Get("gen")])
                if not r.succeeded:
                    yield exited("watchdog")
                    return
                yield "watchdog: a newer generation; aborts the iteration", _eset(
                    st, m, me._replace(pc="hot_abort", want=ABORT), e
                )
        elif me.pc == "finish":  # training finished: the durable ``done`` key
            r = etcd.txn(mine, [Put("done", str(me.committed))])
            if not r.succeeded:
                yield exited("done")
                return
            yield "finishes; sets done", done(me._replace(status=DONE), etcd)
        elif me.pc == "commit_set":  # commit._commit: the commit key, then apply
            if self._reachable(st, me.hot):
                hot = _hot_set(st, me.hot, _commit_key(me.cur, me.committed + 1), "")
                yield "sets the commit key", self._decide(st._replace(hot=hot), m, me, COMMIT,
                                                          etcd)  # fmt: skip
            yield from self._doubt(st, m, me, "before its commit key")
        elif me.pc == "hot_wait":  # commit.vote's wait: the commit key, the counter, a newer gen
            gen = parse(me.gen)
            n, i = len(gen.members), me.committed + 1
            if self._reachable(st, me.hot):
                store = st.hot[me.hot]
                count = int(_get(store, _votes_key(me.cur, i)) or 0)
                if _get(store, _commit_key(me.cur, i)) is not None:
                    yield "finds the commit key", self._decide(st, m, me, COMMIT, etcd)
                elif count == n:  # every vote in, no abort: _outcome's _commit
                    hot = _hot_set(st, me.hot, _commit_key(me.cur, i), "")
                    yield "finds every vote in; sets the commit key", self._decide(
                        st._replace(hot=hot), m, me, COMMIT, etcd
                    )
                elif count >= ABORT_WEIGHT:
                    outcome = (ABORT if count % ABORT_WEIGHT < n
                               else str(_get(store, _decision_key(me.cur, i))))  # fmt: skip
                    yield f"finds an abort in the counter: {outcome}", self._decide(
                        st, m, me, outcome, etcd
                    )
                elif gen_now > me.cur:  # _superseded: abort (within the vote)
                    yield "finds a newer generation; aborts", done(
                        me._replace(pc="hot_abort", want="")
                    )
            yield from self._doubt(st, m, me, "waiting for the outcome")
        elif me.pc == "hot_abort":  # commit.abort: the first abort decides from the count
            gen = parse(me.gen)
            n, i = len(gen.members), me.committed + 1
            if self._reachable(st, me.hot):
                key = _votes_key(me.cur, i)
                total = int(_get(st.hot[me.hot], key) or 0)
                hot = _hot_set(st, me.hot, key, total + ABORT_WEIGHT)
                if total < ABORT_WEIGHT:  # the first abort: writes the decision (one step)
                    outcome = COMMIT if total == n else ABORT
                    hot = _hot_set(st._replace(hot=hot), me.hot, _decision_key(me.cur, i),
                                   outcome)  # fmt: skip
                    if outcome == COMMIT:
                        hot = _hot_set(st._replace(hot=hot), me.hot, _commit_key(me.cur, i), "")
                else:
                    decision = _get(st.hot[me.hot], _decision_key(me.cur, i))
                    outcome = ABORT if total % ABORT_WEIGHT < n else str(decision)
                yield f"aborts on the hot store: {outcome}", self._decide(
                    st._replace(hot=hot), m, me, outcome, etcd
                )
            yield from self._doubt(st, m, me, "aborting")
        elif me.pc == "claim":  # only with doubt_decides (the rule shown wrong)
            i = me.committed + 1
            key = _outcome_key(me.cur, i)
            absent = Compare(key, "create", "==", 0)
            r = etcd.txn(mine + [absent], [Put(key, me.want)], [Get(f"member/{m}"), Get(key)])
            if r.succeeded:
                yield f"claims {me.want}", self._decide(st, m, me, me.want, etcd)
                return
            holder, outcome = r.responses
            if self.member_fencing and (holder is None or holder.lease != me.lease):
                yield exited("claim")
                return
            yield f"finds {outcome.value} claimed", self._decide(st, m, me, outcome.value, etcd)

    # ------------------------------------------------------------------ the hot store
    @staticmethod
    def _reachable(st: EState, c: int) -> bool:
        """Whether candidate ``c``'s hot store answers: it serves one, and runs (a hung
        leader's store answers nothing; a crashed or exited one's is gone)."""
        return st.hot[c] is not None and st.leaders[c].status in (RUN, DONE)

    def _doubt(self, st: EState, m: int, me: EMember, when: str) -> Iterator[Tuple[str, EState]]:
        """The vote cut off by the hot store's loss: once etcd's ``hot_store`` names another
        store (a takeover), the member's client follows it and raises ``StoreFailedOver``; the
        member does not apply the step and waits for the takeover's generation (the regroup's
        heal settles the vote). With :attr:`doubt_decides`, it claims ABORT on etcd instead."""
        etcd = FakeEtcd.thaw(st.etcd)
        now = etcd.get("hot_store")
        if now is None or int(now.value.split(":")[0]) == me.hot:
            return
        mine = [Compare(f"member/{m}", "lease", "==", me.lease)] if self.member_fencing else []
        r = etcd.txn(mine, [Get("hot_store")])
        if not r.succeeded:
            yield "finds its lease gone; exits (failover)", _eset(
                st, m, me._replace(status=EXITED), etcd
            )
            return
        store, taken = (int(x) for x in now.value.split(":"))
        moved = me._replace(hot=store)
        if me.cur > taken or (me.pc == "hot_abort" and me.want == ABORT):
            # AsyncVoter._after_failover: a vote of a generation made after the takeover only
            # met a stale client: cast again on the new store. The step hook's abort (a member
            # that did not vote) is repeated there (its client follows the store).
            pc = "hot_abort" if me.pc == "hot_abort" and me.want == ABORT else "allreduce"
            yield f"{when}: its store moved; repeats on store {store}", _eset(
                st, m, moved._replace(pc=pc), etcd
            )
            return
        if self.doubt_decides:
            yield f"{when}: its store moved; in doubt, claims abort", _eset(
                st, m, moved._replace(pc="claim", want=ABORT), etcd
            )
            return
        yield f"{when}: its store moved; in doubt, does not apply it", _eset(
            st, m, moved._replace(pc="read_gen", grads=()), etcd
        )

    def _train(self, st: EState, m: int, me: EMember, etcd: FakeEtcd) -> EState:
        """Start the next iteration (or finish): this member's contribution to the world's
        all-reduce (the collective, not a store request)."""
        if me.committed >= self.iterations:
            return _eset(st, m, me._replace(pc="finish"), etcd)
        i = me.committed + 1
        samples = my_samples(m, parse(me.gen), self.n_members)
        pool = st.pool | {(me.cur, i, m, samples)}
        return _eset(st, m, me._replace(pc="allreduce"), etcd, pool=pool)

    def _decide(self, st: EState, m: int, me: EMember, outcome: str, etcd: FakeEtcd) -> EState:
        i = me.committed + 1
        decisions = st.decisions | {(me.cur, i, outcome)}
        if outcome == COMMIT:
            new = me._replace(committed=i, ledger=me.ledger + (me.grads,), grads=())
            return self._train(st._replace(decisions=decisions), m, new, etcd)
        return _eset(st, m, me._replace(pc="read_gen", grads=()), etcd, decisions=decisions)

    # ------------------------------------------------------------------ a coordinator
    def _leader(self, st: EState, c: int) -> Optional[Tuple[str, EState]]:
        ld = st.leaders[c]
        etcd = FakeEtcd.thaw(st.etcd)

        def put(new: ELeader, **changes) -> EState:
            return st._replace(leaders=st.leaders[:c] + (new,) + st.leaders[c + 1 :],
                               etcd=etcd.freeze(), **changes)  # fmt: skip

        # A deposed leader does not know it before a request tells it (its keepalive may not
        # have failed yet when it sends a write): the transactions' compares are the fencing.
        if ld.pc == "campaign":  # no leader: get a lease and try to become the leader
            if etcd.get("leader") is not None:
                return None
            # Two requests in one step: a crash between them leaves an unused lease, harmless.
            lease = etcd.grant(5.0)
            r = etcd.txn([Compare("leader", "create", "==", 0)], [Put("leader", str(c), lease)])
            return f"is elected (lease {lease}, term {r.revision})", put(
                ld._replace(pc="lead", lease=lease, term=r.revision, watch=(), fresh=True)
            )
        if ld.pc == "lead":  # read the generation and the members; publish if one is lost
            watch = _ewatch(etcd)
            if watch == ld.watch:
                return None
            r = etcd.txn([Compare("leader", "lease", "==", ld.lease)],
                         [Get("gen"), Range("member/")])  # fmt: skip
            if not r.succeeded:
                return "finds its leadership gone; exits", put(ld._replace(status=EXITED))
            kv, members = r.responses
            gen = parse(kv.value)
            if gen.abort:
                return "sees the abort generation; stops", put(ld._replace(status=DONE))
            alive = [int(k.key.split("/")[1]) for k in members]
            if set(gen.members) <= set(alive) and not ld.fresh:
                return f"reads generation {gen.number}: nothing lost", put(ld._replace(watch=watch))
            # A takeover always publishes a generation: the old leader's ranks are declared
            # dead (store_host._take_over_etcd), so every member regroups.
            new = next_generation(self.layout, gen, [s for s in alive if s in gen.members])
            what = "takes over: " if ld.fresh else ""
            return f"{what}decides generation {new.number} {sorted(new.members)}", put(
                ld._replace(
                    pc="publish", watch=watch, pending=new.to_json(), seen_mod=kv.mod_revision
                )
            )
        if ld.pc == "publish":
            compares = []
            if self.fencing:
                compares.append(Compare("leader", "create", "==", ld.term))
            if self.gen_compare:
                compares.append(Compare("gen", "mod", "==", ld.seen_mod))
            holder = etcd.get("leader")
            held = holder is not None and holder.create_revision == ld.term
            # The takeover's publish also names its new, empty hot store (the votes of the
            # lost store are gone with it; the durable state is on etcd).
            taken = parse(ld.pending).number - 1
            ops = [Put("gen", ld.pending)]
            if ld.fresh:
                ops.append(Put("hot_store", f"{c}:{taken}"))
            r = etcd.txn(compares, ops, [Get("leader")])
            number = parse(ld.pending).number
            if r.succeeded:
                published = st.published | {(number, ld.pending, ld.term, held)}
                hot = st.hot
                if ld.fresh:
                    hot = hot[:c] + ((),) + hot[c + 1 :]
                what = " and its hot store" if ld.fresh else ""
                return f"publishes generation {number}{what}", put(
                    ld._replace(pc="lead", watch=(), fresh=False), published=published, hot=hot
                )
            leader = r.responses[0]
            if leader is None or leader.create_revision != ld.term:
                return "finds its leadership gone; exits", put(ld._replace(status=EXITED))
            return f"generation {number} lost a race; reads again", put(
                ld._replace(pc="lead", watch=())
            )
        raise AssertionError(ld.pc)


def _egen(frozen: tuple) -> int:
    for kv in frozen[1]:
        if kv.key == "gen":
            return parse(kv.value).number
    return -1


def _ewatch(etcd: FakeEtcd) -> tuple:
    """What a leader watches: the generation key and the member keys."""
    gen = etcd.get("gen")
    return (gen.mod_revision if gen else 0, tuple(kv.key for kv in etcd.range("member/")))


def _hot_set(st: EState, c: int, key: str, value: object) -> Tuple[Optional[tuple], ...]:
    """``st.hot`` with ``key`` = ``value`` in candidate ``c``'s store."""
    return st.hot[:c] + (_set(st.hot[c], key, value),) + st.hot[c + 1 :]


def _eset(st: EState, m: int, me: EMember, etcd: FakeEtcd, **changes) -> EState:
    return st._replace(members=st.members[:m] + (me,) + st.members[m + 1 :], etcd=etcd.freeze(),
                       **changes)  # fmt: skip


KEYS_WITH_REVISIONS = ("gen", "leader")
"""The keys whose revisions an actor compares (the leader's term, the generation it read)."""


def canonical(st: EState) -> EState:
    """``st`` with revisions nobody reads forgotten and the rest renumbered in order.

    The actors compare revisions only for equality and order, and only those of
    :data:`KEYS_WITH_REVISIONS` and the ones they hold (a leader's term and the ``gen`` revision
    it read): an order-preserving renumbering of those, and a constant for the other keys'
    (nonzero: they exist), changes no step's outcome, and merges the states that differ only
    in the order in which unrelated keys were written.
    """
    revision, kvs, leases, next_lease = st.etcd
    used = {revision}
    for kv in kvs:
        if kv.key in KEYS_WITH_REVISIONS:
            used.update((kv.create_revision, kv.mod_revision))
    for ld in st.leaders:
        used.update((ld.term, ld.seen_mod))
    for p in st.published:
        used.add(p[2])
    used.discard(0)
    new = {r: i + 2 for i, r in enumerate(sorted(used))}  # 1: the other keys' revision
    new[0] = 0
    out = []
    for kv in kvs:  # most keys are canonical already (a new KV only for the ones that change)
        if kv.key in KEYS_WITH_REVISIONS:
            c, m = new[kv.create_revision], new[kv.mod_revision]
            if (c, m) != (kv.create_revision, kv.mod_revision):
                kv = KV(kv.key, kv.value, c, m, kv.version, kv.lease)
        elif (kv.create_revision, kv.mod_revision, kv.version) != (1, 1, 1):
            kv = KV(kv.key, kv.value, 1, 1, 1, kv.lease)
        out.append(kv)
    kvs = tuple(out)
    leaders = tuple(
        (
            ld
            if (new[ld.term], new[ld.seen_mod]) == (ld.term, ld.seen_mod)
            else ld._replace(term=new[ld.term], seen_mod=new[ld.seen_mod])
        )
        for ld in st.leaders
    )
    published = frozenset((n, c, new[t], h) for n, c, t, h in st.published)
    return st._replace(etcd=(new[revision], kvs, leases, next_lease), leaders=leaders,
                       published=published)  # fmt: skip


# ================================================================================== old design
class AMember(NamedTuple):
    status: str
    pc: str
    store: str = "P"
    """The store its failover client talks to: the primary ``P`` or, after a failover, ``S``."""
    cur: int = 0
    gen: str = ""
    committed: int = 0
    ledger: tuple = ()
    grads: tuple = ()
    count: int = 0
    want: str = ""
    standby_lost: bool = False
    maxseen: int = 0
    lastread: int = 0


class ACoord(NamedTuple):
    status: str
    pc: str
    gen: str = ""
    dead: Tuple[int, ...] = ()
    pending: str = ""
    standby_lost: bool = False


class ACopy(NamedTuple):
    status: str
    pc: str
    gen: Optional[str] = None
    rest: tuple = ()


class AState(NamedTuple):
    P: tuple
    S: tuple
    nodes: Tuple[str, str]
    """Node 0 (the primary store) and node 1 (the standby): run, hung or crashed."""
    members: Tuple[AMember, ...]
    coords: Tuple[ACoord, ACoord]
    """Node 0's coordinator; node 1's, started by the takeover."""
    copy: ACopy
    pool: FrozenSet[tuple]
    published: FrozenSet[tuple]
    decisions: FrozenSet[tuple]
    seen: FrozenSet[tuple]
    reported: FrozenSet[int]
    faults: int


VOTE_PCS = ("vote_add", "vote_wait", "vote_look", "superseded", "abort_add", "set_decision",
            "outcome_poll", "commit_set")  # fmt: skip
"""Requests of the vote worker's client, made with ``raise_on_failover``."""

STANDBY_PCS = ("commit_claim", "after_failover", "resolve")
"""Requests made to the standby (``on_standby``, or after the failover)."""


def _get(store: tuple, key: str) -> Optional[object]:
    for k, v in store:
        if k == key:
            return v
    return None


def _set(store: tuple, key: str, value: object) -> tuple:
    d = dict(store)
    d[key] = value
    return tuple(sorted(d.items()))


def _gen_of(store: tuple) -> Tuple[int, str]:
    """A member's read of the current generation (``generation_number`` and its record)."""
    number = int(_get(store, "gen"))
    return number, str(_get(store, f"gen/{number}"))


@dataclass
class MirrorDesign(Design):
    """The old design: node 0 serves the primary store and the coordinator; node 1 the standby,
    its copy thread and, after a takeover, a second coordinator (module docstring)."""

    n_members: int = 3
    iterations: int = 1
    faults: int = 2
    kinds: Tuple[str, ...] = ("rank crash", "rank hang", "node crash", "node hang")
    """The faults drawn (each counts against ``faults``; a resume is free)."""
    name: str = "mirror"
    layout: JobLayout = field(init=False)

    def __post_init__(self) -> None:
        self.layout = JobLayout(tp=1, pp=1, dp=self.n_members)

    def initial(self) -> AState:
        """Generation 0 published on both stores (the copy ran once), its world formed, every
        member in iteration 1's all-reduce."""
        gen0 = first_generation(self.layout)
        store = tuple(sorted({"gen": "0", "gen/0": gen0.to_json()}.items()))
        members = tuple(AMember(RUN, "allreduce", gen=gen0.to_json())
                        for _ in range(self.n_members))  # fmt: skip
        pool = frozenset((0, 1, m, my_samples(m, gen0, self.n_members))
                         for m in range(self.n_members))  # fmt: skip
        coords = (ACoord(RUN, "scan", gen0.to_json()), ACoord("idle", "resume"))
        return AState(store, store, (RUN, RUN), members, coords, ACopy(RUN, "c_read_gen"), pool,
                      frozenset(), frozenset(), frozenset({(0, gen0.to_json())}), frozenset(),
                      0)  # fmt: skip

    def describe(self, st: AState) -> str:
        return (
            f"primary gen {_get(st.P, 'gen')}, standby gen {_get(st.S, 'gen')}, nodes {st.nodes}; "
            + ", ".join(f"{i}:{m.status}/{m.pc}@{m.committed} on {m.store}"
                        for i, m in enumerate(st.members))  # fmt: skip
        )

    def finished(self, st: AState) -> bool:
        return True  # the old design's hangs are known (issue 43); only safety is checked

    def violations(self, prev: AState, st: AState) -> List[str]:
        out = member_violations(st.members, self.n_members)
        for store in ("P", "S"):
            if int(_get(getattr(st, store), "gen")) < int(_get(getattr(prev, store), "gen")):
                out.append("generations_only_increase")
        return out + decision_violations(st.decisions) + publish_violations(st.published, st.seen)

    # ------------------------------------------------------------------ successors
    def _up(self, st: AState, store: str) -> str:
        return st.nodes[0 if store == "P" else 1]

    def successors(self, st: AState) -> Iterator[Tuple[str, AState, bool]]:
        for m, me in enumerate(st.members):
            if me.status == RUN:
                for label, nxt in self._member(st, m):
                    yield f"member {m}: {label}", nxt, False
        for c, co in enumerate(st.coords):
            if co.status == RUN:
                step = self._coord(st, c)
                if step is not None:
                    yield f"coordinator on node {c}: {step[0]}", step[1], False
        if st.copy.status == RUN:
            for label, nxt in self._copy(st):
                yield f"standby copy thread: {label}", nxt, False
        yield from self._environment(st)

    def _environment(self, st: AState) -> Iterator[Tuple[str, AState, bool]]:
        # A dead or hung rank is reported dead (its supervisor, or the coordinator's heartbeat
        # check) on the store that serves.
        serving = "P" if st.nodes[0] == RUN else ("S" if _get(st.S, PRIMARY_KEY) else None)
        for m, me in enumerate(st.members):
            if me.status in (CRASHED, HUNG) and m not in st.reported and serving:
                if serving == "S" and st.nodes[1] != RUN:
                    continue
                nxt = st._replace(reported=st.reported | {m})
                nxt = nxt._replace(**{serving: _set(getattr(st, serving), f"dead/{m}", "1")})
                yield f"rank {m} is reported dead on {serving}", nxt, False
        budget = st.faults < self.faults
        for m, me in enumerate(st.members):
            if me.status == HUNG and (m > 1 or st.nodes[m] == RUN):
                yield f"member {m}: resumes", self._member_set(st, m, me._replace(status=RUN)), True
            if budget and me.status in (RUN, HUNG) and (m > 1 or st.nodes[m] == RUN):
                for what, status, kind in (("crashes", CRASHED, "rank crash"),
                                           ("hangs", HUNG, "rank hang")):  # fmt: skip
                    if me.status == status or kind not in self.kinds:
                        continue
                    nxt = self._member_set(st, m, me._replace(status=status))
                    yield f"member {m}: {what}", nxt._replace(faults=st.faults + 1), True
        for node in (0, 1):
            if st.nodes[node] == HUNG:
                yield f"node {node}: resumes", self._node(st, node, RUN), True
            if budget and st.nodes[node] in (RUN, HUNG) and "node crash" in self.kinds:
                yield f"node {node}: crashes", self._node(st, node, CRASHED, True), True
            if budget and st.nodes[node] == RUN and node == 0 and "node hang" in self.kinds:
                yield f"node {node}: hangs", self._node(st, node, HUNG, True), True

    def _node(self, st: AState, node: int, status: str, fault: bool = False) -> AState:
        """Node ``node``'s store and every actor on it change to ``status``."""

        def move(a):
            if status == RUN:
                return a._replace(status=RUN) if a.status == HUNG else a
            return a._replace(status=status) if a.status in (RUN, HUNG) else a

        nodes = (status, st.nodes[1]) if node == 0 else (st.nodes[0], status)
        members = st.members[:node] + (move(st.members[node]),) + st.members[node + 1 :]
        coords = st.coords[:node] + (move(st.coords[node]),) + st.coords[node + 1 :]
        copy = move(st.copy) if node == 1 else st.copy
        return st._replace(nodes=nodes, members=members, coords=coords, copy=copy,
                           faults=st.faults + fault)  # fmt: skip

    @staticmethod
    def _member_set(st: AState, m: int, me: AMember, **changes) -> AState:
        return st._replace(members=st.members[:m] + (me,) + st.members[m + 1 :], **changes)

    # ------------------------------------------------------------------ a member
    def _member(self, st: AState, m: int) -> Iterator[Tuple[str, AState]]:
        me = st.members[m]
        # The standby's outcome claim and the failover's resolution talk to the standby only:
        # the primary's loss is noticed by the next request to it.
        node = self._up(st, "S" if me.pc in STANDBY_PCS else me.store)
        if node == HUNG:
            return  # its requests wait on the silent store (the hang issue 43 reports)
        if node == CRASHED:
            # FailoverStore: a network error; wait for the standby's takeover, then go on there
            # (the vote worker's client raises StoreFailedOver instead: _after_failover).
            if me.store == "S" or me.pc in STANDBY_PCS or st.nodes[1] != RUN:
                yield "its store is lost; exits", self._member_set(
                    st, m, me._replace(status=EXITED)
                )
                return
            if _get(st.S, PRIMARY_KEY) is None:
                return
            pc = "after_failover" if me.pc in VOTE_PCS else me.pc
            yield "fails over to the standby", self._member_set(
                st, m, me._replace(store="S", pc=pc)
            )
            return
        store = getattr(st, me.store)
        g, i = me.cur, me.committed + 1
        votes = _votes_key(g, i)

        def put(new: AMember, key: Optional[str] = None, value: object = None, **changes) -> AState:
            nxt = self._member_set(st, m, new, **changes)
            if key is not None:
                nxt = nxt._replace(**{new.store: _set(store, key, value)})
            return nxt

        def seen(new: AMember, number: int) -> AMember:
            return new._replace(lastread=number, maxseen=max(new.maxseen, number))

        if me.pc == "read_gen":  # wait_for_membership: a generation above the current one
            number, text = _gen_of(store)
            if number <= me.cur:
                return
            gen = parse(text)
            new = seen(me, number)
            if gen.abort or m not in gen.members:
                yield f"reads generation {number}: not a member; exits", put(
                    new._replace(status=EXITED)
                )
                return
            yield f"reads generation {number}", put(
                new._replace(pc="arrive", cur=number, gen=text), seen=st.seen | {(number, text)}
            )
        elif me.pc == "arrive":
            yield f"arrives in generation {g}", put(
                me._replace(pc="await_world"),
                f"arrive/{g}/{m}",
                json.dumps([me.committed, me.ledger]),
            )
        elif me.pc == "await_world":
            gen = parse(me.gen)
            number, _ = _gen_of(store)
            arrivals = {s: _get(store, f"arrive/{g}/{s}") for s in gen.members}
            if number != g:
                yield "sees another generation before its world formed", put(
                    seen(me, number)._replace(pc="read_gen")
                )
            elif all(a is not None for a in arrivals.values()):
                target, ledger = heal(
                    {
                        s: (json.loads(a)[0], tuple(tuple(x) for x in json.loads(a)[1]))
                        for s, a in arrivals.items()
                    }
                )
                new = me._replace(committed=target, ledger=ledger)
                yield f"world {g} formed; healed to iteration {target}", self._train(st, m, new)
        elif me.pc == "allreduce":
            gen = parse(me.gen)
            got = {c for c in st.pool if c[0] == g and c[1] == i and c[2] in gen.members}
            if len(got) == len(gen.members):
                grads = tuple(sorted(s for c in got for s in c[3]))
                yield f"all-reduce of iteration {i} done", put(
                    me._replace(pc="vote_add", grads=grads)
                )
            number, _ = _gen_of(store)
            if number != g:  # the generation watchdog aborts the world
                yield f"watchdog: generation {number}; leaves the world", put(
                    seen(me, number)._replace(pc="read_gen")
                )
        elif me.pc == "vote_add":  # commit.vote
            n = len(parse(me.gen).members)
            count = int(_get(store, votes) or 0) + 1
            new = me._replace(count=count, pc="commit_claim" if count == n else "vote_wait")
            yield f"votes ({count} of {n})", put(new, votes, count)
        elif me.pc == "vote_wait":
            if _get(store, _commit_key(g, i)) is not None:
                yield "sees the commit key", self._decide(st, m, me, COMMIT)
            yield "its wait times out", put(me._replace(pc="vote_look"))
        elif me.pc == "vote_look":
            n = len(parse(me.gen).members)
            count = int(_get(store, votes) or 0)
            yield f"reads the count {count}", put(
                me._replace(count=count, pc="outcome" if count >= n else "superseded")
            )
        elif me.pc == "superseded":  # _superseded: another (failure) generation is current
            number, _ = _gen_of(store)
            new = seen(me, number)._replace(pc="abort_add" if number != g else "vote_wait")
            yield f"reads generation {number}", put(new)
        elif me.pc == "abort_add":  # commit.abort
            n = len(parse(me.gen).members)
            total = int(_get(store, votes) or 0)
            new = me._replace(count=total)
            if total < ABORT_WEIGHT:
                want = COMMIT if total == n else ABORT
                new = new._replace(pc="set_decision", want=want)
            else:
                new = new._replace(pc="outcome")
            yield "adds an abort", put(new, votes, total + ABORT_WEIGHT)
        elif me.pc == "set_decision":
            nxt = put(me._replace(pc="commit_claim"), _decision_key(g, i), me.want)
            if me.want == COMMIT:
                yield "writes the decision commit", nxt
            else:
                yield "writes the decision abort", self._decide(nxt, m, me, ABORT)
        elif me.pc == "outcome":  # commit._outcome, on the count read
            n = len(parse(me.gen).members)
            if me.count < ABORT_WEIGHT:
                yield "every vote in", put(me._replace(pc="commit_claim"))
            elif me.count % ABORT_WEIGHT < n:
                yield "an abort came first", self._decide(st, m, me, ABORT)
            else:
                yield "an abort raced the last vote", put(me._replace(pc="outcome_poll"))
        elif me.pc == "outcome_poll":
            if _get(store, _commit_key(g, i)) is not None:
                yield "finds the commit key", self._decide(st, m, me, COMMIT)
            elif _get(store, _decision_key(g, i)) is not None:
                what = str(_get(store, _decision_key(g, i)))
                yield f"finds the decision {what}", self._decide(st, m, me, what)
            else:
                yield "neither key within decision_wait_s: aborts", self._decide(st, m, me, ABORT)
        elif me.pc == "commit_claim":  # commit._commit: the standby's outcome claim first
            if me.store == "S" or me.standby_lost:
                yield "no standby to claim on", put(me._replace(pc="commit_set"))
            elif st.nodes[1] == CRASHED:
                yield "the standby is unreachable: marked lost for good", put(
                    me._replace(pc="commit_set", standby_lost=True)
                )
            elif st.nodes[1] == RUN:
                key = _outcome_key(g, i)
                won = _get(st.S, key) or COMMIT
                nxt = put(me._replace(pc="commit_set"))._replace(S=_set(st.S, key, won))
                if won != COMMIT:
                    yield f"finds the outcome {won} on the standby", self._decide(nxt, m, me, ABORT)
                else:
                    yield "claims commit on the standby", nxt
        elif me.pc == "commit_set":
            yield "sets the commit key", self._decide(put(me, _commit_key(g, i), ""), m, me, COMMIT)
        elif me.pc == "after_failover":  # AsyncVoter._after_failover
            taken = int(_get(st.S, PRIMARY_KEY))
            if g <= taken:
                yield f"vote of generation {g} cut off (taken at {taken}): resolves", put(
                    me._replace(pc="resolve")
                )
            else:
                yield f"generation {g} is above the takeover's {taken}: votes again", put(
                    me._replace(pc="vote_add")
                )
        elif me.pc == "resolve":  # resolve_after_failover
            key = _outcome_key(g, i)
            value = _get(st.S, key) or ABORT
            nxt = put(me)._replace(S=_set(st.S, key, value))
            yield f"resolves the cut-off vote: {value}", self._decide(nxt, m, me, str(value))

    def _train(self, st: AState, m: int, me: AMember) -> AState:
        if me.committed >= self.iterations:
            return self._member_set(st, m, me._replace(status=DONE))
        i = me.committed + 1
        samples = my_samples(m, parse(me.gen), self.n_members)
        return self._member_set(st, m, me._replace(pc="allreduce"),
                                pool=st.pool | {(me.cur, i, m, samples)})  # fmt: skip

    def _decide(self, st: AState, m: int, me: AMember, outcome: str) -> AState:
        i = me.committed + 1
        st = st._replace(decisions=st.decisions | {(me.cur, i, outcome)})
        if outcome == COMMIT:
            new = me._replace(committed=i, ledger=me.ledger + (me.grads,), grads=(), count=0)
            return self._train(st, m, new)
        return self._member_set(st, m, me._replace(pc="read_gen", grads=(), count=0))

    # ------------------------------------------------------------------ the coordinators
    def _coord(self, st: AState, c: int) -> Optional[Tuple[str, AState]]:
        co = st.coords[c]
        own = "P" if c == 0 else "S"
        if self._up(st, own) != RUN:
            return None
        store = getattr(st, own)

        def put(new: ACoord, where: Optional[str] = None, key: str = "", value: str = "",
                **changes) -> AState:  # fmt: skip
            nxt = st._replace(coords=st.coords[:c] + (new,) + st.coords[c + 1 :], **changes)
            if where is not None:
                nxt = nxt._replace(**{where: _set(getattr(st, where), key, value)})
            return nxt

        if co.pc == "resume":  # Coordinator.start(resume=True) on the standby
            number, text = _gen_of(store)
            return f"starts from generation {number}", put(co._replace(pc="scan", gen=text))
        if co.pc == "scan":  # _rescan + _decide: a member of the generation died?
            dead = tuple(s for s in range(self.n_members) if _get(store, f"dead/{s}"))
            if dead == co.dead:
                return None
            gen = parse(co.gen)
            if gen.abort:
                return None
            lost = set(dead) & set(gen.members)
            if not lost:
                return "reads the deaths: nothing lost", put(co._replace(dead=dead))
            new = next_generation(self.layout, gen, [s for s in gen.members if s not in dead])
            return f"decides generation {new.number} {sorted(new.members)}", put(
                co._replace(dead=dead, pc="pub1", pending=new.to_json())
            )
        gen = parse(co.pending)
        writer = f"coordinator on node {c}"
        published = st.published | {(gen.number, co.pending, writer, True)}
        standby = c == 0 and not co.standby_lost
        if co.pc in ("pub1", "pub3") and not standby:
            return "no standby", put(co._replace(pc="pub2" if co.pc == "pub1" else "pub4"))
        if co.pc in ("pub1", "pub3") and st.nodes[1] == CRASHED:
            return "the standby is unreachable: marked lost for good", put(
                co._replace(standby_lost=True, pc="pub2" if co.pc == "pub1" else "pub4")
            )
        if co.pc in ("pub1", "pub3") and st.nodes[1] == HUNG:
            return None
        if co.pc == "pub1":  # set_durable: the standby first
            return f"writes gen/{gen.number} on the standby", put(
                co._replace(pc="pub2"), "S", f"gen/{gen.number}", co.pending, published=published
            )
        if co.pc == "pub2":
            return f"writes gen/{gen.number} on its store", put(
                co._replace(pc="pub3"), own, f"gen/{gen.number}", co.pending, published=published
            )
        if co.pc == "pub3":
            return f"sets gen = {gen.number} on the standby", put(
                co._replace(pc="pub4"), "S", "gen", str(gen.number)
            )
        if co.pc == "pub4":
            return f"sets gen = {gen.number} on its store", put(
                co._replace(pc="scan", gen=co.pending), own, "gen", str(gen.number)
            )
        raise AssertionError(co.pc)

    # ------------------------------------------------------------------ the standby's copy
    def _copy(self, st: AState) -> Iterator[Tuple[str, AState]]:
        cp = st.copy

        def put(new: ACopy, key: Optional[str] = None, value: object = None, **changes):
            nxt = st._replace(copy=new, **changes)
            if key is not None:
                nxt = nxt._replace(S=_set(st.S, key, value))
            return nxt

        if cp.pc in ("c_read_gen", "c_read_rest"):
            if st.nodes[0] == CRASHED:
                yield "the primary's socket closed: takes over", put(cp._replace(pc="takeover"))
                return
            if st.nodes[0] == HUNG:
                yield "no answer from the primary within the heartbeat timeout: takes over", put(
                    cp._replace(pc="takeover")
                )
                return
        if cp.pc == "c_read_gen":
            yield f"reads gen = {_get(st.P, 'gen')} on the primary", put(
                cp._replace(pc="c_read_rest", gen=str(_get(st.P, "gen")))
            )
        elif cp.pc == "c_read_rest":
            keys = [f"dead/{s}" for s in range(self.n_members)]
            keys += [f"gen/{k}" for k in range(int(cp.gen) + 1)]
            rest = tuple((k, _get(st.P, k)) for k in keys if _get(st.P, k) is not None)
            yield "reads the deaths and generations on the primary", put(
                cp._replace(pc="c_write_gen", rest=rest)
            )
        elif cp.pc == "c_write_gen":
            yield f"writes gen = {cp.gen} on the standby", put(
                cp._replace(pc="c_write_rest"), "gen", cp.gen
            )
        elif cp.pc == "c_write_rest":
            store = st.S
            for k, v in cp.rest:
                store = _set(store, k, v)
            yield "writes the deaths and generations on the standby", st._replace(
                copy=ACopy(RUN, "c_read_gen"), S=store
            )
        elif cp.pc == "takeover":  # StandbyStore._take_over
            yield f"takeover: reads gen = {_get(st.S, 'gen')} on the standby", put(
                cp._replace(pc="t_dead", gen=str(_get(st.S, "gen")))
            )
        elif cp.pc == "t_dead":
            yield "takeover: declares node 0's rank dead", put(
                cp._replace(pc="t_primary"), "dead/0", "1"
            )
        elif cp.pc == "t_primary":
            coords = (st.coords[0], st.coords[1]._replace(status=RUN))
            yield f"takeover: sets {PRIMARY_KEY} (generation {cp.gen}); starts a coordinator", put(
                cp._replace(status=DONE), PRIMARY_KEY, cp.gen, coords=coords
            )


# ================================================================================== staged design
# Issue 54 item 9 (finding M2): a model of the code as it is, at the level the group vote and
# the pipeline stages matter. Real code here: ``JobLayout``, ``CompleteReplicas`` (through
# :func:`next_generation`), ``Generation`` JSON, the vote keys (``_votes_key`` ...,
# ``group_vote._keys``), ``group_vote.groups_of`` / ``two_level`` (who heads which group, and
# whether a generation votes in groups), ``state.heal.heal_target`` / ``heal_plan`` (the heal
# per data-parallel group, which raises the real ``ShardLost``).
INVARIANTS.update(
    {
        "same_iteration": "every member of the last generation finishes at the same iteration, "
        "the job's last (staged design)",
        "shard_lost": "the heal raises ShardLost only when every node of a pipeline stage is lost "
        "(staged design)",
        "wedged": "no live member waits for ever on a call to a hung store or server while a "
        "regroup is possible (staged design; a terminal state with such a member)",
    }
)

CRASHED_NODE, FROZEN, SUP_HUNG = "crashed", "frozen", "supervisor hung"
"""Node faults of the staged design: SIGKILL of the node's processes (its sockets close, a
connect is refused), SIGSTOP of the whole node (its ranks' heartbeats stop too), SIGSTOP of
the supervisor only (its ranks run and beat)."""
STAGED_FAULTS = ("node crash", "node hang", "supervisor hang")
GROUP_SIZE_MODEL = 2


class SNode(NamedTuple):
    """One node: its rank (1 rank per node, slot == node), its supervisor's vote (the
    node-vote server's cast: the member side of the group vote or the one-level vote) and, on
    a group head, the collector."""

    status: str = RUN
    rpc: str = "train"
    """The rank: arrive (waits for the rendezvous), train, await (its vote's future), leave
    (aborted or in doubt: waits for the next generation), done, out (not a member), fatal."""
    cur: int = 0
    committed: int = 0
    prep: Tuple[int, int] = (-1, -1)
    """(generation, iteration) of a prepared step (new design): applied or dropped when a
    later world forms, as its resolver (``prepared.resolve``) decides."""
    pcount: int = 0
    """The prepared step's ``counted`` (``VoteInDoubt.counted``): the member count of the
    vote's hot counter, as the node's cast reports it; 0: unknown (the rank's own deadline on
    its node's vote server)."""
    spc: str = ""
    """The supervisor's cast of the node's vote: gadd, gwait (group vote), hvote, hwait,
    habort, hclaim, hset (a vote on the hot store; hclaim, with claims: the count is decided
    commit, its claim on etcd next; hset, new design: the commit key's ``set`` and its
    ``check`` next, then apply)."""
    vg: int = -1
    vi: int = -1
    ht: int = -1
    """The term of the hot store the cast talks to (-1: none looked up yet)."""
    cpc: str = ""
    """The head's collector of (cg, ci): cwait, hvote, hwait, habort, hclaim, hset."""
    cg: int = -1
    ci: int = -1
    cht: int = -1


class SEtcd(NamedTuple):
    leader: int
    """The node holding the leader key (-1: none: its lease ended)."""
    term: int
    lpc: str
    """The leader's takeover, in the code's steps: fence (hot_store = ""), restore (serve a
    store restored from etcd, declare the old leader's rank dead, start the coordinator),
    store (publish hot_store), run."""
    hot_store: int
    """The term whose store ``hot_store`` names; -1: "" (a takeover under way)."""
    leader_node: int
    gens: Tuple[str, ...]
    """``gen/<n>``: every published generation's JSON (the current is the last)."""
    dead: FrozenSet[int]
    outcomes: Tuple[Tuple[Tuple[int, int], str], ...] = ()
    """With ``claims``: ``outcome/<g>/<i>`` claimed once (create-if-absent, ``commit.claim``):
    commit by the voter that completes a count before the commit key, the resolver's outcome
    when a world resolves an in-doubt step, abort by a reader whose bounded poll ran out."""


class SState(NamedTuple):
    nodes: Tuple[SNode, ...]
    gstores: Tuple[tuple, ...]
    """Each node's GroupStore (its keys)."""
    hots: Tuple[Tuple[int, tuple], ...]
    """Per term: (owner node, the keys of its hot TCPStore)."""
    etcd: SEtcd
    faults: int
    end: str
    """"" while the job runs; "done"; "fatal: ..." (ShardLost, NoTrainedState, ...)."""
    decisions: FrozenSet[Tuple[int, int, str]]
    ends: Tuple[int, ...] = ()
    """The committed iterations of the last generation's members when the job ended."""
    errors: FrozenSet[int] = frozenset()
    """Generations a member left with an error (``err/<g>/<slot>``: an aborted or in-doubt
    step; ``report_error`` follows the leader, so it lands)."""
    reported: FrozenSet[int] = frozenset()
    """New design: nodes whose store or vote server a vote wait gave up on (its deadline):
    the coordinator declares them dead, so the regroup leaves them out."""


class _ModelStore:
    """The few ``TCPStore`` calls :func:`.prepared.resolve` makes (with :func:`.commit.abort`
    and ``_commit``), on a copy of one hot store's keys in the model: the real resolution runs
    on the model's state. ``items()`` gives the keys back in the model's form."""

    def __init__(self, items: tuple, outcomes: Optional[dict] = None) -> None:
        self.store = self  # MembershipStore's ``.store``
        self._d: Dict[str, object] = dict(items)
        self.outcomes = outcomes
        """With claims (``EtcdStore.claims_outcomes``): the model's etcd ``outcome/`` keys,
        by (generation, iteration), created by :meth:`claim`."""
        self.claims_outcomes = outcomes is not None

    def items(self) -> tuple:
        return tuple(sorted(self._d.items()))

    def check(self, keys: List[str]) -> bool:
        return all(k in self._d for k in keys)

    def get(self, key: str) -> bytes:
        return str(self._d[key]).encode()

    def set(self, key: str, value: str) -> None:
        self._d[key] = value

    def add(self, key: str, amount: int) -> int:
        self._d[key] = int(self._d.get(key, 0)) + amount
        return int(self._d[key])

    def claim(self, key: str, outcome: str, forget: Optional[str] = None) -> str:
        """``EtcdStore.claim``: create the claim if absent (the first stands), and with it
        delete the claim ``forget``."""
        assert self.outcomes is not None
        g, i = (int(v) for v in key.split("/")[1:])
        if (g, i) not in self.outcomes:
            self.outcomes[(g, i)] = outcome
            if forget is not None:
                self.outcomes.pop(tuple(int(v) for v in forget.split("/")[1:]), None)
        return self.outcomes[(g, i)]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        current = self._d.get(key)
        if (current is None and expected == "") or current == expected:
            self._d[key] = desired
            return desired.encode()
        return (expected if current is None else str(current)).encode()


@lru_cache(maxsize=None)
def _groups(members: Tuple[int, ...], size: int) -> Dict[int, List[int]]:
    """The real ``group_vote.groups_of`` (cached: the explorer asks for the same few often)."""
    return groups_of(members, size)


@dataclass
class StagedDesign(Design):
    """Nodes of one rank each, TP = 1, PP x DP, the two-level (group) and one-level (node) vote
    on a leader's hot TCPStore, the etcd leader and its takeover in the code's steps, members
    without leases, the regroup on a member's error, and node faults (crash, hang, supervisor
    hang; a hang may end, ``resumes``).

    ``prepared`` / ``deadlines`` switch the issue 54 design (items 1 and 2) on; both off is a
    model of today's code: in-doubt members apply nothing and the heal brings them up from a
    peer of their stage; the group vote's waits on a head's store and a rank's wait on its
    node's vote server have no deadline, and only the hot store's sockets are shut when its
    owner is lost. With ``prepared``, the code's rule (``recovery/prepared.py``): the count's
    completer makes the commit key durable on the hot store (its ``set`` and the ``check`` that
    finds it, a step of its own) before it applies; an in-doubt member keeps its step prepared
    (with its cast's ``counted``), and when a later world forms, one step (the collective
    all-gather, the resolver's store requests and its broadcast) resolves it with the real
    ``prepared.resolve`` on the hot store ``hot_store`` names: commit when a member of the new
    world applied it, else the resolver's abort on the old counter (commit only when the count
    was complete before it: the hot store survived), else abort; the first outcome recorded
    there (``resolved/<g>/<i>``) stands; each holder applies or drops its step (the real
    ``prepared.settle``). With ``claims`` (the code: ``commit.claim``), outcomes are claimed
    on etcd (``outcome/<g>/<i>``, create-if-absent, fenced on the client's term): the count's
    completer claims commit (a request of its own) before the commit key's set; a reader whose
    bounded poll runs out claims abort; the resolver claims its outcome; what stands is the
    outcome. Without, no outcome is claimed on etcd (the design before). With ``deadlines``, a vote
    wait on a silent head or vote server ends in doubt (the rank leaves and reports its error),
    a supervisor with a stale heartbeat is declared dead, and a dead owner's GroupStore and
    vote server shut their sockets."""

    pp: int = 2
    dp: int = 2
    iterations: int = 1
    faults: int = 1
    kinds: Tuple[str, ...] = STAGED_FAULTS
    prepared: bool = False
    deadlines: bool = False
    claims: bool = False
    """Outcomes claimed on etcd (``commit.claim``; the code in ``--store-mode etcd``)."""
    group_size: int = GROUP_SIZE_MODEL
    resumes: bool = True
    """A hung node or supervisor may resume later (a fault step: never relied on)."""
    grace_holds: bool = False
    """A member writes ``doubt`` for its superseded group only once its head is not deciding
    (dead, hung, or its collector of the vote ended): ``doubt_grace_s`` outlasts a live head's
    decision. Off: the grace is abstract and the race is explored."""
    report_owner: bool = False
    """New design, an option: a missed deadline also reports the silent owner, which the
    coordinator then declares dead (off: only a stale supervisor heartbeat does)."""
    max_generations: int = 4
    """A bound on the regroups of a member's error (the state space stays finite)."""
    slow_owners: bool = False
    """New design: a vote wait's deadline may also pass while the store or server it waits on
    is alive but slow (the member is in doubt and reports it, as for a hung one); each such
    deadline counts as one of the ``faults``."""
    name: str = "staged"

    def __post_init__(self) -> None:
        self.layout = JobLayout(tp=1, pp=self.pp, dp=self.dp)
        self.n = self.layout.world_size
        which = "new design" if self.prepared and self.deadlines else (
            "old code" if not (self.prepared or self.deadlines) else
            f"prepared={self.prepared}, deadlines={self.deadlines}"
        )  # fmt: skip
        if self.prepared and self.deadlines and not self.claims:
            which = "new design without the claims"
        self.name = f"staged ({which}; PP{self.pp} x DP{self.dp}, groups of {self.group_size})"

    # ------------------------------------------------------------------ interface
    def initial(self) -> SState:
        gen0 = first_generation(self.layout).to_json()
        etcd = SEtcd(0, 0, "run", 0, 0, (gen0,), frozenset())
        return SState(
            nodes=tuple(SNode() for _ in range(self.n)),
            gstores=tuple(() for _ in range(self.n)),
            hots=((0, (("gen", 0),)),),
            etcd=etcd,
            faults=0,
            end="",
            decisions=frozenset(),
        )

    def finished(self, st: SState) -> bool:
        return st.end != ""

    def describe(self, st: SState) -> str:
        nodes = "; ".join(
            f"n{k}:{x.status}/{x.rpc} g{x.cur} it{x.committed}"
            + (f" prep{x.prep}" if x.prep[0] >= 0 else "")
            + (f" cast:{x.spc}{x.vg, x.vi}" if x.spc else "")
            + (f" coll:{x.cpc}{x.cg, x.ci}" if x.cpc else "")
            for k, x in enumerate(st.nodes)
        )
        e = st.etcd
        return (f"{nodes} | leader {e.leader} term {e.term} ({e.lpc}), hot_store {e.hot_store}, "
                f"gen {len(e.gens) - 1}, dead {sorted(e.dead)}, end {st.end!r}")  # fmt: skip

    def violations(self, prev: SState, st: SState) -> List[str]:
        out = decision_violations(st.decisions)
        if st.end.startswith("fatal: ShardLost") and not self._stage_lost(st):
            out.append("shard_lost")
        if st.end == "done" and any(c != self.iterations for c in st.ends):
            out.append("same_iteration")
        return out

    def stuck(self, st: SState) -> str:
        """The violation a state without progress steps is: ``wedged`` when a live member
        waits on a hung store or server (no deadline frees it), else ``progress``."""
        for k, x in enumerate(st.nodes):
            if k in st.etcd.dead or x.status in (CRASHED_NODE, FROZEN):
                continue
            if x.rpc == "await" and x.status == SUP_HUNG:
                return "wedged"
            if x.status == RUN and x.spc in ("gadd", "gwait"):
                head = self._head(st, x.vg, k)
                if self._gstore(st, head) == "silent":
                    return "wedged"
        return "progress"

    # ------------------------------------------------------------------ helpers
    def _gen(self, st: SState, number: int) -> Generation:
        return parse(st.etcd.gens[number])

    def _stage_lost(self, st: SState) -> bool:
        gone = {k for k, x in enumerate(st.nodes) if x.status in (CRASHED_NODE, FROZEN)}
        gone |= set(st.etcd.dead)
        stages: Dict[int, List[int]] = {}
        for s in range(self.n):
            stages.setdefault(self.layout.coords(s)[2], []).append(s)
        return any(set(v) <= gone for v in stages.values())

    def _head(self, st: SState, g: int, node: int) -> int:
        nodes = sorted(self._gen(st, g).members)
        return _groups(tuple(nodes), self.group_size)[node // self.group_size][0]

    @staticmethod
    def _deciding(st: SState, head: int, g: int, i: int) -> bool:
        x = st.nodes[head]
        return x.status == RUN and x.cpc != "" and (x.cg, x.ci) == (g, i)

    def _gstore(self, st: SState, owner: int) -> str:
        """up / closed (refused, reset: the call raises) / silent (no answer, for ever)."""
        status = st.nodes[owner].status
        if status == CRASHED_NODE:
            return "closed"
        if self.deadlines and owner in st.etcd.dead:
            return "closed"  # new design: its sockets are shut once its owner is declared dead
        return "up" if status == RUN else "silent"

    def _hot(self, st: SState, t: int) -> Tuple[str, int]:
        """A hot-store call's fate: ("up", t), ("moved", t') (``StoreFailedOver``: the client
        followed ``hot_store`` to t'), or ("wait", t): lost or silent, no new address yet (the
        client's bound, the lease TTL, and its watch of ``hot_store`` free it then)."""
        pub = st.etcd.hot_store
        usable = pub >= 0 and st.nodes[st.hots[pub][0]].status == RUN
        if t < 0:
            return ("up", pub) if usable else ("wait", t)
        if pub == t:
            return ("up", t) if usable else ("wait", t)
        return ("moved", pub) if usable else ("wait", t)

    def _visible(self, st: SState) -> Optional[int]:
        """The generation number a client reads through ``hot_store`` (None: none answers)."""
        pub = st.etcd.hot_store
        if pub < 0 or st.nodes[st.hots[pub][0]].status != RUN:
            return None
        return int(_get(st.hots[pub][1], "gen"))

    def _superseded(self, st: SState, g: int) -> bool:
        v = self._visible(st)
        return v is not None and v > g

    @staticmethod
    def _node(st: SState, k: int, **changes) -> SState:
        nodes = list(st.nodes)
        nodes[k] = nodes[k]._replace(**changes)
        return st._replace(nodes=tuple(nodes))

    @staticmethod
    def _hot_set(st: SState, t: int, key: str, value: object) -> SState:
        hots = list(st.hots)
        owner, items = hots[t]
        hots[t] = (owner, _set(items, key, value))
        return st._replace(hots=tuple(hots))

    @staticmethod
    def _g_set(st: SState, k: int, key: str, value: object) -> SState:
        gs = list(st.gstores)
        gs[k] = _set(gs[k], key, value)
        return st._replace(gstores=tuple(gs))

    # ------------------------------------------------------------------ steps
    def successors(self, st: SState) -> Iterator[Tuple[str, SState, bool]]:
        if st.end:
            return
        yield from self._faults(st)
        for label, nxt in self._steps(st):
            yield label, nxt, False

    def _faults(self, st: SState) -> Iterator[Tuple[str, SState, bool]]:
        for k, x in enumerate(st.nodes):  # a hang may end (SIGCONT, a healed partition)
            if self.resumes and x.status in (FROZEN, SUP_HUNG):
                led = any(owner == k for owner, _ in st.hots)
                if led and st.etcd.leader != k:  # store_host._control_lost: its lease is gone
                    yield f"node {k}: resumes; its lease is gone: exits", self._node(
                        st, k, status=CRASHED_NODE, spc="", cpc=""
                    ), True
                else:
                    yield f"node {k}: resumes", self._node(st, k, status=RUN), True
        if st.faults >= self.faults:
            return
        for k, x in enumerate(st.nodes):
            if x.status != RUN or (x.rpc == "out" and k != st.etcd.leader):
                continue
            after = st._replace(faults=st.faults + 1)
            if "node crash" in self.kinds:
                yield f"node {k}: crashes", self._node(
                    after, k, status=CRASHED_NODE, spc="", cpc=""
                ), True
            if "node hang" in self.kinds:
                yield f"node {k}: hangs (SIGSTOP)", self._node(after, k, status=FROZEN), True
            if "supervisor hang" in self.kinds:
                yield f"node {k}: its supervisor hangs", self._node(after, k, status=SUP_HUNG), True

    def _steps(self, st: SState) -> Iterator[Tuple[str, SState]]:
        yield from self._control(st)
        yield from self._world(st)
        for k, x in enumerate(st.nodes):
            if x.status in (RUN, SUP_HUNG):
                yield from self._rank(st, k, x)
            if x.status == RUN:
                yield from self._cast(st, k, x)
                yield from self._collector(st, k, x)

    # ------------------------------------------------------------------ leader, coordinator
    def _control(self, st: SState) -> Iterator[Tuple[str, SState]]:
        e = st.etcd
        if e.leader >= 0 and st.nodes[e.leader].status != RUN:
            ended = st._replace(etcd=e._replace(leader=-1))
            if st.nodes[e.leader].status == CRASHED_NODE:
                # store_host._watch_leader: the dead process's store refuses a connect
                for f, y in enumerate(st.nodes):
                    if y.status == RUN:
                        yield (f"node {f}: node {e.leader}'s store refuses connections: revokes "
                               "its lease (ECONNREFUSED)"), ended  # fmt: skip
                        break
            yield f"the lease of node {e.leader} expires", ended
        if e.leader < 0:
            for f, y in enumerate(st.nodes):
                if y.status == RUN and f not in e.dead:
                    yield f"node {f}: wins the election (term {e.term + 1})", st._replace(
                        etcd=e._replace(leader=f, term=e.term + 1, lpc="fence"),
                        hots=st.hots + ((f, ()),),
                    )
            return
        lead = e.leader
        if st.nodes[lead].status != RUN:
            return
        if e.lpc == "fence":  # _take_over_etcd: put_fenced(hot_store, ""), leader_node
            yield f"leader {lead}: fences hot_store (\"\")", st._replace(
                etcd=e._replace(lpc="restore", hot_store=-1)
            )
            return
        if e.lpc == "restore":  # serve, restore(), declare the old leader's rank dead
            number = len(e.gens) - 1
            hot = (("gen", number), (PRIMARY_KEY, number))
            hots = st.hots[:-1] + ((lead, hot),)
            old = e.leader_node
            yield (f"leader {lead}: serves a store restored from etcd (generation {number}); "
                   f"declares node {old}'s rank dead"), st._replace(  # fmt: skip
                hots=hots,
                etcd=e._replace(lpc="store", leader_node=lead, dead=e.dead | {old}),
            )
            return
        if e.lpc == "store":
            yield f"leader {lead}: publishes hot_store (term {e.term})", st._replace(
                etcd=e._replace(lpc="run", hot_store=e.term)
            )
        # The coordinator (started before hot_store is published).
        for k, x in enumerate(st.nodes):
            if k in e.dead:
                continue
            why = {CRASHED_NODE: "its connections closed", FROZEN: "its heartbeats stopped"}
            if self.deadlines:
                why[SUP_HUNG] = "its supervisor's heartbeat is stale"
            if k in st.reported:
                why = {x.status: "reported: a vote deadline missed"}
            if x.status in why:
                yield f"coordinator {lead}: declares node {k} dead ({why[x.status]})", (
                    st._replace(etcd=e._replace(dead=e.dead | {k}))
                )
        gen = parse(e.gens[-1])
        # Coordinator._decide: a member's death; else a member's collective error (``err/``)
        # once no death has been found for a heartbeat timeout (here: no death is pending).
        pending = {CRASHED_NODE, FROZEN} | ({SUP_HUNG} if self.deadlines else set())
        quiet = not any(x.status in pending and k not in e.dead for k, x in enumerate(st.nodes))
        error = gen.number in st.errors and quiet and len(e.gens) < self.max_generations
        if set(gen.members) & e.dead or error:
            alive = [s for s in range(self.n) if s not in e.dead]
            nxt = next_generation(self.layout, gen, alive)
            etcd = e._replace(gens=e.gens + (nxt.to_json(),))
            after = st._replace(etcd=etcd)
            after = self._hot_set(after, e.term, "gen", nxt.number)
            if nxt.abort:
                after = after._replace(end=f"fatal: {nxt.abort}")
            why = "" if set(gen.members) & e.dead else " (a member's collective error)"
            yield (f"coordinator {lead}: publishes generation {nxt.number} "
                   f"{sorted(nxt.members)}{why}"), after  # fmt: skip

    # ------------------------------------------------------------------ the world (collectives)
    def _world(self, st: SState) -> Iterator[Tuple[str, SState]]:
        gen = parse(st.etcd.gens[-1])
        members = sorted(gen.members)
        xs = [st.nodes[m] for m in members]
        if all(x.rpc == "done" and x.cur == gen.number for x in xs):
            yield "the job ends: every member finished", st._replace(
                end="done", ends=tuple(x.committed for x in xs)
            )
            return
        alive = all(x.status in (RUN, SUP_HUNG) for x in xs)
        if alive and all(x.rpc == "arrive" and x.cur == gen.number for x in xs):
            yield from self._heal(st, gen, members)
        if alive and all(x.rpc == "train" and x.cur == gen.number for x in xs):
            i = xs[0].committed + 1
            if any(x.status == RUN and x.spc for x in xs):
                return  # a node's previous cast still runs: this vote queues behind it
            assert all(x.committed == i - 1 for x in xs) and i <= self.iterations
            one = not two_level(members, self.group_size)
            after = st
            for m in members:
                after = self._node(after, m, rpc="await", spc="hvote" if one else "gadd",
                                   vg=gen.number, vi=i, ht=st.etcd.hot_store)  # fmt: skip
            yield f"world {gen.number}: all-reduce of iteration {i} done; every rank votes", after

    def _heal(
        self, st: SState, gen: Generation, members: List[int]
    ) -> Iterator[Tuple[str, SState]]:
        """``RecoverySession.on_built``: the real heal_target and heal_plan per data-parallel
        group (``ShardLost`` when a group has no member at the target)."""
        order = sorted(members, key=lambda s: self.layout.rank_in(s, gen.replicas))
        settled = self._settle(st, order)
        if settled is None:
            return  # the resolver's calls wait for a hot store that answers
        st, what = settled
        infos = [(s, True, st.nodes[s].committed) for s in order]
        groups: Dict[int, List[int]] = {}
        for r, s in enumerate(order):
            groups.setdefault(self.layout.coords(s)[2], []).append(r)
        try:
            target = heal_target(infos)
            for g in groups.values():
                heal_plan(infos, g, target)
        except (ShardLost, NoTrainedState) as err:
            after = st
            for m in members:
                after = self._node(after, m, rpc="fatal")
            yield f"world {gen.number} formed: {what}{type(err).__name__}", after._replace(
                end=f"fatal: {type(err).__name__}: {err}"
            )
            return
        after = st
        for m in members:
            after = self._node(after, m, committed=target,
                               rpc="done" if target == self.iterations else "train")  # fmt: skip
        yield f"world {gen.number} formed: {what}healed to iteration {target}", after

    def _settle(self, st: SState, order: List[int]) -> Optional[Tuple[SState, str]]:
        """New design: ``RecoverySession._settle_prepared`` before the heal, as one step (the
        all-gather of the members' committed iterations and kept steps is collective, and the
        resolver's store requests and its broadcast follow it before anyone heals): each
        in-doubt iteration resolved by the real :func:`.prepared.resolve` on the hot store that
        ``hot_store`` names (the first outcome recorded there stands; its abort on the old
        counter fences a vote still in flight), then each holder applies or drops its kept step
        (the real :func:`.prepared.settle`). None: that store does not answer (the call waits)."""
        entries: List[Optional[Tuple[int, int, Optional[int]]]] = []
        after = st
        for s in order:
            x = st.nodes[s]
            if x.prep[0] >= 0 and x.prep[1] == x.committed + 1:
                entries.append((x.prep[0], x.prep[1], x.pcount or None))
            else:  # _prepared_entry: a step not for the next iteration is dropped
                entries.append(None)
                if x.prep[0] >= 0:
                    after = self._node(after, s, prep=(-1, -1), pcount=0)
        if all(e is None for e in entries):
            return after, ""
        pub = st.etcd.hot_store
        if pub < 0 or st.nodes[st.hots[pub][0]].status != RUN:
            return None
        store = _ModelStore(st.hots[pub][1], dict(st.etcd.outcomes) if self.claims else None)
        infos = [(s, True, st.nodes[s].committed) for s in order]
        outcomes: Dict[Tuple[int, int], bool] = {}
        told = []
        for key in sorted({e[:2] for e in entries if e is not None}):
            holders = [r for r, e in enumerate(entries) if e is not None and e[:2] == key]
            counted = next((entries[r][2] for r in holders if entries[r][2]), None)
            applied = applied_by_someone(infos, key[1])
            recorded = store.check([RESOLVED_KEY.format(generation=key[0], iteration=key[1])])
            claimed = None if store.outcomes is None else store.outcomes.get(key)
            outcomes[key] = resolve(store, *key, counted, applied, decision_wait_s=0.0)
            why = "no count known"
            if recorded:
                why = "recorded"
            elif claimed is not None:
                why = f"{claimed} claimed on etcd"
            elif applied:
                why = "a member applied it"
            elif counted:
                why = f"its abort on the counter of {counted}"
            told.append(f"{key} resolved {COMMIT if outcomes[key] else ABORT} ({why})")
        hots = list(after.hots)
        hots[pub] = (hots[pub][0], store.items())
        after = after._replace(hots=tuple(hots))
        if store.outcomes is not None:
            claims = tuple(sorted(store.outcomes.items()))
            after = after._replace(etcd=after.etcd._replace(outcomes=claims))
        prepared = [None if e is None else e[:2] for e in entries]
        decisions = set(after.decisions)
        for (s, _, it), key in zip(settle(infos, prepared, outcomes), prepared, strict=True):
            if key is not None:
                after = self._node(after, s, committed=it, prep=(-1, -1), pcount=0)
                decisions.add((*key, COMMIT if outcomes[key] else ABORT))
        return after._replace(decisions=frozenset(decisions)), "; ".join(told) + "; "

    # ------------------------------------------------------------------ a rank
    def _rank(self, st: SState, k: int, x: SNode) -> Iterator[Tuple[str, SState]]:
        v = self._visible(st)
        if x.rpc in ("train", "arrive", "leave", "done", "out") and v is not None and v > x.cur:
            gen = self._gen(st, v)
            if k not in gen.members:
                yield f"rank {k}: generation {v}: not a member", self._node(st, k, rpc="out", cur=v)
                return
            # A prepared step is kept through the arrival: the world resolves it when it forms.
            yield f"rank {k}: generation {v}: arrives", self._node(st, k, rpc="arrive", cur=v)
        slow = self.slow_owners and x.status == RUN and x.spc != "" and st.faults < self.faults
        if x.rpc == "await" and (x.status == SUP_HUNG or slow) and self.deadlines:
            after = st._replace(reported=st.reported | ({k} if self.report_owner else set()))
            if x.status == RUN:  # a slow supervisor: the budget's fault
                after = after._replace(faults=st.faults + 1)
            yield f"rank {k}: node-vote deadline: in doubt", (
                self._result(after, k, x, "doubt", cast_ends=False)
            )

    def _result(self, st: SState, k: int, x: SNode, outcome: str, cast_ends: bool = True) -> SState:
        """The node's cast ends with ``outcome``: its rank applies the step, leaves the world
        (abort: redone in the next generation) or is in doubt (old: applies nothing; new:
        keeps the prepared step)."""
        after = self._node(st, k, spc="", ht=-1) if x.status == RUN and cast_ends else st
        y = after.nodes[k]
        if y.rpc != "await" or (y.cur, y.committed + 1) != (x.vg, x.vi):
            return after
        if outcome == COMMIT:
            done = x.vi == self.iterations
            after = self._node(after, k, committed=x.vi, rpc="done" if done else "train")
        elif outcome == ABORT:
            after = self._node(after, k, rpc="leave")
        elif self.prepared:  # VoteInDoubt: the step is kept, with the cast's ``counted``
            counted = 0
            if cast_ends:  # the node's cast reports "lost" with the hot counter's member count
                members = sorted(self._gen(st, x.vg).members)
                one = not two_level(members, self.group_size)
                counted = len(members) if one else len(_groups(tuple(members), self.group_size))
            after = self._node(after, k, rpc="leave", prep=(x.vg, x.vi), pcount=counted)
        else:
            after = self._node(after, k, rpc="leave")
        if outcome != COMMIT:  # StepAborted: the rank leaves and reports err/<g>/<slot>
            after = after._replace(errors=after.errors | {x.vg})
        if outcome in (COMMIT, ABORT):
            after = after._replace(decisions=after.decisions | {(x.vg, x.vi, outcome)})
        return after

    # ------------------------------------------------------------------ a node's cast
    def _cast(self, st: SState, k: int, x: SNode) -> Iterator[Tuple[str, SState]]:
        if not x.spc:
            return
        g, i = x.vg, x.vi
        if x.spc in ("hvote", "hwait", "habort", "hclaim", "hset"):  # one level, on the hot store
            nv = len(self._gen(st, g).members)
            for what, after, pc, ht, outcome in self._hot_vote(st, x.spc, x.ht, g, i, nv):
                if outcome is None:
                    yield f"node {k}: {what}", self._node(after, k, spc=pc, ht=ht)
                else:
                    yield f"node {k}: {what}", self._result(after, k, x, outcome)
            return
        members = sorted(self._gen(st, g).members)
        mine = _groups(tuple(members), self.group_size)[k // self.group_size]
        head, size = mine[0], len(mine)
        votes, wake, out = _group_keys(g, i)
        state = self._gstore(st, head)
        if state == "closed":
            yield f"node {k}: head {head}'s store is lost: in doubt", self._result(
                st, k, x, "doubt"
            )
            return
        if state == "silent":
            if self.deadlines:
                after = st._replace(reported=st.reported | ({head} if self.report_owner else set()))
                yield f"node {k}: deadline on head {head}'s store: in doubt", (
                    self._result(after, k, x, "doubt")
                )
            return  # the old code: a call to a SIGSTOPped TCPStore never returns
        if self.deadlines and self.slow_owners and head != k and st.faults < self.faults:
            who = {head} if self.report_owner else set()
            after = st._replace(reported=st.reported | who, faults=st.faults + 1)
            yield f"node {k}: deadline on head {head}'s store (slow, not hung): in doubt", (
                self._result(after, k, x, "doubt")
            )
        if x.spc == "gadd":
            if head == k and x.cpc:
                return  # this head's previous collector still runs (a model restriction)
            after = st
            if head == k:
                after = self._node(after, k, cpc="cwait", cg=g, ci=i, cht=-1)
            count = int(_get(after.gstores[head], votes) or 0) + 1
            after = self._g_set(after, head, votes, count)
            if count == size:
                after = self._g_set(after, head, wake, "")
            yield f"node {k}: adds its vote on head {head}'s store ({count} of {size})", (
                self._node(after, k, spc="gwait")
            )
        else:  # gwait (GroupVote._await)
            standing = _get(st.gstores[head], out)
            if standing is not None:
                yield f"node {k}: its group's outcome: {standing}", self._result(
                    st, k, x, str(standing)
                )
            elif self._superseded(st, g) and not (
                self.grace_holds and self._deciding(st, head, g, i)
            ):
                after = self._g_set(st, head, out, "doubt")
                yield f"node {k}: superseded: writes doubt for its group", self._result(
                    after, k, x, "doubt"
                )

    # ------------------------------------------------------------------ a head's collector
    def _collector(self, st: SState, k: int, x: SNode) -> Iterator[Tuple[str, SState]]:
        if not x.cpc:
            return
        g, i = x.cg, x.ci
        if self._gstore(st, k) == "closed":  # new design: its owner was declared dead
            yield f"head {k}: collector: its store's sockets are shut", self._node(st, k, cpc="")
            return
        members = sorted(self._gen(st, g).members)
        groups = _groups(tuple(members), self.group_size)
        size, ngroups = len(groups[k // self.group_size]), len(groups)
        votes, wake, out = _group_keys(g, i)
        if x.cpc == "cwait":
            count = int(_get(st.gstores[k], votes) or 0)
            if count == size:
                yield f"head {k}: collector: its group's {size} votes are in", self._node(
                    st, k, cpc="hvote", cht=-1
                )
            elif self._superseded(st, g):
                yield f"head {k}: collector: superseded", self._node(st, k, cpc="habort", cht=-1)
            return
        for what, after, pc, ht, outcome in self._hot_vote(st, x.cpc, x.cht, g, i, ngroups):
            if outcome is None:
                yield f"head {k}: collector: {what}", self._node(after, k, cpc=pc, cht=ht)
                continue
            standing = _get(after.gstores[k], out)
            if standing is None:
                after = self._g_set(after, k, out, outcome)
            yield f"head {k}: collector: {what}; group outcome {standing or outcome}", (
                self._node(after, k, cpc="")
            )

    # ------------------------------------------------------------------ commit.vote, hot store
    def _hot_vote(
        self, st: SState, pc: str, t: int, g: int, i: int, nv: int
    ) -> Iterator[Tuple[str, SState, str, int, Optional[str]]]:
        """One request of ``commit.vote`` / ``abort`` / ``vote_after_failover`` for ``nv``
        voters: (label, state, next pc, store term, outcome or None)."""
        if pc == "hclaim":  # commit.claim: create-if-absent on etcd, fenced on the store's term
            e = st.etcd
            if e.leader >= 0 and e.term == t:
                claims = dict(e.outcomes)
                if (g, i) not in claims:  # created, and the claim before it deleted with it
                    claims[(g, i)] = COMMIT
                    claims.pop((g, i - 1), None)
                standing = claims[(g, i)]
                after = st._replace(etcd=e._replace(outcomes=tuple(sorted(claims.items()))))
                if standing == COMMIT:
                    yield "claims commit on etcd", after, "hset", t, None
                else:
                    yield "claims commit on etcd: an abort stands", after, "", t, ABORT
                return
            if self._hot(st, t)[0] != "moved":
                return  # fenced: the client waits for another term's hot_store (_follow)
            # StoreFailedOver from the fenced claim: as for a hot-store call, below
        fate, t2 = self._hot(st, t)
        if fate == "wait":
            return  # blocked until a new leader publishes hot_store
        if fate == "moved":
            primary = _get(st.hots[t2][1], PRIMARY_KEY)
            taken = -1 if primary is None else int(primary)
            if g <= taken:
                yield "StoreFailedOver: the vote is in doubt", st, "", t2, "doubt"
            else:
                yield "StoreFailedOver: casts again on the new store", st, "hvote", t2, None
            return
        if pc == "hset":  # commit._commit: the set, and the check that finds it; then apply
            after = self._hot_set(st, t2, _commit_key(g, i), "")
            yield "sets the commit key; its check finds it", after, "", t2, COMMIT
            return
        items = st.hots[t2][1]
        vkey, ckey, dkey = _votes_key(g, i), _commit_key(g, i), _decision_key(g, i)
        count = int(_get(items, vkey) or 0)

        def commit(after: SState, what: str) -> Tuple[str, SState, str, int, Optional[str]]:
            if self.claims:  # commit._commit: the claim on etcd first, a request of its own
                return what, after, "hclaim", t2, None
            if self.prepared:  # the commit key's set + check is a request of its own, next
                return what, after, "hset", t2, None
            after = self._hot_set(after, t2, ckey, "")
            return f"{what}; sets the commit key", after, "", t2, COMMIT

        def from_count(total: int, what: str, base: SState):
            """``_outcome``: every vote in or an abort in the counter."""
            if total < ABORT_WEIGHT:
                return commit(base, what)
            if total % ABORT_WEIGHT < nv:
                return f"{what}: aborted", base, "", t2, ABORT
            if _get(items, ckey) is not None:
                return f"{what}: commit key", base, "", t2, COMMIT
            if _get(items, dkey) is not None:
                return f"{what}: decision", base, "", t2, str(_get(items, dkey))
            e = base.etcd
            if self.claims and e.leader >= 0 and e.term == t2:
                # The bounded poll runs out (a step enabled at any time: an over-approximation
                # of decision_wait_s): it claims abort on etcd, and what stands is the outcome.
                claims = dict(e.outcomes)
                standing = claims.setdefault((g, i), ABORT)
                base = base._replace(etcd=e._replace(outcomes=tuple(sorted(claims.items()))))
                label = f"{what}: its poll runs out: claims abort ({standing} stands)"
                return label, base, "", t2, standing
            return None  # the bounded poll: waits for a writer (old code: not modelled)

        if pc == "hvote":
            count += 1
            after = self._hot_set(st, t2, vkey, count)
            if count == nv:
                yield commit(after, f"votes on the hot store ({count} of {nv})")
            elif count > ABORT_WEIGHT:
                r = from_count(count, "votes after an abort", after)
                if r is not None:
                    yield r
            else:
                yield f"votes on the hot store ({count} of {nv})", after, "hwait", t2, None
            return
        if pc == "hwait" and _get(items, ckey) is not None:
            yield "finds the commit key", st, "", t2, COMMIT
            return
        if pc == "hwait" and (count == nv or count >= ABORT_WEIGHT):
            r = from_count(count, f"reads the counter ({count % ABORT_WEIGHT} of {nv})", st)
            if r is not None:
                yield r
            return
        if pc == "habort" or self._superseded(st, g):
            total = count
            after = self._hot_set(st, t2, vkey, count + ABORT_WEIGHT)
            if total < ABORT_WEIGHT:  # the first abort decides
                decision = COMMIT if total == nv else ABORT
                if not (self.claims and decision == COMMIT):  # claims: told once it stands
                    after = self._hot_set(after, t2, dkey, decision)
                if decision == COMMIT:
                    yield commit(after, "aborts after every vote: decides commit")
                else:
                    yield f"aborts ({total} of {nv} votes): decides abort", after, "", t2, ABORT
            else:
                r = from_count(total, "aborts after an abort", after)
                if r is not None:
                    yield r
