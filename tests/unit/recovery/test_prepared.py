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
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, List

import pytest
import torch

from megatron_mecefo.recovery.commit import CommitInDoubt, vote
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
    """``fn(*args)`` on a daemon thread (a vote that never ends must not hold up the exit)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 (handed to the test)
            future.set_exception(err)

    threading.Thread(target=run, daemon=True).start()
    return future


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

    decide = gvs[2]._decide_hot

    def decide_then_die(*a, **k) -> str:
        decision = decide(*a, **k)
        gvs[2].own.close()  # the head's node dies between its hot vote and telling its group
        return decision

    gvs[2]._decide_hot = decide_then_die  # type: ignore[method-assign]
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
