"""The commit vote: an optimizer step is applied only if every member finished its sync.

torchft's ``should_commit``, over the membership store. After the gradient sync, each member
writes ``vote/<g>/<iteration>/<slot>`` and waits until either every member of generation
``g`` has voted (commit) or the generation has moved on (a member died or left: abort). The
outcome is then fixed by an atomic ``compare_set`` on ``decision/<g>/<iteration>``: the first
member to decide writes it and every other member adopts that value, so no step is applied by
some members and not others. An aborted iteration is redone in the next generation, with the
same samples, under the takeover plan.

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

    The members count their votes with one atomic ``add``; the one that completes the count
    writes the commit. Everyone else blocks in ``get`` on the decision key (answered by the
    store the moment it is written, no polling); every ``poll_interval_s * 50`` it looks
    whether a failure generation has superseded this one, and then writes the abort. ``compare_set``
    keeps the first decision written, so all members apply the same one. ``outcome["last"]``
    (when given) tells whether this member's vote completed the count: its vote never waited
    for a peer, so its duration is the protocol's own cost.
    """
    decision_key = f"decision/{generation}/{iteration}"
    count = int(ms.store.add(f"votes/{generation}/{iteration}", 1))
    if outcome is not None:
        outcome["last"] = count == len(members)
    if count == len(members):
        # compare_set answers with the value now stored: the decision, with no wait or get.
        return ms.store.compare_set(decision_key, "", COMMIT).decode() == COMMIT
    # ``get`` blocks in the store until the key exists and answers with its value: one round
    # trip after the decision is written, where ``wait`` then ``get`` took two. The client's
    # timeout is lowered meanwhile so that a death is looked for every ``50 * poll`` s.
    previous = ms.store.timeout
    ms.store.set_timeout(timedelta(seconds=max(poll_interval_s * 50, 0.05)))
    try:
        while True:
            try:
                return ms.store.get(decision_key).decode() == COMMIT
            except DistStoreError:  # no decision yet: has a member died meanwhile?
                if _superseded(ms, generation, iteration):
                    ms.store.compare_set(decision_key, "", ABORT)
    finally:
        ms.store.set_timeout(previous)


def abort(ms: MembershipStore, generation: int, iteration: int) -> None:
    """Decide ABORT for ``iteration`` unless a decision was taken (this member will not apply
    the step, so no member may: the first decision written stands for everyone)."""
    ms.store.compare_set(f"decision/{generation}/{iteration}", "", ABORT)


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
