"""``benchmarks/goodput.py``: the sample accounting, Young/Daly, the kill schedule, the common
reference and the checks, and the headline numbers recomputed from ``results/goodput.json``'s
raw runs (the ``--quick`` smoke run is ``tests/integration/benchmarks/test_goodput_quick.py``)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
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
            "samples_per_s": rate, "eval": {"loss": loss}, "kills": [], "window_s": 30.0,
            "committed": 24, "samples_trained": 384, "skipped_samples": 0,
            "repeated_samples": 0, "loadavg_start_end": [[1.0], [1.0]]}  # fmt: skip


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


def test_kills_by_step_fire_at_the_same_steps_whatever_the_time() -> None:
    """S4 over 12 steps: kills at steps 4 and 8, each once, none at step 12 (the last), and
    the step, not the clock, decides: the same two kills for a fast and a slow system."""
    k = goodput.Killer(t0=0.0, period=1.0, repair=1.0, seed=3, every=4, iters=12)
    hits = []
    for step in [1, 2, 3, 4, 4, 5, 7, 9, 12, 12]:
        if k.due(step):
            k.fire({s: 999999999 for s in range(4)}, lambda slot, t: hits.append(slot), step)
    assert [e["at_step"] for e in k.events] == [4, 8]
    assert [e["seen_step"] for e in k.events] == [4, 9]
    slow = goodput.Killer(t0=0.0, period=1.0, repair=1.0, seed=3, every=4, iters=12)
    for step in range(1, 13):
        if slow.due(step):
            slow.fire({s: 999999999 for s in range(4)}, lambda slot, t: None, step)
    assert [e["slot"] for e in slow.events] == [e["slot"] for e in k.events] == hits
    ff = goodput.Killer(t0=0.0, period=math.inf, repair=1.0, seed=3, every=4, iters=12)
    assert not ff.due(8)


def test_parse_setting_names_the_flag_and_the_fix() -> None:
    assert goodput.parse_setting("S8_R5") == (1.0, 5.0, 8)
    assert goodput.parse_setting("T15_R5") == (15.0, 5.0, None)
    with pytest.raises(SystemExit, match="--settings 'S2.5_R5'.*S8_R5"):
        goodput.parse_setting("S2.5_R5")


def test_only_the_kills_inside_the_window_count() -> None:
    run = {"window_s": 30.0, "kills": [{"slot": 1, "t": 5.0}, {"slot": None, "t": 9.0},
                                       {"slot": 2, "t": 31.0}, {"slot": 0, "t": 29.9}]}  # fmt: skip
    assert goodput.kills_in_window(run) == 2
    assert goodput.kills_in_window({"window_s": None, "kills": run["kills"]}) == 0


def test_common_reference_divides_every_system_by_stock_dp4() -> None:
    """common_ratio: samples/s over the reference run of the same round; ETTR stays over the
    system's own failure-free run."""
    runs = [
        _run(goodput.REFERENCE, True, 10.0, 3.0),
        _run("torchft", True, 8.0, 3.0),
        _run("torchft", False, 7.5, 3.2),
        _run("mecefo-spread", True, 10.0, 3.0),
        _run("mecefo-spread", False, 8.0, 3.0),
        _run("mecefo-spread", False, 8.0, 3.0, rnd=1),  # no reference in round 1
    ]
    goodput._post(runs)
    assert runs[2]["common_ratio"] == 0.75 and runs[2]["ettr"] == 0.9375
    assert runs[1]["common_ratio"] == 0.8 and runs[0]["common_ratio"] == 1.0
    assert runs[4]["common_ratio"] == 0.8 and runs[4]["ettr"] == 0.8
    assert runs[5]["common_ratio"] is None
    table = goodput.summarize(runs, ["megatron-core-dp4", "torchft", "mecefo-spread"], 24, 1.4)
    row = table["T20_R5"]["torchft"]
    assert row["common_per_round"] == [0.75] and row["ff_over_common_reference"] == [0.8]
    assert table["T20_R5"][goodput.REFERENCE]["samples_per_s_mean"] == 10.0


def test_torchft_full_replicas_is_every_rank_step_and_every_evaluation() -> None:
    recs = [_rec(s, r) for s in range(3) for r in range(4)]
    recs += [{"type": "eval", "replica": r, "step": 3, "loss": 3.0, "t": 9.0} for r in range(4)]
    acc = goodput.torchft_accounting(recs, iters=3)
    assert (acc["rank_steps"], acc["eval_replicas"]) == (12, 4)
    assert goodput.full_replicas(acc)
    short = [r for r in recs if not (r.get("step") == 1 and r["replica"] == 3)]
    short = [r for r in short if not (r["type"] == "eval" and r["replica"] == 2)]
    acc = goodput.torchft_accounting(short, iters=3)
    assert (acc["rank_steps"], acc["eval_replicas"]) == (11, 3)
    assert not goodput.full_replicas(acc)
    run = {"system": "torchft", "failure_free": True, "setting": "S8_R5", "round": 0, **acc}
    assert goodput.checks([run], 3)["torchft_failure_free_short"][0]["rank_steps"] == 11


def test_checks_flag_unequal_kill_counts_in_a_round() -> None:
    """Among the runs that trained every step the kills must be equal; a run stopped before
    the end is listed, not counted against the others; a kill after the window is flagged."""

    def run(system: str, n: int, committed: int = 24) -> dict:
        kills = [{"slot": 0, "t": 1.0 + i} for i in range(n)]
        return {"system": system, "failure_free": False, "setting": "S8_R5", "round": 0,
                "kills_in_window": n, "committed": committed, "kills": kills}  # fmt: skip

    runs = [run("torchft", 2), run("mecefo-spread", 2), run("mecefo-auto", 3)]
    assert not goodput.checks(runs, 24)["kills_in_window"]["S8_R5"]["equal"]
    runs[2] = run("checkpoint-restart", 1, committed=10)
    got = goodput.checks(runs, 24)["kills_in_window"]["S8_R5"]
    assert got["equal"] and got["unfinished"][0]["system"] == "checkpoint-restart"
    runs[0]["kills"].append({"slot": 1, "t": 99.0})  # hit a process after the window
    assert goodput.checks(runs, 24)["kills_in_window"]["S8_R5"]["outside"] == [
        {"round": 0, "system": "torchft"}
    ]


def _goodput_json() -> dict:
    """``results/goodput.json`` (``GOODPUT_JSON``: another file, e.g. a smoke run's)."""
    path = Path(os.environ.get("GOODPUT_JSON", REPO / "results" / "goodput.json"))
    if not path.exists():
        pytest.skip(f"{path} does not exist: run make bench-goodput")
    res = json.loads(path.read_text())
    if "checks" not in res or not any(r["system"] == goodput.REFERENCE for r in res["runs"]):
        pytest.skip(
            f"{path} has the old schema (no common reference run, no checks): rerun "
            "make bench-goodput to regenerate it"
        )
    return res


def test_headline_numbers_recompute_from_the_raw_runs() -> None:
    """From results/goodput.json's raw runs alone: the common-reference column (samples/s over
    stock DP4's of the same round), the ETTR column (over the system's own failure-free run),
    the kills inside each window (equal for every system in a round), and torchft's
    failure-free runs at 4 of 4 replicas; each against the file's table."""
    res = _goodput_json()
    runs = res["runs"]
    iters = res["config"]["global_batches"]
    key = {(r["setting"], r["round"], r["system"], r["failure_free"]): r for r in runs}
    for setting, rows in res["table"].items():
        kills: dict = {}
        for system, row in rows.items():
            if row.get("reference"):
                continue
            fails = sorted(
                (r for r in runs if r["setting"] == setting and r["system"] == system
                 and not r["failure_free"]), key=lambda r: r["round"])  # fmt: skip
            common, ettr = [], []
            for r in fails:
                ref = key.get((setting, r["round"], goodput.REFERENCE, True))
                own = key.get((setting, r["round"], system, True))
                rate = r["samples_per_s"] or 0.0
                if ref and ref["samples_per_s"]:
                    common.append(round(rate / ref["samples_per_s"], 4))
                if own and own["samples_per_s"]:
                    ettr.append(round(rate / own["samples_per_s"], 4))
                w = r["window_s"]
                n = sum(1 for e in r["kills"] if e.get("slot") is not None and w is not None
                        and e.get("t") is not None and 0 <= e["t"] <= w)  # fmt: skip
                assert n == r["kills_in_window"], (setting, system, r["round"])
                if r["committed"] >= iters:  # a run stopped early took only what it reached
                    kills.setdefault(r["round"], set()).add(n)
            assert common == row["common_per_round"], (setting, system)
            assert ettr == row["ettr_per_round"], (setting, system)
            if common:
                assert abs(sum(common) / len(common) - row["common_mean"]) < 1e-4
            if ettr:
                assert abs(sum(ettr) / len(ettr) - row["ettr_mean"]) < 1e-4
        unequal = {rnd: n for rnd, n in kills.items() if len(n) > 1}
        assert not unequal, f"{setting}: kills in window differ between systems: {unequal}"
    for r in runs:
        if r["system"] == "torchft" and r["failure_free"]:
            assert r["rank_steps"] == 4 * iters and r["eval_replicas"] == 4, r["round"]
