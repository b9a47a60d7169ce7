"""Recovery records' phases (``recovery/records.py``): detect, regroup and redo are measured
from the kill (unknown: its first report), are never negative and sum to the total, whatever
order the processes' timestamps come in."""

from __future__ import annotations

import random
from typing import Any, Dict

import pytest

from megatron_mecefo.recovery.membership import Generation
from megatron_mecefo.recovery.records import build_record

PARTS = ("detect_s", "regroup_s", "redo_s")


def _record(times: Dict[int, Dict[str, float]], kills: Dict[int, float], reap: float = 0.0) -> Any:
    gen = Generation(number=2, replicas=(0,), members={0: 0, 1: 0}, lost=(2,))
    deaths = {2: {"exit_code": -9, "t": reap}} if reap else {}
    return build_record(gen, times, kills, deaths, 5, redone=True, global_batch_size=8)


def _check_parts(rec: Dict[str, Any]) -> None:
    assert all(rec[p] is not None and rec[p] >= 0.0 for p in PARTS), rec
    assert rec["total_s"] >= 0.0
    assert sum(rec[p] for p in PARTS) == pytest.approx(rec["total_s"], abs=1e-9), rec


def test_ordered_times_give_the_plain_differences() -> None:
    times = {0: {"detect": 101.0, "built": 104.0, "done": 105.5},
             1: {"detect": 101.5, "built": 104.5, "done": 106.0}}  # fmt: skip
    rec = _record(times, {2: 100.0}, reap=100.2)
    assert (rec["detect_s"], rec["regroup_s"], rec["redo_s"]) == (1.5, 3.0, 1.5)
    assert rec["total_s"] == 6.0 and rec["kill_time_known"]
    assert rec["reap_s"] == pytest.approx(0.2)
    _check_parts(rec)


def test_a_kill_time_later_than_the_detection_counts_no_negative_phase() -> None:
    # The kill time was stamped on another clock, 7 s ahead of the survivors'.
    times = {0: {"detect": 101.0, "built": 104.0, "done": 106.0},
             1: {"detect": 101.5, "built": 104.5, "done": 106.5}}  # fmt: skip
    rec = _record(times, {2: 108.6})
    _check_parts(rec)
    assert rec["detect_s"] == rec["regroup_s"] == rec["redo_s"] == rec["total_s"] == 0.0
    assert rec["kill_after_first_report_s"] == pytest.approx(7.6)
    # 2 s ahead: the detection counts at the kill, the rest as measured.
    rec = _record(times, {2: 103.0})
    _check_parts(rec)
    assert (rec["detect_s"], rec["regroup_s"], rec["redo_s"]) == (0.0, 1.5, 2.0)
    assert rec["total_s"] == 3.5


def test_an_unknown_kill_is_timed_from_its_first_report() -> None:
    # The survivors noticed before the supervisor reaped the process.
    times = {0: {"detect": 102.0, "built": 104.0, "done": 105.0},
             1: {"detect": 103.0, "built": 104.5, "done": 106.0}}  # fmt: skip
    rec = _record(times, {}, reap=104.0)
    assert not rec["kill_time_known"]
    _check_parts(rec)
    assert (rec["detect_s"], rec["regroup_s"], rec["redo_s"]) == (1.0, 1.5, 1.5)
    assert rec["total_s"] == 4.0 and rec["reap_s"] == 2.0
    # No reap either: from the first detection.
    rec = _record(times, {})
    _check_parts(rec)
    assert rec["detect_s"] == 1.0 and rec["total_s"] == 4.0


def test_parts_never_negative_and_sum_to_the_total_in_any_order() -> None:
    rng = random.Random(7)
    for _ in range(500):
        times = {
            s: {k: 100.0 + rng.uniform(0.0, 10.0) for k in ("detect", "built", "done")}
            for s in (0, 1)
        }
        kills = {2: 100.0 + rng.uniform(-2.0, 12.0)} if rng.random() < 0.7 else {}
        rec = _record(times, kills, reap=100.0 + rng.uniform(0.0, 10.0))
        _check_parts(rec)
        assert rec.get("reap_s", 0.0) >= 0.0


def test_a_missing_time_leaves_the_later_phases_unknown() -> None:
    times = {0: {"detect": 101.0}, 1: {"detect": 102.0}}
    rec = _record(times, {2: 100.0})
    assert rec["detect_s"] == 2.0
    assert rec["regroup_s"] is None and rec["redo_s"] is None and rec["total_s"] is None


def test_a_late_record_times_the_death_its_generation_lost(store: str) -> None:
    """Slot 2 died (incarnation 0) into generation 1, whose record is written only after its
    replacement (incarnation 1) died too: the record is timed from incarnation 0's kill, not
    from the slot's last one (which came after the detection: a negative detect before)."""
    from types import SimpleNamespace

    from megatron_mecefo.recovery.membership import MembershipStore
    from megatron_mecefo.recovery.reporting import emit_record

    ms = MembershipStore.connect(store)
    members = {0: 0, 1: 0, 2: 0}
    ms.publish(Generation(number=0, replicas=(0, 1, 2), members=members))
    gen1 = Generation(number=1, replicas=(0, 1), members={0: 0, 1: 0}, lost=(2,))
    ms.publish(gen1)
    ms.set_json("inc/2", 1)
    for inc, t in ((0, 100.0), (1, 200.0)):
        ms.set_json(f"killed/2/{inc}", {"t": t, "spec": "2:3:backward"})
        ms.report_dead(2, inc, {"exit_code": -9, "t": t + 0.5})
    emitted: list = []
    session = SimpleNamespace(
        ms=ms, args=SimpleNamespace(global_batch_size=8), cfg=SimpleNamespace(records_file=None),
        takeover_info=None,
    )  # fmt: skip
    trainer = SimpleNamespace(iteration=3, emit=emitted.append)
    times = {s: {"detect": 101.0, "built": 104.0, "done": 105.0} for s in (0, 1)}
    emit_record(session, trainer, gen1, times)
    (rec,) = emitted
    assert rec["kill_time_known"] and rec["reap_s"] == 0.5
    assert (rec["detect_s"], rec["regroup_s"], rec["redo_s"], rec["total_s"]) == (1, 3, 1, 5)
