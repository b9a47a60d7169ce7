"""``megatron_mecefo.planner.device_clock``: the emulated phase times and the overrun count
(the 4-rank against 3-rank check on the example trainer is
``tests/integration/benchmarks/test_device_clock.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from megatron_mecefo.planner.device_clock import SHAPES, DeviceClock, DeviceShape, read_logs


def test_llama_1b_h100_phase_times_follow_the_flop_model() -> None:
    """6 N T at 40% of 989 TFLOP/s: 0.666 s per micro-batch, a third of it forward; the
    optimizer phase is the Adam stream plus the ring all-reduce at 4 replicas."""
    clock = DeviceClock(SHAPES["llama-1b-h100"])
    t = clock.target
    per_mb = 6 * 1.34e9 * 16 * 2048 / (989e12 * 0.4)
    assert t["forward"] == pytest.approx(per_mb / 3)
    assert t["backward"] == pytest.approx(2 * per_mb / 3)
    sync = 2 * 1.34e9 * 2 * 0.75 / 50e9
    assert t["optimizer"] == pytest.approx(36 * 1.34e9 / 3.35e12 + sync)
    assert 1.4 < 2 * (t["forward"] + t["backward"]) + t["optimizer"] < 1.45


def test_pad_sleeps_out_the_phase_and_counts_an_overrun(tmp_path: Path) -> None:
    """A phase with no work lasts at least its target and is no overrun; one whose work takes
    longer than the target is an overrun, and the step's log line says so."""
    shape = DeviceShape("tiny", 2.5e7, 1, 1e9, 1.0, 1e12, 1e12, 4, "test")
    clock = DeviceClock(shape, str(tmp_path / "clock.jsonl"))
    target = clock.target["forward"]  # 50 ms: a preemption between two lines is shorter
    start = time.perf_counter()
    clock.pad("forward", start)
    assert time.perf_counter() - start >= target
    start = time.perf_counter()
    time.sleep(3 * target)  # the CPU work overruns the emulated phase
    clock.pad("backward", start)
    clock.end_step()
    assert clock.stats["forward"]["n"] == 1 and clock.stats["forward"]["overruns"] == 0
    assert clock.stats["backward"]["overruns"] == 1
    line = json.loads((tmp_path / "clock.jsonl").read_text())
    assert line["phases"] == 2 and line["overruns"] == 1
    assert read_logs([str(tmp_path / "clock.jsonl")])["overrun_fraction"] == 0.5
