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

from datetime import timedelta
from typing import Dict, Optional, Sequence

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
    writes the commit. Everyone blocks in ``wait`` on the decision key (woken by the store the
    moment it is written, no polling); every ``poll_interval_s * 50`` it looks whether a
    failure generation has superseded this one, and then writes the abort. ``compare_set``
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
    wait = timedelta(seconds=max(poll_interval_s * 50, 0.05))
    while True:
        try:
            ms.store.wait([decision_key], wait)
            break
        except DistStoreError:  # no decision yet: has a member died meanwhile?
            if _superseded(ms, generation, iteration):
                ms.store.compare_set(decision_key, "", ABORT)
                break
    return ms.store.get(decision_key).decode() == COMMIT


def _superseded(ms: MembershipStore, generation: int, iteration: int) -> bool:
    """Whether a newer generation ends this one before ``iteration`` is applied: a failure
    generation, or a planned one whose switch boundary is not after this iteration."""
    number = ms.generation_number()
    if number == generation:
        return False
    gen = ms.generation(number)
    return gen.at_iteration is None or gen.at_iteration <= iteration
