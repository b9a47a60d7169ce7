"""Faults of a vote group's head, injected into a real :class:`~.group_vote.GroupVote`."""

from __future__ import annotations

from typing import Any


def die_after_hot_vote(gv: Any) -> None:
    """Make head ``gv``'s node die between its group's vote on the hot store and telling its
    group: its own GroupStore is closed right after ``_decide_hot`` returns (the hot store
    counted the vote, its members never learn the outcome)."""
    decide = gv._decide_hot

    def decide_then_die(*a: Any, **k: Any) -> str:
        decision = decide(*a, **k)
        gv.own.close()
        return decision

    gv._decide_hot = decide_then_die
