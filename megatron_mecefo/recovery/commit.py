"""The commit vote: an optimizer step is applied only if every member finished its sync.

torchft's ``should_commit``, over the membership store. After the gradient sync, each member
adds 1 to ``votes/<g>/<iteration>`` and waits until either every member of generation ``g``
has voted (commit) or the generation has moved on (a member died or left: abort).

The counter is the arbiter, so no step is applied by some members and not others: an abort
adds :data:`ABORT_WEIGHT` to the same counter. The store orders the additions, and the outcome
is COMMIT exactly when the last vote comes before the first abort. The member whose vote
completes the count sees exactly the member count, and the first aborter sees every vote in or
not. Whoever decides writes ``decision/<g>/<iteration>`` with a plain ``set``: no reply is
awaited, so the commit costs its voter one round trip. The other members wait on that key. A
lost ``set`` (its writer's node died with it in flight) costs a wait until the look for a newer
generation, whose abort then finds the same outcome in the counter. An aborted iteration is
redone in the next generation, with the same samples, under the takeover plan.

:class:`AsyncVoter` runs the vote on a worker thread with its own store client, so that its
round trips overlap the optimizer's gradient preparation (copy to main grads, norm, clipping),
which changes nothing a redo would need: only the parameter update waits for the decision.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Dict, Optional, Sequence, Tuple

from torch.distributed import DistStoreError

from megatron_mecefo.recovery.membership import MembershipStore

COMMIT, ABORT = "commit", "abort"


class StepAborted(RuntimeError):
    """The members did not all finish the iteration: it is redone after the regroup."""


ABORT_WEIGHT = 1 << 40
"""What an abort adds to the vote counter: more than any member count, so the counter tells how
many votes and whether an abort came before (see the module docstring)."""


def vote(
    ms: MembershipStore,
    generation: int,
    iteration: int,
    slot: int,
    members: Sequence[int],
    poll_interval_s: float,
    outcome: Optional[Dict[str, bool]] = None,
) -> bool:
    """Vote for ``iteration`` in ``generation``; True when the step may be applied.

    The member whose ``add`` completes the count writes the commit; a member whose ``add``
    comes after an abort knows the outcome from the count. Every other member blocks in
    ``get`` on the decision key (answered by the store the moment it is written, no polling);
    every ``poll_interval_s * 50`` it looks whether a failure generation has superseded this
    one, and then aborts. ``outcome["last"]`` (when given) tells whether this member's vote
    completed the count: its vote never waited for a peer, so its duration is the protocol's
    own cost. ``slot`` names the voter in errors only.
    """
    count = int(ms.store.add(_votes_key(generation, iteration), 1))
    if outcome is not None:
        outcome["last"] = count == len(members)
    if count == len(members):  # every vote in, no abort before: commit (one round trip)
        ms.store.set(_decision_key(generation, iteration), COMMIT)
        return True
    if count > len(members):  # an abort came before this vote: with this one missing
        return False
    # ``get`` blocks in the store until the key exists and answers with its value. The
    # client's timeout is lowered meanwhile so that a death is looked for every ``50 * poll`` s.
    previous = ms.store.timeout
    ms.store.set_timeout(timedelta(seconds=max(poll_interval_s * 50, 0.05)))
    try:
        while True:
            try:
                return ms.store.get(_decision_key(generation, iteration)).decode() == COMMIT
            except DistStoreError:  # no decision yet: has a member died meanwhile?
                if _superseded(ms, generation, iteration):
                    return abort(ms, generation, iteration, len(members))
    finally:
        ms.store.set_timeout(previous)


def abort(ms: MembershipStore, generation: int, iteration: int, members: int) -> bool:
    """Abort ``iteration`` unless every one of the ``members`` has voted already; returns the
    outcome that stands for everyone (True: commit).

    The first abort decides from the count it finds and writes the decision. A later one can
    tell the outcome from the count unless every vote is in, and then reads the first one's.
    """
    total = int(ms.store.add(_votes_key(generation, iteration), ABORT_WEIGHT)) - ABORT_WEIGHT
    votes = total % ABORT_WEIGHT
    if total < ABORT_WEIGHT:  # the first abort
        decision = COMMIT if votes == members else ABORT
        ms.store.set(_decision_key(generation, iteration), decision)
        return decision == COMMIT
    if votes < members:  # not every vote in even now: the first abort found fewer still
        return False
    return ms.store.get(_decision_key(generation, iteration)).decode() == COMMIT


def _votes_key(generation: int, iteration: int) -> str:
    return f"votes/{generation}/{iteration}"


def _decision_key(generation: int, iteration: int) -> str:
    return f"decision/{generation}/{iteration}"


def _superseded(ms: MembershipStore, generation: int, iteration: int) -> bool:
    """Whether a newer generation ends this one before ``iteration`` is applied: a failure
    generation, or a planned one whose switch boundary is not after this iteration."""
    number = ms.generation_number()
    if number == generation:
        return False
    gen = ms.generation(number)
    return gen.at_iteration is None or gen.at_iteration <= iteration


class AsyncVoter:
    """Runs :func:`vote` on a daemon worker thread with a store client of its own.

    Args:
        address: ``HOST:PORT`` of the membership store.
        poll_interval_s: As for :func:`vote`.
    """

    def __init__(self, address: str, poll_interval_s: float) -> None:
        self.address, self.poll_interval_s = address, poll_interval_s
        self._jobs: "queue.Queue[Tuple[Future, tuple]]" = queue.Queue()
        self._ms: Optional[MembershipStore] = None
        self.cpu_s = 0.0
        """CPU seconds the worker thread has used (the supervisor's overhead accounting)."""
        # A daemon thread: a vote still waiting when the process exits must not hold it up.
        threading.Thread(target=self._run, name="mecefo-vote", daemon=True).start()

    def start(
        self,
        generation: int,
        iteration: int,
        slot: int,
        members: Sequence[int],
        report_progress: bool = False,
    ) -> Future:
        """Queue a vote; the future gives ``(commit, completed_the_count, seconds)``. With
        ``report_progress``, a commit also sets the store's ``progress`` key to ``iteration``
        (the coordinator schedules rejoins from it), off the training thread."""
        future: Future = Future()
        self._jobs.put((future, (generation, iteration, slot, list(members), report_progress)))
        return future

    def _run(self) -> None:
        while True:
            future, (generation, iteration, slot, members, progress) = self._jobs.get()
            try:
                if self._ms is None:
                    self._ms = MembershipStore.connect(self.address)
                outcome: Dict[str, bool] = {}
                t0 = time.perf_counter()
                ok = vote(
                    self._ms, generation, iteration, slot, members, self.poll_interval_s, outcome
                )
                future.set_result((ok, outcome["last"], time.perf_counter() - t0))
                if ok and progress:
                    self._ms.store.set("progress", str(iteration))
            except BaseException as err:  # noqa: BLE001 (the training thread re-raises it)
                future.set_exception(err)
            self.cpu_s = time.thread_time()
