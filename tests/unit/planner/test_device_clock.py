"""``megatron_mecefo.planner.device_clock``: the emulated phase times and the overrun count
(the 4-rank against 3-rank check on the example trainer is
``tests/integration/benchmarks/test_device_clock.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

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
    logs = read_logs([str(tmp_path / "clock.jsonl")])
    assert logs["overrun_fraction"] == 0.5
    assert logs["per_phase"]["backward"]["overruns"] == 1
    assert logs["per_phase"]["forward"] == {"phases": 1, "overruns": 0,
                                            "max_busy_s": line["busy_s"][0]}  # fmt: skip


class _FakeTime:
    """``time`` for the clock: ``perf_counter`` reads a counter that ``sleep`` and ``work``
    advance, so phase ends are exact and no load on the machine moves them."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.now += s

    work = sleep


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> _FakeTime:
    """The device clock's ``time``, replaced by a :class:`_FakeTime`."""
    import megatron_mecefo.planner.device_clock as dc

    t = _FakeTime()
    monkeypatch.setattr(dc, "time", t)
    return t


def test_phases_of_a_step_lie_end_to_end(fake_time: _FakeTime) -> None:
    """In a step, host work between two phases runs in the next phase's time: the backward ends
    one backward time after the forward's end, not after its own start. Host work past a
    phase's end is an overrun and pushes the chain; outside a step a phase is timed from its
    own start (the work before a step's first phase is not absorbed)."""
    t = fake_time
    clock = DeviceClock(SHAPES["llama-1b-h100"])
    f, b, o = (clock.target[k] for k in ("forward", "backward", "optimizer"))
    clock.begin_step()
    t0 = t.now
    t.work(0.01)
    clock.pad("forward", t0)
    assert t.now == pytest.approx(t0 + f)
    t.work(0.05)  # between the phases: the schedule's bookkeeping, a late wake-up
    start = t.now
    t.work(0.02)
    clock.pad("backward", start)
    assert t.now == pytest.approx(t0 + f + b)
    t.work(o + 0.03)  # the gap alone outlasts the optimizer phase: an overrun, no sleep
    start = t.now
    clock.pad("optimizer", start)
    assert t.now == pytest.approx(t0 + f + b + o + 0.03)
    clock.end_step()
    assert [clock.stats[k]["overruns"] for k in ("forward", "backward", "optimizer")] == [0, 0, 1]
    assert clock.stats["optimizer"]["overrun_s"] == pytest.approx(0.03)
    t.work(0.05)  # after the step: not in any phase's time
    start = t.now
    clock.pad("forward", start)
    assert t.now == pytest.approx(start + f)


def test_a_step_cut_short_leaves_no_chain_for_the_next(fake_time: _FakeTime) -> None:
    """A failure aborts a step in its backward; recovery takes seconds; the redone step's
    forward-backward begins a new chain, so its first forward lasts a whole forward time
    (timed from the old chain, it would be late and free), and the optimizer step after the
    loss's all-reduce ends one optimizer time after the last backward."""
    t = fake_time
    clock = DeviceClock(SHAPES["llama-1b-h100"])
    f, b = clock.target["forward"], clock.target["backward"]
    fail = [True]

    def fwd_bwd(*, forward_step_func: Any, num_microbatches: int, **kw: Any) -> None:
        for _ in range(num_microbatches):
            forward_step_func()
            t.work(0.01)  # the backward's CPU work
            if fail[0]:
                raise RuntimeError("a peer died")

    run = clock.wrap_forward_backward(fwd_bwd)
    with pytest.raises(RuntimeError):
        run(forward_step_func=lambda: t.work(0.01), num_microbatches=2)
    t.work(5.0)  # regroup and redo: real time, outside the clock
    fail[0] = False
    t0 = t.now
    run(forward_step_func=lambda: t.work(0.01), num_microbatches=2)
    assert t.now == pytest.approx(t0 + 2 * (f + b))
    t.work(0.03)  # the loss's all-reduce, between the schedule and the optimizer step
    clock.wrap_optimizer_step(lambda: t.work(0.01))()
    assert t.now == pytest.approx(t0 + 2 * (f + b) + clock.target["optimizer"])
    assert sum(s["overruns"] for s in clock.stats.values()) == 0


# The CPU profile's micro-batch costs at the demo widths (results/planner_profile.json): a
# takeover micro-batch is cheaper than an exact one on the CPU, which the clock does not charge.
CPU_COSTS = dict(
    exact_ms=23.28, takeover_ms=15.72, takeover_recompute_ms=20.76, optimizer_ms=5.42,
    sync_ms=6.27, sync_replicas=4, profile_rank=32, takeover_ms_per_rank=0.0738,
    basis_refresh_ms=10.86, regroup_ms=667.0, rejoin_ms=939.0, activation_exact_bytes=7934464,
    activation_takeover_bytes=3410432, activation_takeover_recompute_bytes=393728,
    activation_bytes_per_rank=4096, source="cpu",
)  # fmt: skip


def _auto(profile: Any, budget: float = float("inf")) -> Any:
    """An AutoPolicy at r = 16 (the goodput benchmark's) with ``profile`` and ``budget``."""
    from megatron_mecefo.planner.auto_policy import AutoPolicy
    from megatron_mecefo.planner.recovery_planner import PlannerConfig

    return AutoPolicy(profile, PlannerConfig(rank_min=16, rank_max=16, grad_error_budget=budget))


def test_clock_profile_charges_what_the_clock_pads() -> None:
    """Under the clock a takeover micro-batch costs an exact one, and the profile's failure-free
    step is the clock's emulated step; regroup, rejoin and memory stay measured."""
    from megatron_mecefo.planner.recovery_planner import CostProfile

    clock = DeviceClock(SHAPES["llama-1b-h100"])
    prof = clock.cost_profile(CostProfile(**CPU_COSTS))
    t = clock.target
    assert prof.takeover_ms == prof.takeover_recompute_ms == prof.exact_ms
    assert prof.failure_free_step(4, 2) == pytest.approx(
        1e3 * (2 * (t["forward"] + t["backward"]) + t["optimizer"])
    )
    assert prof.regroup_ms == 667.0 and prof.activation_exact_bytes == 7934464


def test_auto_under_the_clock_ranks_by_the_clocks_costs() -> None:
    """One replica of 4 down, M = 2: on the CPU's costs (takeover cheaper than exact) the
    neighbour running the dead replica's 2 micro-batches as takeover is fastest; on the clock's
    (takeover = exact) spreading them (3 micro-batches on the critical path, not 4) is.
    ``install`` hands the clock's costs to the trainer's auto policy, whose choice follows."""
    from types import SimpleNamespace

    from megatron_mecefo.planner.device_clock import install
    from megatron_mecefo.planner.recovery_planner import CostProfile

    failed = frozenset({1})
    cpu = _auto(CostProfile(**CPU_COSTS))
    cpu.plan(1, failed, 4, 2)
    assert cpu.decision.policy == "neighbor"
    auto = _auto(CostProfile(**CPU_COSTS))
    trainer = SimpleNamespace(
        args=SimpleNamespace(metrics_file=None),
        forward_backward=lambda **kw: None,
        optimizer=SimpleNamespace(step=lambda: None),
        controller=SimpleNamespace(policy=auto),
    )
    install(trainer, "llama-1b-h100", 0)
    assert auto.profile.exact_ms == auto.profile.takeover_ms and auto.rescaled == 1.0
    auto.plan(1, failed, 4, 2)
    assert auto.decision.policy == "spread"
    clock_step = DeviceClock(SHAPES["llama-1b-h100"]).target
    assert auto.decision.step_time_ms == pytest.approx(
        1e3 * (3 * (clock_step["forward"] + clock_step["backward"]) + clock_step["optimizer"])
    )


def test_gradient_error_budget_still_rules_over_the_clock_costs() -> None:
    """At the default budget (0.3) spread's predicted gradient error at r = 16 (0.38) is over
    it, so auto takes exact on either costs: the budget, not the costs, decides there."""
    from megatron_mecefo.planner.config import DEFAULT_GRAD_ERROR_BUDGET
    from megatron_mecefo.planner.recovery_planner import CostProfile

    clock = DeviceClock(SHAPES["llama-1b-h100"])
    for prof in (CostProfile(**CPU_COSTS), clock.cost_profile(CostProfile(**CPU_COSTS))):
        auto = _auto(prof, DEFAULT_GRAD_ERROR_BUDGET)
        auto.plan(1, frozenset({1}), 4, 2)
        assert auto.decision.policy == "exact"
