"""Which member heals a data-parallel group (``recovery/state/heal.heal_source``), and the
lost shard: no member of a group at the newest iteration stops the job with one line."""

from __future__ import annotations

import pytest

from megatron_mecefo.recovery.state.heal import ShardLost, heal_plan, heal_source

# TP2 x DP2: replica 0 = ranks 0, 1; replica 1 = ranks 2, 3; data-parallel groups [0, 2], [1, 3].
GROUPS = ([0, 2], [1, 3])


def test_a_joiner_heals_from_its_group_member_at_the_newest_iteration() -> None:
    # Rank 2 died and was replaced (a joiner: no state).
    infos = [(0, True, 7), (1, True, 7), (2, False, -1), (3, True, 7)]
    assert [heal_source(infos, g, 7) for g in GROUPS] == [0, None]


def test_the_source_is_at_the_newest_iteration_not_an_older_one() -> None:
    infos = [(0, True, 6), (1, True, 7), (2, True, 7), (3, True, 7)]
    assert heal_source(infos, [0, 2], 7) == 2


def test_a_group_with_no_member_at_the_newest_iteration_is_a_lost_shard() -> None:
    # Both tensor-parallel rank 0s died: group [0, 2] holds nothing of iteration 7, while
    # group [1, 3] does. (The code before raised a bare StopIteration here.)
    infos = [(0, False, -1), (1, True, 7), (2, False, -1), (3, True, 7)]
    assert heal_source(infos, [1, 3], 7) is None
    with pytest.raises(ShardLost) as err:
        heal_source(infos, [0, 2], 7)
    message = str(err.value)
    assert "\n" not in message
    assert "[0, 2]" in message and "iteration 7" in message and "--load" in message
    # A member at an older iteration does not heal the group either (its shard would not
    # match the other groups').
    infos[0] = (0, True, 6)
    with pytest.raises(ShardLost, match="slot 0: iteration 6, slot 2: none"):
        heal_source(infos, [0, 2], 7)


def test_heal_plan_deals_receivers_round_robin_over_the_current_members() -> None:
    # DP4 in one group: ranks 1 and 3 rejoin; 0 and 2 hold iteration 9.
    infos = [(0, True, 9), (1, False, -1), (2, True, 9), (3, False, -1)]
    assert heal_plan(infos, [0, 1, 2, 3], 9) == {0: [1], 2: [3]}
    # Three receivers, one source: it heals all three; nothing to heal: an empty plan.
    infos = [(0, True, 9), (1, False, -1), (2, True, 8), (3, False, -1)]
    assert heal_plan(infos, [0, 1, 2, 3], 9) == {0: [1, 2, 3]}
    assert heal_plan([(0, True, 9), (1, True, 9)], [0, 1], 9) == {}
    with pytest.raises(ShardLost):
        heal_plan([(0, False, -1), (1, True, 8)], [0, 1], 9)
