"""``benchmarks/goodput.py``: the sample accounting, Young/Daly and the kill schedule (the
``--quick`` smoke run is ``tests/integration/benchmarks/test_goodput_quick.py``)."""

from __future__ import annotations

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import goodput  # noqa: E402


def _rec(step: int, replica: int, committed: bool = True, participating: bool = True) -> dict:
    return {
        "type": "train",
        "step": step,
        "replica": replica,
        "committed": committed,
        "participating": participating,
        "t": float(step),
    }


def test_torchft_accounting_counts_dropped_and_redone_shares() -> None:
    recs = [_rec(0, r) for r in range(4)]
    # Step 1: replica 3 dies in the all-reduce; the attempt fails on the others and they
    # redo it without it; its share is dropped.
    recs += [_rec(1, r, committed=False) for r in range(3)]
    recs += [_rec(1, r) for r in range(3)]
    # Step 2: replica 3's replacement heals (in the quorum, not participating).
    recs += [_rec(2, r) for r in range(3)] + [_rec(2, 3, participating=False)]
    acc = goodput.torchft_accounting(recs, iters=3)
    share = goodput.GBS // 4
    assert acc["committed"] == 3
    assert acc["skipped_samples"] == 2 * share  # replica 3's shares of steps 1 and 2
    assert acc["repeated_samples"] == 3 * share  # the failed attempt of step 1, 3 replicas
    assert acc["redone_iterations"] == 1
    assert acc["participants_histogram"] == {"1": 0, "2": 0, "3": 2, "4": 1}


def test_young_daly_interval() -> None:
    # sqrt(2 * 0.5 s * 60 s) = 7.75 s at 0.2 s per iteration: 39 iterations.
    assert goodput.young_daly(0.5, 60.0, 0.2) == 39
    assert goodput.young_daly(0.0001, 20.0, 10.0) == 1


def test_killer_passes_a_kill_on_to_the_next_live_rank() -> None:
    k = goodput.Killer(t0=0.0, period=1.0, repair=1.0, seed=1)
    drawn = goodput.Killer(0.0, 1.0, 1.0, 1).rng.randrange(4)
    hit = []
    k.fire({(drawn + 1) % 4: 999999999}, lambda slot, t: hit.append(slot))
    assert hit == [(drawn + 1) % 4] and k.events[0]["drawn"] == drawn and k.next_k == 2
