"""``benchmarks/heap_after_recovery.py``'s pure parts: the phases of a kill/rejoin schedule,
the per-process medians and ratios from trace lines, the per-cycle summary, and the trace
parser's allocator fields."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

import heap_after_recovery as har  # noqa: E402
from recovery_scale_gpu import parse_mem  # noqa: E402

MIB = 1 << 20


def test_phases_leave_out_the_degraded_iterations_and_the_first_after_a_heal() -> None:
    assert har.phases([8, 20, 32], [10, 22, 34], 44) == {
        "steady": (2, 7),
        "after 1": (12, 19),
        "after 2": (24, 31),
        "after 3": (36, 44),
    }
    # A rejoin too late for two iterations before the next kill: no after phase for it.
    assert har.phases([8, 12], [11, 14], 20) == {"steady": (2, 7), "after 2": (16, 20)}


def _line(slot: int, inc: int, it: int, rss: int, live: int, free: int) -> Dict[str, Any]:
    return {"slot": slot, "inc": inc, "point": "iteration", "iteration": it, "kind": "rss",
            "peak": rss * MIB, "now": rss * MIB, "heap_in_use": (live - 100) * MIB,
            "mmapped": 100 * MIB, "heap_free": free * MIB}  # fmt: skip


def _trace() -> List[Dict[str, Any]]:
    """Slot 0 survives a kill at 8 (rejoin at 10): its RSS grows by its free heap, its live
    memory does not. Slot 1 is killed; its second incarnation joins. The degraded iterations
    (8-11) carry values that must not count."""
    out = []
    for it in range(1, 21):
        if it < 8:
            out.append(_line(0, 0, it, 900, 600, 40))
            out.append(_line(1, 0, it, 1000, 600, 40))
        elif it < 12:
            out.append(_line(0, 0, it, 5000, 5000, 40))
        else:
            out.append(_line(0, 0, it, 990, 603, 130))
            out.append(_line(1, 1, it, 1010, 600, 50))
    return out


def test_slot_phases_and_summary_separate_free_heap_from_live_memory() -> None:
    trace = _trace()
    rows = har.slot_phases(trace, har.phases([8], [10], 20))
    assert all("live" not in m for m in trace)  # the parsed trace is left as it was
    survivor = rows["0.0"]["after 1"]
    assert survivor["iterations"] == [12, 20] and survivor["points"] == 9
    assert survivor["peak_over_steady"] == round(990 / 900, 4)
    assert survivor["live_over_steady"] == round(603 / 600, 4)
    assert survivor["heap_free_growth_mib"] == 90.0
    # The joiner against its slot's first incarnation.
    joiner = rows["1.1"]["after 1"]
    assert joiner["peak_over_steady"] == round(1010 / 1000, 4)
    assert joiner["heap_free_growth_mib"] == 10.0
    summary = har.summarize(rows)
    # Cycles in their order, past nine too.
    many = {"0.0": {f"after {j}": {"peak_over_steady": 1.0} for j in (10, 2, 1)}}
    assert list(har.summarize(many)) == ["after 1", "after 2", "after 10"]
    assert summary["after 1"]["survivors"]["live_over_steady"] == round(603 / 600, 4)
    assert summary["after 1"]["survivors"]["heap_free_growth_mib"] == 90.0
    assert summary["after 1"]["joiners"]["peak_over_steady"] == round(1010 / 1000, 4)


def test_parse_mem_keeps_the_allocator_fields_and_reads_lines_without_them() -> None:
    log = (
        "noise\n[mecefo-mem] slot=2 inc=0 point=iteration iteration=5 kind=rss peak=10 now=9 "
        "heap_in_use=7 heap_free=2 mmapped=1\n"
        "[mecefo-mem] slot=0 inc=1 point=built iteration=-1 kind=cuda peak=4 now=3\n"
    )
    rows = parse_mem(log)
    assert rows[0]["heap_in_use"] == 7 and rows[0]["heap_free"] == 2 and rows[0]["mmapped"] == 1
    assert rows[1] == {"slot": 0, "inc": 1, "point": "built", "iteration": -1, "kind": "cuda",
                       "peak": 4, "now": 3}  # fmt: skip


def test_the_control_is_read_over_the_failure_runs_phases_and_quoted_beside_it() -> None:
    """A run with no kill, taken over the failure run's phases: its slot 1 is the first
    incarnation all along (no joiner), and the summary line quotes its survivors' peak."""
    control = [
        _line(slot, 0, it, 900 + (30 if slot == 0 and it >= 12 else 0), 600, 40)
        for it in range(1, 21)
        for slot in (0, 1)
    ]
    ranges = har.phases([8], [10], 20)
    rows = har.slot_phases(control, ranges)
    assert set(rows) == {"0.0", "1.0"}
    assert rows["0.0"]["after 1"]["peak_over_steady"] == round(930 / 900, 4)
    assert rows["1.0"]["after 1"]["peak_over_steady"] == 1.0
    ctl = har.summarize(rows)
    assert ctl["after 1"]["survivors"]["peak_over_steady"] == round(930 / 900, 4)
    assert ctl["after 1"]["joiners"]["peak_over_steady"] == 1.0  # slot 1, never killed
    a = type("A", (), {"dp": 2, "size": "0.4", "kills": [8]})()
    failure = har.summarize(har.slot_phases(_trace(), ranges))
    line = har.summary_line(a, failure, ctl)
    assert f"after 1: peak RSS x{round(990 / 900, 4)} (no failure x{round(930 / 900, 4)})" in line
    assert "no failure" not in har.summary_line(a, failure)
