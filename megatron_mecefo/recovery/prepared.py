"""Prepared, not in doubt: a member that voted yes keeps its step until the outcome is known.

A member whose commit vote was cut off (its group's head died after the count, the hot store
was taken over, its node's vote server went away, or its own commit ``set`` did not land:
:class:`.commit.VoteInDoubt`) does not know whether the other members applied the step. It
must not apply it then, and, unlike before, it does not forget it either: it keeps the step
*prepared* (:class:`PreparedStep`: its reduced, clipped gradients, the input of the
optimizer's update) through the regroup. The next generation resolves the outcome
(:func:`resolve`):

* in ``--store-mode etcd``, **as claimed on etcd** (``outcome/<g>/<i>``, :func:`.commit.claim`):
  the voter that completed the count claimed the commit before anyone applied the step, so a
  commit that only a node now dead or left out of the new world applied, on a hot store lost
  in a takeover, still stands; the resolver's own proposal (below) is claimed, and the first
  claim stands;
* **committed** when any member of the new world applied it (the all-gather of the members'
  committed iterations in ``RecoverySession.on_built`` shows it), or when the old vote's
  count was complete before its first abort (the resolver adds an abort to the old counter:
  :func:`.commit.abort` returns the outcome that stands, and fences any vote still in
  flight);
* **aborted** otherwise (nobody alive applied it, and the count cannot complete any more).

The outcome is recorded once (``resolved/<g>/<i>``, first writer wins). Each in-doubt member
then applies its kept step or drops it (:func:`settle`) *before* the heal chooses its sources,
so every member of a stage ends at the same iteration without a peer of its own stage: under
pipeline parallelism a whole stage can sit in one vote group, so a split vote used to leave a
stage with no member at the committed iteration (``ShardLost``, issue 54 finding C1).

Memory: the kept gradients are one extra copy of the optimizer's main gradients, held only
while the member is in doubt (from the cut-off vote to the next world's resolution), never in
a normal iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_mecefo.recovery.commit import ABORT, COMMIT, DECISION_WAIT_S, abort, claim

RESOLVED_KEY = "resolved/{generation}/{iteration}"
"""Store key: the resolved outcome of an in-doubt iteration (``commit`` or ``abort``)."""


@dataclass
class PreparedStep:
    """The step of ``iteration`` (voted yes in ``generation``), kept while its outcome is unknown.

    Args:
        generation: The generation of the vote.
        iteration: The iteration voted for.
        counted: The member count of the vote's counter on the hot store (ranks for the rank
            vote, nodes for the node vote, groups for the two-level vote).
        grads: Per parameter the optimizer updates, its reduced (clipped) gradient, copied.
        extra: What else the trainer needs to finish the iteration (e.g. the RNG states at
            its end); carried as is.
    """

    generation: int
    iteration: int
    counted: int
    grads: List[Any]
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def keep(
        cls, generation: int, iteration: int, counted: int, params: Sequence[Any], **extra: Any
    ) -> "PreparedStep":
        """Copy the gradients of ``params`` (``.grad``, None stays None): the one extra copy of
        the main gradients an in-doubt member holds (module docstring)."""
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        return cls(generation, iteration, counted, grads, dict(extra))

    @property
    def key(self) -> Tuple[int, int]:
        return self.generation, self.iteration

    def fits(self, params: Sequence[Any]) -> bool:
        """Whether the kept gradients match ``params`` (the same optimizer layout: not, e.g.,
        after the distributed optimizer re-sharded over a different world)."""
        if self.extra.get("skipped"):
            return True
        return len(params) == len(self.grads) and all(
            g is None or (g.shape == p.shape and g.dtype == p.dtype)
            for p, g in zip(params, self.grads, strict=True)
        )

    def apply(self, params: Sequence[Any], step: Callable[[], Any]) -> Any:
        """Put the kept gradients back on ``params`` and run ``step`` (the optimizer's update
        with ready gradients); the copy is released."""
        for p, g in zip(params, self.grads, strict=True):
            p.grad = g
        self.grads = []
        return step()


def applied_by_someone(infos: Sequence[Tuple[int, bool, int]], iteration: int) -> bool:
    """Whether a member with valid state is at ``iteration`` or past it: it applied the step.

    Args:
        infos: Per global rank, ``(slot, holds valid state, its committed iteration or -1)``.
    """
    return any(ok and it >= iteration for _, ok, it in infos)


def resolve(
    ms: Any,
    generation: int,
    iteration: int,
    counted: Optional[int],
    applied: bool,
    decision_wait_s: float = DECISION_WAIT_S,
) -> bool:
    """The outcome of the in-doubt ``generation/iteration``, the same for every caller (True:
    committed; module docstring). The first outcome recorded stands: a later world, whose
    evidence may differ (the member that applied it died since), reads it.

    Args:
        ms: A :class:`~.membership.MembershipStore` of the new generation's hot store.
        counted: :attr:`PreparedStep.counted`; None where no holder knows it (a voter that
            hung: its count cannot be read, and nobody alive applied the step unless
            ``applied``).
        applied: :func:`applied_by_someone` over the new world's members.
    """
    key = RESOLVED_KEY.format(generation=generation, iteration=iteration)
    if ms.store.check([key]):  # resolved already (a world that failed after resolving it)
        return ms.store.get(key).decode() == COMMIT
    if applied:
        outcome = True
    elif counted:  # fences a vote still in flight; True when the count completed before any abort
        outcome = abort(ms, generation, iteration, counted, decision_wait_s)
    else:
        outcome = False
    # etcd mode: the first claim stands (a commit that a node outside this world applied)
    outcome = claim(ms, generation, iteration, COMMIT if outcome else ABORT)
    standing = ms.store.compare_set(key, "", COMMIT if outcome else ABORT).decode()
    return standing == COMMIT


def settle(
    infos: Sequence[Tuple[int, bool, int]],
    prepared: Sequence[Optional[Tuple[int, int]]],
    outcomes: Dict[Tuple[int, int], bool],
) -> List[Tuple[int, bool, int]]:
    """The members' ``infos`` after each in-doubt member applied or dropped its step: every
    member computes the same from the same all-gather and outcomes.

    Args:
        infos: Per global rank, ``(slot, holds valid state, its committed iteration or -1)``.
        prepared: Per global rank, the ``(generation, iteration)`` of its kept step, or None.
        outcomes: Per in-doubt ``(generation, iteration)``, its resolved outcome.
    """
    out = []
    for (slot, ok, it), key in zip(infos, prepared, strict=True):
        if ok and key is not None and outcomes[key] and key[1] == it + 1:
            it += 1  # applied its kept step
        out.append((slot, ok, it))
    return out
