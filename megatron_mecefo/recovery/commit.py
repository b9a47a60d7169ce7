"""The commit vote: an optimizer step is applied only if every member finished its sync.

torchft's ``should_commit``, over the membership store. After the gradient sync, each member
writes ``vote/<g>/<iteration>/<slot>`` and waits until either every member of generation
``g`` has voted (commit) or the generation has moved on (a member died or left: abort). The
outcome is then fixed by an atomic ``compare_set`` on ``decision/<g>/<iteration>``: the first
member to decide writes it and every other member adopts that value, so no step is applied by
some members and not others. An aborted iteration is redone in the next generation, with the
same samples, under the takeover plan.
"""

from __future__ import annotations

import time
from typing import Sequence

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
) -> bool:
    """Vote for ``iteration`` in ``generation``; True when the step may be applied."""
    prefix = f"vote/{generation}/{iteration}/"
    ms.store.set(prefix + str(slot), "1")
    keys = [prefix + str(s) for s in members]
    decision_key = f"decision/{generation}/{iteration}"
    mine = None
    sleep = poll_interval_s / 10
    while mine is None:
        if ms.store.check(keys):
            mine = COMMIT
        elif ms.store.check([decision_key]):
            mine = ms.store.get(decision_key).decode()
        elif _superseded(ms, generation, iteration):
            mine = ABORT
        else:
            time.sleep(sleep)
            sleep = min(2 * sleep, poll_interval_s)  # most votes land within a millisecond
    agreed = ms.store.compare_set(decision_key, "", mine).decode()
    return agreed == COMMIT


def _superseded(ms: MembershipStore, generation: int, iteration: int) -> bool:
    """Whether a newer generation ends this one before ``iteration`` is applied: a failure
    generation, or a planned one whose switch boundary is not after this iteration."""
    number = ms.generation_number()
    if number == generation:
        return False
    gen = ms.generation(number)
    return gen.at_iteration is None or gen.at_iteration <= iteration
