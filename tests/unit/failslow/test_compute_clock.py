"""The compute clock (failslow/compute_clock.py): host time on a CPU, device time on CUDA."""

from __future__ import annotations

import time
from typing import Iterator

import pytest
import torch

from megatron_mecefo.failslow import compute_clock
from megatron_mecefo.failslow.compute_clock import ComputeClock


def test_cpu_clock_gives_the_span_once_with_its_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks: Iterator[float] = iter([10.0, 10.5, 99.0])
    monkeypatch.setattr(compute_clock.time, "perf_counter", lambda: next(ticks))
    clock = ComputeClock(use_cuda=False)
    assert clock.take() is None
    clock.start(tag=3)
    clock.stop()
    clock.stop()  # the finalize and the end of the call both stop: the first counts
    assert clock.take() == (0.5, 3)
    assert clock.take() is None  # taken once


def test_cpu_clock_is_chosen_without_cuda() -> None:
    clock = ComputeClock()
    clock.start(tag=1)
    clock.stop()
    expected = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert clock.use_cuda is expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_clock_sees_the_device_time_one_step_late() -> None:
    torch.cuda.init()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    clock = ComputeClock()

    def step(tag: int, matmuls: int) -> float:
        clock.start(tag=tag)
        t0 = time.perf_counter()
        for _ in range(matmuls):
            a @ a
        clock.stop()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        return host

    step(0, 10)  # warm-up (cuBLAS handles)
    assert clock.use_cuda
    assert clock.take() is None  # the current step is never read: its events are queued
    host = step(1, 400)
    assert clock.take()[1] == 0  # step 0's, read when step 1 began
    step(2, 10)
    seconds, tag = clock.take()
    assert tag == 1
    # 400 products of 4096^3 x 2 FLOP: 55 TFLOP, >= 50 ms on any GPU of today; the host only
    # queued them (the queue time is what a host clock would have reported).
    assert seconds > 0.05
    assert seconds > 5 * host, (seconds, host)
