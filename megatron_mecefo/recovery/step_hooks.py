"""The hooks the session puts around a training step: kill-injection phases and the commit
vote.

* :func:`phase_forward_step` wraps a forward-step function so that the ``forward`` phase fires
  before the first micro-batch and ``backward`` when the first backward starts; each trainer
  calls it from its own forward-backward wrapper (:meth:`RecoverableTrainer.hook_phases`), and
  fires ``grad-sync`` before its gradient sync.
* :func:`install_commit_vote` makes the optimizer's update wait for the commit vote
  (:mod:`.commit`): every member votes once its gradient sync finished, and the update runs
  only if every member did, so no step is half-applied; an aborted vote raises
  :class:`~.commit.StepAborted` and the iteration is redone in the next world. A vote in doubt
  (:class:`~.commit.VoteInDoubt`) applies nothing either, but the rank keeps the step prepared
  (its reduced, clipped gradients: ``RecoverySession.keep_prepared``) for the next
  generation's resolution (:mod:`.prepared`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict

from megatron_mecefo.recovery.commit import StepAborted, VoteInDoubt, abort
from megatron_mecefo.recovery.trainer import PhaseHook

DOUBT_GRACE_S = 2.0
"""How long a rank still waits for its vote's outcome once a failure generation superseded its
world (the voter, alive, aborts the vote within a fraction of a second then)."""

VOTE_BACKSTOP_S = 60.0
"""The least a vote may wait with no superseding generation before the rank gives up (the
members vote right after the same gradient sync: no live peer is that late)."""


def await_vote(future: Any, session: Any, iteration: int, slice_s: float = 0.25) -> Any:
    """``future.result()`` with a deadline: :class:`VoteInDoubt` once the world's watchdog has
    seen a failure generation (the coordinator declared a hung node lost) and
    :data:`DOUBT_GRACE_S` passed (more under a long poll interval), or past the backstop
    (``max(VOTE_BACKSTOP_S, 4 x the decision wait)``) with none: its error report then has the
    coordinator regroup."""
    from concurrent.futures import TimeoutError as FutureTimeout

    t0 = time.monotonic()
    backstop = max(VOTE_BACKSTOP_S, 4 * float(getattr(session, "decision_wait_s", 0.0)))
    # A live voter looks for a superseding generation every 5 waits of 10 poll intervals
    # (commit.vote): its abort comes within that, and is better than a doubt.
    poll_s = float(getattr(getattr(session, "cfg", None), "poll_interval_s", 0.0))
    grace = max(DOUBT_GRACE_S, 50 * poll_s + 1.0)
    superseded_at = None
    while True:
        try:
            return future.result(timeout=slice_s)
        except FutureTimeout:
            pass
        now = time.monotonic()
        watchdog = getattr(session, "watchdog", None)
        if superseded_at is None and watchdog is not None and watchdog.fired is not None:
            superseded_at = now
        if superseded_at is not None and now - superseded_at > grace:
            raise VoteInDoubt(
                f"iteration {iteration}: no vote outcome {now - t0:.1f} s after the vote and "
                f"{now - superseded_at:.1f} s after a failure generation superseded it (the "
                "voter hangs): in doubt, the step is not applied"
            )
        if now - t0 > backstop:
            raise VoteInDoubt(
                f"iteration {iteration}: no vote outcome in {now - t0:.1f} s (the voter hangs): "
                "in doubt, the step is not applied"
            )


def phase_forward_step(forward_step_func: Callable, phase: PhaseHook, iteration: int) -> Callable:
    """``forward_step_func`` firing ``forward`` (each micro-batch; a kill fires once) and
    ``backward`` (when the first backward of the iteration starts)."""
    fired = {"backward": False}

    def step(data_iterator: Any, model: Any, *a: Any, **k: Any) -> Any:
        phase("forward", iteration)
        output, loss_func = forward_step_func(data_iterator, model, *a, **k)
        if output.requires_grad and not fired["backward"]:
            fired["backward"] = True
            output.register_hook(lambda g: phase("backward", iteration))
        return output, loss_func

    return step


def install_commit_vote(session: Any, trainer: Any) -> None:
    """Wrap ``trainer.optimizer``: the update of iteration ``trainer.iteration + 1`` waits for
    the members' commit vote (the vote overlaps the gradient preparation)."""
    optimizer = trainer.optimizer
    optimizer_step, ready_step = optimizer.step, optimizer.step_with_ready_grads
    pending: Dict[str, Any] = {}

    def await_decision(skipped: bool = False) -> None:
        future, iteration = pending.pop("vote")
        t_wait = time.perf_counter()
        try:
            commit, completed, protocol_s = await_vote(future, session, iteration)
        except VoteInDoubt as err:  # voted yes, outcome unknown: kept for the next generation
            session.keep_prepared(trainer, iteration, getattr(err, "counted", None), skipped)
            raise
        waited = time.perf_counter() - t_wait
        session.vote_s.append(waited)
        if completed:
            session.vote_last_s.append(waited)
            session.vote_protocol_s.append(protocol_s)
        if not commit:
            raise StepAborted(f"iteration {iteration}: not every member finished its sync")

    def step_after_commit(*a: Any, **k: Any) -> Any:
        # The vote runs while the optimizer prepares the gradients (main grads, norm,
        # clipping: nothing a redo needs); the update itself waits for the decision.
        iteration, gen = trainer.iteration + 1, session.gen
        future = session.voter.start(
            gen.number, iteration, session.slot, gen.members, report_progress=session.rank == 0
        )
        pending["vote"] = (future, iteration)
        try:
            result = optimizer_step(*a, **k)
            if "vote" in pending:  # no update (inf/nan in the grads): agree all the same
                await_decision(skipped=True)
            return result
        except BaseException:
            if pending.pop("vote", None) is not None and not future.done():
                # wakes the peers (a node vote aborts through the node: its counter counts nodes)
                if hasattr(session.voter, "abort"):
                    with contextlib.suppress(Exception):  # the node is gone: nothing to wake
                        session.voter.abort(
                            gen.number, iteration, session.slot, gen.members,
                            timeout_s=max(DOUBT_GRACE_S, session.decision_wait_s),
                        )  # fmt: skip
                else:
                    abort(session.ms, gen.number, iteration, len(gen.members),
                          session.decision_wait_s)  # fmt: skip
            raise

    def update_after_commit(*a: Any, **k: Any) -> Any:
        if "vote" in pending:
            iteration = pending["vote"][1]
            await_decision()
            session.injector.phase("optimizer", iteration)
        return ready_step(*a, **k)

    optimizer.step, optimizer.step_with_ready_grads = step_after_commit, update_after_commit
