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


def _run(system: str, ff: bool, rate: float, loss: float, rnd: int = 0) -> dict:
    return {"system": system, "failure_free": ff, "setting": "T20_R5", "round": rnd,
            "samples_per_s": rate, "eval": {"loss": loss}, "kills": []}  # fmt: skip


def test_ettr_is_samples_per_second_over_the_systems_own_failure_free_run() -> None:
    """Each system against its own failure-free run of the same round, never another's."""
    runs = [
        _run("torchft", True, 10.0, 3.0),
        _run("torchft", False, 7.5, 3.2),
        _run("mecefo-auto", True, 8.0, 2.9),
        _run("mecefo-auto", False, 8.0, 2.95),
        _run("mecefo-auto", False, None, 2.95, rnd=1),  # no own reference: no ETTR
    ]
    goodput._post(runs)
    assert runs[1]["ettr"] == 0.75 and runs[1]["val_loss_minus_own_failure_free"] == 0.2
    assert runs[3]["ettr"] == 1.0 and runs[3]["val_loss_minus_own_failure_free"] == 0.05
    assert runs[4]["ettr"] is None and runs[0]["ettr"] == 1.0


def test_interval_is_the_95_percent_t_half_width() -> None:
    ci = goodput.interval([0.9, 1.0, 1.1])  # sd 0.1, t(2) = 4.303
    assert ci["mean"] == 1.0 and ci["ci95"] == round(4.303 * 0.1 / 3**0.5, 4)
    assert goodput.interval([0.5])["ci95"] is None


def test_watch_times_each_step_and_the_killer_starts_at_step_one(tmp_path) -> None:
    """The kill schedule counts from the first training record, not from the launch."""
    metrics = tmp_path / "m.jsonl"
    watch = goodput.Watch(lambda: [metrics], goodput._example_key)
    killer = goodput.Killer(None, 5.0, 1.0, 1)
    metrics.write_text('{"type": "start"}\n')
    watch.poll()
    watch.start_killer(killer)
    assert killer.t0 is None and not killer.due()
    with open(metrics, "a") as f:
        f.write('{"type": "train", "iteration": 1}\n{"type": "train", "iteration": 2')
    watch.poll()  # the torn second line is read once it is complete
    watch.start_killer(killer)
    assert killer.t0 == watch.first[1] and set(watch.first) == {1}
    with open(metrics, "a") as f:
        f.write("}\n")
    watch.poll()
    assert set(watch.first) == {1, 2} and watch.last[2] >= watch.first[1]
