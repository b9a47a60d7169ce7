"""Prepared, not in doubt (:mod:`megatron_mecefo.recovery.prepared`; issue 54, finding C1).

A split vote under pipeline parallelism: 4 nodes of one rank, PP2 x DP2 (stage = node // 2,
so each stage is one vote group of 2), real :class:`GroupVote` objects over real TCPStores.
Group 1's head dies after its group's vote was counted on the hot store: group 0 commits,
group 1 is in doubt. Before, the heal then found no member of stage 1 at the committed
iteration (``ShardLost``); now the in-doubt members keep their step prepared and apply it
once the next generation resolves the outcome, so every member ends at the same iteration
with the same tensors as a run without the failure. Also: the node that completes a count
does not apply the step before its commit key is on the store (``commit._commit``)."""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import Future
from typing import Any, Callable, Dict, List

import pytest
import torch
from daemon_threads import in_daemon_thread
from group_faults import die_after_hot_vote

from megatron_mecefo.recovery.commit import AsyncVoter, CommitInDoubt, VoteInDoubt, vote
from megatron_mecefo.recovery.group_vote import GroupStore, GroupVote
from megatron_mecefo.recovery.membership import Generation, MembershipStore
from megatron_mecefo.recovery.node_vote import NodeVoteClient, NodeVoteLost, NodeVoteServer
from megatron_mecefo.recovery.prepared import (
    PreparedStep,
    applied_by_someone,
    resolve,
    settle,
)
from megatron_mecefo.recovery.state.heal import ShardLost, heal_plan, heal_target

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

G = 2  # nodes per vote group
STAGE_GROUPS = ([0, 1], [2, 3])  # PP2 x DP2, one rank per node: the data-parallel groups


def _submit(fn: Callable[..., Any], *args: Any) -> Future:
    return in_daemon_thread(fn, *args)


class Member:
    """One rank: its stage's parameter and a real optimizer with state (AdamW)."""

    def __init__(self, stage: int) -> None:
        torch.manual_seed(stage)
        self.stage = stage
        self.param = torch.nn.Parameter(torch.randn(64))
        self.opt = torch.optim.AdamW([self.param], lr=0.1)
        self.iteration = 0
        self.prepared = None

    @property
    def params(self) -> List[torch.nn.Parameter]:
        return [p for group in self.opt.param_groups for p in group["params"]]

    def reduce(self, iteration: int) -> None:
        """The data-parallel reduced gradient of ``iteration`` (the same on every replica)."""
        g = torch.Generator().manual_seed(1000 * iteration + self.stage)
        self.param.grad = torch.randn(64, generator=g)

    def step(self) -> None:
        self.opt.step()
        self.iteration += 1


def _job(store: str) -> List[GroupVote]:
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={n: 0 for n in range(4)}))
    connect = lambda: MembershipStore.connect(store)  # noqa: E731
    return [
        GroupVote(n, GroupStore("127.0.0.1"), connect(), connect, group_size=G,
                  poll_interval_s=0.005, decision_wait_s=5.0)
        for n in range(4)
    ]  # fmt: skip


def _iteration(gvs: List[GroupVote], members: Dict[int, Member], it: int) -> Dict[int, bool]:
    """Every node votes for ``it`` after its gradient sync; a commit applies the step, a vote
    in doubt keeps it prepared (what the step hook does with ``VoteInDoubt``)."""
    for m in members.values():
        m.reduce(it)
    nodes = list(range(4))
    futures = {n: _submit(gvs[n].vote, 0, it, nodes) for n in members}
    results = {n: f.result(timeout=30)[0] for n, f in futures.items()}
    for n, ok in results.items():
        m = members[n]
        if ok:
            m.step()
        elif gvs[n].in_doubt(0, it):
            m.prepared = PreparedStep.keep(0, it, counted=2, params=m.params)
    return results


def test_a_split_vote_under_pp2_ends_every_member_at_the_committed_iteration(
    store: str,
) -> None:
    """Group 1's head (node 2) completes the hot count and dies before telling its group:
    group 0 (stage 0) applies iteration 2, nodes 2 and 3 (all of stage 1) are in doubt.
    Node 2 is replaced by a joiner; node 3 resolves the outcome (committed: stage 0 applied
    it), applies its kept step, and heals the joiner. No ShardLost; every member at iteration
    2; stage 1's tensors equal, bit for bit, a twin that committed without the failure."""
    gvs = _job(store)
    members = {n: Member(n // G) for n in range(4)}
    twins = {s: Member(s) for s in (0, 1)}  # the same job without a failure
    assert all(_iteration(gvs, members, 1).values())
    for it in (1, 2):
        for t in twins.values():
            t.reduce(it)
            t.step()

    die_after_hot_vote(gvs[2])  # the head's node dies between its hot vote and its group
    results = _iteration(gvs, members, 2)
    assert results == {0: True, 1: True, 2: False, 3: False}
    assert members[3].prepared is not None and members[3].iteration == 1
    assert not torch.equal(members[3].param, twins[1].param)  # not applied yet

    # The regroup: node 2 died (a joiner takes its slot); the all-gather of on_built.
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=1, replicas=(), members={n: 0 for n in range(4)}))
    world = {n: members[n] for n in (0, 1, 3)}
    world[2] = Member(1)  # the joiner: built from the seed, no trained state
    infos = [(n, n != 2, world[n].iteration if n != 2 else -1) for n in range(4)]
    prepared = [world[n].prepared.key if world[n].prepared else None for n in range(4)]
    # The old rule: stage 1 has no source at the committed iteration.
    with pytest.raises(ShardLost):
        heal_plan(infos, STAGE_GROUPS[1], heal_target(infos))

    outcome = resolve(ms, 0, 2, counted=2, applied=applied_by_someone(infos, 2))
    assert outcome is True
    # Any later resolver (another in-doubt member) reads the same, even without the evidence.
    assert resolve(ms, 0, 2, counted=2, applied=False) is True
    step = world[3].prepared
    world[3].prepared = None
    step.apply(world[3].params, world[3].step)
    settled = settle(infos, prepared, {(0, 2): outcome})
    target = heal_target(settled)
    plans = [heal_plan(settled, g, target) for g in STAGE_GROUPS]  # no ShardLost
    assert target == 2 and plans == [{}, {3: [2]}]
    for src, dsts in plans[1].items():  # the heal: state copied from the source
        for dst in dsts:
            world[dst].param.data.copy_(world[src].param.data)
            world[dst].opt.load_state_dict(world[src].opt.state_dict())
            world[dst].iteration = world[src].iteration
    assert {n: m.iteration for n, m in world.items()} == dict.fromkeys(range(4), 2)
    for n, m in world.items():
        twin = twins[m.stage]
        assert torch.equal(m.param, twin.param), n
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(m.opt.state[m.param][key], twin.opt.state[twin.param][key]), n


def test_an_incomplete_count_resolves_to_abort_and_fences_late_votes(store: str) -> None:
    """Two of three votes in, nobody applied: the resolution is ABORT (the kept step is
    dropped), and the third vote, arriving after it, learns ABORT too (the resolver's abort
    is the first one on the counter). A complete count with nobody alive that applied it
    resolves to COMMIT."""
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={n: 0 for n in range(3)}))
    futures = [_submit(vote, MembershipStore.connect(store), 0, 5, s, range(3), 0.005)
               for s in (0, 1)]  # fmt: skip
    while int(ms.store.add("votes/0/5", 0)) < 2:
        pass
    assert resolve(ms, 0, 5, counted=3, applied=False) is False
    assert vote(MembershipStore.connect(store), 0, 5, 2, range(3), 0.005) is False
    assert [f.result(timeout=30) for f in futures] == [False, False]
    infos = [(0, True, 4), (1, True, 4), (2, True, 4)]
    assert settle(infos, [(0, 5)] * 3, {(0, 5): False}) == infos
    # Iteration 6: every vote in (the completer's commit applied by nobody alive): COMMIT.
    assert all(vote(MembershipStore.connect(store), 0, 6, s, range(1), 0.005) for s in (0,))
    assert resolve(ms, 0, 6, counted=1, applied=False) is True
    assert settle([(0, True, 5)], [(0, 6)], {(0, 6): True}) == [(0, True, 6)]


class _LostCommitSet:
    """A store client whose ``set`` of a commit key never lands (fire-and-forget, its writer's
    connection lost with it in flight); everything else goes to the real store."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def set(self, key: str, value: Any) -> None:
        if not key.startswith("commit/"):
            self._store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _losing_commit(store: str) -> MembershipStore:
    ms = MembershipStore.connect(store)
    ms.store = _LostCommitSet(ms.store)
    return ms


def test_the_count_completer_does_not_apply_before_its_commit_is_on_the_store(
    store: str,
) -> None:
    """The vote that completes the count decides COMMIT, but its commit ``set`` does not land:
    it is in doubt (``CommitInDoubt``), not committed. Before, it returned True (the step
    applied) while no reader could find the commit."""
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={0: 0}))
    with pytest.raises(CommitInDoubt):
        vote(_losing_commit(store), 0, 1, 0, range(1), 0.005)
    assert not ms.store.check(["commit/0/1"])
    assert vote(MembershipStore.connect(store), 0, 2, 0, range(1), 0.005) is True
    assert ms.store.check(["commit/0/2"])  # a commit is on the store before it returns


def test_the_rank_voters_completer_is_in_doubt_with_its_count_when_its_commit_is_lost(
    store: str,
) -> None:
    """Per-rank vote (:class:`AsyncVoter`), two ranks: the one whose vote completes the count
    loses its commit ``set``; its future raises :class:`VoteInDoubt` with the counter's member
    count (2), never a commit, and the resolution (the count was complete) is COMMIT."""
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={0: 0, 1: 0}))
    ms.store.add("votes/0/1", 1)  # rank 0 voted already
    voter = AsyncVoter(store, 0.005)
    voter._ms = _losing_commit(store)
    with pytest.raises(VoteInDoubt) as err:
        voter.start(0, 1, 1, [0, 1]).result(timeout=30)
    assert err.value.counted == 2
    assert resolve(ms, 0, 1, err.value.counted, applied=False) is True


def test_the_node_vote_completer_tells_its_ranks_in_doubt_when_its_commit_is_lost(
    store: str,
) -> None:
    """Per-node vote, one node of two ranks (its vote completes the count): its commit ``set``
    does not land, so its ranks raise :class:`NodeVoteLost` (in doubt: they keep the step
    prepared) instead of applying it."""
    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={0: 0, 1: 0}))
    with tempfile.TemporaryDirectory(prefix="nv") as d:
        server = NodeVoteServer(f"{d}/n0", store, node=0, poll_interval_s=0.005,
                                vote_membership=lambda: _losing_commit(store))  # fmt: skip
        try:
            clients = [NodeVoteClient(f"{d}/n0", lambda s: 0) for _ in range(2)]
            futures = [c.start(0, 1, s, [0, 1]) for s, c in enumerate(clients)]
            for f in futures:
                with pytest.raises(NodeVoteLost):
                    f.result(timeout=30)
            assert not ms.store.check(["commit/0/1"])
        finally:
            server.close()


# ---------------------------------------------------------------- the session and step hook


class _Optimizer:
    """Megatron-Core's optimizer shape: ``step`` prepares the (reduced, clipped) gradients,
    then calls ``step_with_ready_grads`` (which the commit vote wraps)."""

    def __init__(self, inner: torch.optim.Optimizer, grads: Callable[[], List[torch.Tensor]]):
        self.inner, self.grads = inner, grads

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.inner.param_groups

    def step(self):
        params = [p for g in self.param_groups for p in g["params"]]
        for p, g in zip(params, self.grads(), strict=True):
            p.grad = g.clone()
        return self.step_with_ready_grads(), 0.0, 0

    def step_with_ready_grads(self) -> bool:
        self.inner.step()
        return True

    def state_dict(self) -> Dict[str, Any]:
        return self.inner.state_dict()


class _Trainer:
    """A stage's model (one linear layer) with the attributes the carry exports."""

    def __init__(self, stage: int) -> None:
        torch.manual_seed(stage)
        self.stage = stage
        self.model_chunks = [torch.nn.Linear(4, 4)]
        inner = torch.optim.AdamW(self.model_chunks[0].parameters(), lr=0.1)
        self.optimizer = _Optimizer(inner, lambda: self.reduced(self.iteration + 1))
        self.scheduler = type("S", (), {"state_dict": lambda self: {}})()
        self.iteration, self.consumed_samples = 0, 0
        self.history, self.evals, self.saved = [], [], []
        self.controller = None

    def reduced(self, iteration: int) -> List[torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * iteration + self.stage)
        return [torch.randn(p.shape, generator=g) for p in self.model_chunks[0].parameters()]

    def train_step(self) -> None:
        self.optimizer.step()
        self.iteration += 1

    def extra_state(self) -> Dict[str, Any]:
        return {}

    def _apply(self, step: PreparedStep) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        step.apply(params, self.optimizer.step_with_ready_grads)
        self.iteration += 1

    apply_prepared_step = _apply


class _Voter:
    """A voter whose vote ends in doubt (its node's vote server lost the outcome)."""

    def start(self, generation, iteration, slot, members, report_progress=False) -> Future:
        future: Future = Future()
        future.set_exception(NodeVoteLost("in doubt", counted=2))
        return future

    def abort(self, *a, **k) -> bool:
        raise AssertionError("a vote in doubt is not aborted by its rank")


def _session(store: str, slot: int) -> Any:
    from types import SimpleNamespace

    from megatron_mecefo.recovery.session import RecoverySession

    class Session(SimpleNamespace):
        keep_prepared = RecoverySession.keep_prepared
        _prepared_entry = RecoverySession._prepared_entry
        _drop_prepared = RecoverySession._drop_prepared
        _settle_prepared = RecoverySession._settle_prepared

        def log(self, line: str, all_ranks: bool = False) -> None:
            print(line)

    return Session(
        slot=slot, rank=slot, ms=MembershipStore.connect(store), decision_wait_s=5.0,
        args=SimpleNamespace(use_distributed_optimizer=False),
        prepared=None, valid=True, takeover_pending=False, carry=None, voter=_Voter(),
        gen=Generation(number=0, replicas=(), members={s: 0 for s in range(4)}),
        injector=SimpleNamespace(phase=lambda *a: None), vote_s=[],
    )  # fmt: skip


@pytest.mark.parametrize("stage0_applied", [True, False])
def test_the_session_settles_a_split_vote_before_the_heal(
    store: str, monkeypatch: pytest.MonkeyPatch, stage0_applied: bool
) -> None:
    """Stage 1's ranks (2, 3) voted yes and their votes ended in doubt: the step hook keeps
    the reduced gradients and applies nothing. In the new world (rank 2 replaced by a
    joiner) the session resolves the outcome before the heal, with the evidence of stage 0
    (it applied iteration 2) or, where stage 0 is in doubt too, from the count (complete on
    the hot store, its commit key lost): rank 3 applies its kept step, every member ends at
    iteration 2 with no ShardLost, and stage 1 equals a twin that committed."""
    import torch.distributed as dist

    from megatron_mecefo.recovery.step_hooks import install_commit_vote

    ms = MembershipStore.connect(store)
    ms.publish(Generation(number=0, replicas=(), members={s: 0 for s in range(4)}))
    trainers = [_Trainer(s // 2) for s in range(4)]
    twins = [_Trainer(s) for s in (0, 1)]
    for t in trainers + twins:
        t.train_step()  # iteration 1, committed by all
    twins[0].train_step(), twins[1].train_step()
    sessions = [_session(store, s) for s in range(4)]
    doubt = (2, 3) if stage0_applied else (0, 1, 2, 3)
    for s in range(4):
        if s in doubt:
            install_commit_vote(sessions[s], trainers[s])
            before = [p.detach().clone() for p in trainers[s].model_chunks[0].parameters()]
            with pytest.raises(NodeVoteLost):
                trainers[s].optimizer.step()
            after = list(trainers[s].model_chunks[0].parameters())
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
            assert sessions[s].prepared.key == (0, 2) and sessions[s].prepared.counted == 2
        else:
            trainers[s].train_step()  # committed: iteration 2 applied
    if not stage0_applied:  # both groups' votes counted on the hot store; the commit lost
        ms.store.add("votes/0/2", 2)

    # The new world: rank 2 is a joiner (its node died); the all-gather; the settle.
    ms.publish(Generation(number=1, replicas=(), members={s: 0 for s in range(4)}))
    sessions[2] = _session(store, 2)
    sessions[2].valid = False
    trainers[2] = _Trainer(1)
    infos = [(s, sessions[s].valid, trainers[s].iteration if s != 2 else -1) for s in range(4)]
    entries = [sessions[s]._prepared_entry(trainers[s]) for s in range(4)]
    assert entries[2] is None and entries[3] == (0, 2, 2)
    boxes: Dict[int, Any] = {}

    def broadcast(box: List[Any], src: int) -> None:
        if me["rank"] == src:
            boxes[src] = box[0]
        else:
            box[0] = boxes[src]

    me = {"rank": 0}
    monkeypatch.setattr(dist, "get_rank", lambda: me["rank"])
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    resolver = min(r for r, e in enumerate(entries) if e is not None)
    settled = {}
    for r in [resolver] + [r for r in range(4) if r != resolver]:
        me["rank"] = r
        settled[r] = sessions[r]._settle_prepared(trainers[r], infos, entries)
    assert all(v == settled[0] for v in settled.values())
    assert settled[0] == [(0, True, 2), (1, True, 2), (2, False, -1), (3, True, 2)]
    assert [heal_plan(settled[0], g, 2) for g in STAGE_GROUPS] == [{}, {3: [2]}]
    assert ms.store.get("resolved/0/2") == b"commit"
    assert sessions[3].carry["iteration"] == 2 and sessions[3].prepared is None
    for r in (0, 1, 3):
        mine = list(trainers[r].model_chunks[0].parameters())
        twin = list(twins[trainers[r].stage].model_chunks[0].parameters())
        assert all(torch.equal(a, b) for a, b in zip(mine, twin, strict=True)), r


def test_the_node_servers_tell_a_split_groups_ranks_in_doubt_with_the_count(store: str) -> None:
    """Through the node servers (4 nodes of one rank, ``group_size=2``): group 1's head
    completes the hot count and dies before telling its group. The ranks of group 0 commit;
    the rank of node 3 raises :class:`NodeVoteLost` carrying the hot counter's member count
    (2 groups), which the resolver fences the old count with; the resolution is COMMIT."""
    ms = MembershipStore.connect(store)
    members = {s: 0 for s in range(4)}
    ms.publish(Generation(number=0, replicas=(), members=members))
    with tempfile.TemporaryDirectory(prefix="gv") as d:
        servers = [
            NodeVoteServer(f"{d}/n{n}", store, node=n, poll_interval_s=0.005, group_size=G)
            for n in range(4)
        ]
        try:
            die_after_hot_vote(servers[2].group)  # dies between its hot vote and its group
            clients = {s: NodeVoteClient(f"{d}/n{s}", lambda s: s) for s in members}
            futures = {s: c.start(0, 1, s, sorted(members)) for s, c in clients.items()}
            assert futures[0].result(timeout=30)[0] and futures[1].result(timeout=30)[0]
            with pytest.raises(NodeVoteLost) as err:
                futures[3].result(timeout=30)
            assert err.value.counted == 2
            assert resolve(ms, 0, 1, err.value.counted, applied=False) is True
        finally:
            for s in servers:
                s.close()


def test_a_kept_step_that_cannot_be_applied_is_dropped_with_its_reason(
    store: str, capsys: pytest.CaptureFixture
) -> None:
    """The world is told of a kept step only where it can be applied; elsewhere it is dropped
    with one line (the old rule then: the heal settles the iteration, if a peer holds it)."""
    trainer = _Trainer(0)
    trainer.train_step()
    step = PreparedStep.keep(0, 2, 2, [p for g in trainer.optimizer.param_groups
                                       for p in g["params"]])  # fmt: skip
    cases = {
        "no trained state": dict(valid=False),
        "collective": dict(args=type("A", (), {"use_distributed_optimizer": True})()),
        "at iteration 0": dict(iteration=0),
        "changed shape": dict(shape=True),
    }
    for why, change in cases.items():
        session, t = _session(store, 0), _Trainer(0)
        t.iteration = change.get("iteration", 1)
        session.valid = change.get("valid", True)
        session.args = change.get("args", session.args)
        if change.get("shape"):
            t.model_chunks = [torch.nn.Linear(4, 3)]
            t.optimizer.inner = torch.optim.AdamW(t.model_chunks[0].parameters(), lr=0.1)
        session.prepared = step
        assert session._prepared_entry(t) is None and session.prepared is None, why
        assert why in capsys.readouterr().out
    session, t = _session(store, 0), _Trainer(0)
    t.iteration, session.prepared = 1, step
    assert session._prepared_entry(t) == (0, 2, 2)
    del _Trainer.apply_prepared_step  # a trainer without the optional method
    try:
        session.prepared = step
        assert session._prepared_entry(_Trainer(0)) is None
    finally:
        _Trainer.apply_prepared_step = _Trainer._apply  # type: ignore[attr-defined]
