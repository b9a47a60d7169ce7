"""A device clock for CPU benchmarks: each phase of a step lasts what a named GPU shape takes.

On the shared CPU machine a run with one rank down does less CPU work in total and steps
faster, so a degraded run could look better than a failure-free one. Under the device clock
each rank's forward (per micro-batch), backward (per micro-batch) and optimizer phase (the
gradient sync left after the last backward plus the optimizer step) lasts the time that
:class:`~megatron_mecefo.planner.step_cost_model.StepCostModel` gives for a named GPU shape:
the rank does its CPU work, then sleeps out the rest. Within a step the phases lie end to end
on the emulated device: a phase ends its emulated time after the previous one ended, so the
host's work between phases (the loss all-reduce, the bookkeeping before the optimizer, a late
wake-up) runs in the next phase's time, as a GPU's host runs ahead of its queued kernels. The
step time then depends on the emulated device, not on how many ranks share the cores, as long
as the CPU work fits; every phase records whether the host reached its end late (an overrun).
The work before a step's first phase and after its last stays outside, and so do recovery
costs (detection, regroup, heal, restart): a failure aborts the step, and the redone step
begins a new chain. Figures made this way are *emulated*.

Shapes (``SHAPES``): FLOPs ``6 N T`` per micro-batch (forward ``2 N T``, backward ``4 N T``;
the attention score term is left out) at a stated MFU of the GPU's dense BF16 peak; the
optimizer phase is an fp32 Adam step that streams ``36`` bytes per parameter through HBM plus a
ring all-reduce of BF16 gradients that is not overlapped with the backward. A takeover
micro-batch is charged as an exact one (measured ``c`` = 0.96 at llama-1b widths on an H200,
``results/takeover_cost_llama-1b_h200.json``: within 4%).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from megatron_mecefo.planner.step_cost_model import StepCostModel

if TYPE_CHECKING:
    from megatron_mecefo.planner.recovery_planner import CostProfile


@dataclass(frozen=True)
class DeviceShape:
    """A model on a GPU, at a stated efficiency.

    Attributes:
        name: The shape's name (``--device-clock NAME``).
        params: Model parameters N.
        tokens_per_microbatch: Micro-batch size x sequence length, T.
        peak_flops: The GPU's dense BF16 peak, FLOP/s.
        mfu: Model FLOPs utilisation assumed for forward and backward.
        hbm_bytes_per_s: HBM bandwidth (the optimizer step is memory bound).
        link_bytes_per_s: Per-GPU data-parallel bandwidth of the gradient all-reduce.
        replicas: Data-parallel replicas the sync time is stated at.
        note: What the numbers are.
    """

    name: str
    params: float
    tokens_per_microbatch: int
    peak_flops: float
    mfu: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    replicas: int
    note: str

    def cost_model(self) -> StepCostModel:
        """The step-cost model of this shape, in seconds."""
        exact = 6 * self.params * self.tokens_per_microbatch / (self.peak_flops * self.mfu)
        optimizer = 36 * self.params / self.hbm_bytes_per_s
        m = self.replicas
        sync = 2 * self.params * 2 * (m - 1) / m / self.link_bytes_per_s
        return StepCostModel(exact, exact, optimizer, sync, m)


# Llama-1B at GaLore's llama_1b widths (hidden 2048, FFN 5461, 24 layers, vocab 32000: 1.34 B
# parameters), micro-batch 16 x 2048 tokens, H100 SXM (989 TFLOP/s dense BF16, 3.35 TB/s HBM3),
# 400 Gb/s per GPU for the data-parallel ring; MFU 40%. One step of 2 micro-batches: ~1.43 s.
SHAPES: Dict[str, DeviceShape] = {
    "llama-1b-h100": DeviceShape(
        "llama-1b-h100", 1.34e9, 16 * 2048, 989e12, 0.40, 3.35e12, 50e9, 4,
        "Llama-1B (GaLore llama_1b widths, 1.34 B params), micro-batch 16 x 2048 tokens, one "
        "H100 SXM per replica at 40% MFU, 400 Gb/s data-parallel links",
    ),  # fmt: skip
    "llama-1b-h100-short": DeviceShape(
        "llama-1b-h100-short", 1.34e9, 8 * 2048, 989e12, 0.40, 3.35e12, 50e9, 4,
        "as llama-1b-h100 at micro-batch 8 x 2048 tokens (half the step)",
    ),  # fmt: skip
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--device-clock SHAPE``."""
    p.add_argument_group("device clock (CPU benchmarks)").add_argument(
        "--device-clock",
        default=None,
        choices=sorted(SHAPES),
        help="Emulate a GPU's step time: forward, backward and optimizer phases last what "
        "the step-cost model gives for SHAPE (megatron_mecefo/planner/device_clock.py); the "
        "rank sleeps out the rest of each phase after its CPU work. Figures are emulated.",
    )


class DeviceClock:
    """Pads each phase to its emulated time and counts the phases the host ended late (overruns).

    Between :meth:`begin_step` and :meth:`end_step` the phases are chained: each one ends its
    emulated time after the previous one's end (or when the host reaches its end, if later).
    Outside a step each phase is timed from its own start.

    Args:
        shape: The emulated shape.
        log_path: JSON lines, one per optimizer step (this rank's phases), or None.
    """

    def __init__(self, shape: DeviceShape, log_path: Optional[str] = None) -> None:
        self.shape = shape
        model = shape.cost_model()
        self.target = {
            "forward": model.exact / 3,
            "backward": model.exact * 2 / 3,
            "optimizer": model.optimizer + model.sync_time(shape.replicas),
        }
        self.stats = {
            p: {"n": 0, "overruns": 0, "overrun_s": 0.0, "cpu_s": 0.0} for p in self.target
        }
        self._open: Optional[tuple] = None  # (phase, start) of a phase that ends later
        self._in_step = False
        # Where the step's previous phase ended on the emulated device (None: no phase yet).
        self._device_end: Optional[float] = None
        self._step: List[Dict[str, float]] = []
        self._log = open(log_path, "a", buffering=1) if log_path else None

    def begin_step(self) -> None:
        """Start chaining phases: the next one is timed from its own start, later ones from
        the end of the one before."""
        self._in_step = True
        self._device_end = None

    def pad(self, phase: str, start: float) -> None:
        """End ``phase`` whose CPU work began at ``start``: sleep until its emulated end (in a
        step, the previous phase's end plus this phase's time; else ``start`` plus it)."""
        now = time.perf_counter()
        busy = now - start
        target = self.target[phase]
        chained = self._in_step and self._device_end is not None
        end = (self._device_end if chained else start) + target
        late = now - end
        s = self.stats[phase]
        s["n"] += 1
        s["cpu_s"] += busy
        if late > 0:
            s["overruns"] += 1
            s["overrun_s"] += late
        else:
            time.sleep(-late)
        # The device cannot end the phase before the host has issued all of its work.
        self._device_end = max(end, now)
        self._step.append({"phase": phase, "busy_s": round(busy, 4), "over": late > 0})

    def _close_open(self) -> None:
        if self._open is not None:
            phase, start = self._open
            self._open = None
            self.pad(phase, start)

    def wrap_forward_backward(self, fwd_bwd: Callable[..., Any]) -> Callable[..., Any]:
        """A forward-backward function whose training micro-batches run on the clock: each
        forward (the forward step) and each backward (until the next forward, or the end of the
        schedule with the gradient sync) lasts its emulated time."""

        @functools.wraps(fwd_bwd)
        def run(*, forward_step_func: Callable[..., Any], **kw: Any) -> Any:
            if kw.get("forward_only", False):  # evaluation is not part of the step time
                return fwd_bwd(forward_step_func=forward_step_func, **kw)
            self.begin_step()  # also drops the chain of a step that a failure cut short

            @functools.wraps(forward_step_func)
            def forward_step(*a: Any, **k: Any) -> Any:
                self._close_open()  # the previous micro-batch's backward
                start = time.perf_counter()
                out = forward_step_func(*a, **k)
                self.pad("forward", start)
                self._open = ("backward", time.perf_counter())
                return out

            try:
                return fwd_bwd(forward_step_func=forward_step, **kw)
            finally:
                self._close_open()

        return run

    def wrap_optimizer_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """An optimizer step that lasts the emulated optimizer phase, then logs the step."""

        @functools.wraps(step)
        def run(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            out = step(*a, **k)
            self.pad("optimizer", start)
            self.end_step()
            return out

        return run

    def end_step(self) -> None:
        """End the step's chain; one log line with its phases."""
        self._in_step = False
        self._device_end = None
        if self._log is not None and self._step:
            over = sum(1 for p in self._step if p["over"])
            busy = [p["busy_s"] for p in self._step]
            rec = {
                "t": time.time(),
                "phases": len(self._step),
                "overruns": over,
                "busy_s": busy,
                "names": [p["phase"] for p in self._step],
                "over": [p["over"] for p in self._step],
            }
            self._log.write(json.dumps(rec) + "\n")
        self._step = []

    def summary(self) -> Dict[str, Any]:
        """The shape, the emulated phase times and the overrun counts."""
        return {
            "shape": asdict(self.shape),
            "target_s": self.target,
            "stats": self.stats,
            "emulated": True,
        }

    def step_s(self, microbatches: int) -> float:
        """The emulated failure-free step: ``microbatches`` x (forward + backward) + optimizer."""
        t = self.target
        return microbatches * (t["forward"] + t["backward"]) + t["optimizer"]

    def cost_profile(self, base: CostProfile) -> CostProfile:
        """The costs this clock charges, as the planner's profile: what ``auto`` ranks by under
        the clock (the costs a GPU would have, not the CPU's).

        An exact and a takeover micro-batch both last forward + backward (the clock charges a
        takeover micro-batch as an exact one); the basis refresh and the low-rank term run
        inside a padded phase, so they add nothing; the optimizer phase holds the step and the
        sync. Regroup, rejoin and activation memory are real, so they stay ``base``'s.
        """
        from dataclasses import replace

        micro = 1e3 * (self.target["forward"] + self.target["backward"])
        return replace(
            base,
            exact_ms=micro,
            takeover_ms=micro,
            takeover_recompute_ms=micro,
            takeover_ms_per_rank=0.0,
            basis_refresh_ms=0.0,
            optimizer_ms=1e3 * self.target["optimizer"],
            sync_ms=0.0,
            source=f"device clock {self.shape.name} (regroup, rejoin, memory: {base.source})",
        )


def clock_for(shape: str, log_path: Optional[str] = None) -> DeviceClock:
    """The clock of a named shape."""
    return DeviceClock(SHAPES[shape], log_path)


def install(trainer: Any, shape: str, rank: int) -> DeviceClock:
    """Put the example trainer's forward-backward and optimizer step on the clock of
    ``shape``; the per-step log goes beside ``--metrics-file`` (``.clock<rank>.jsonl``). Under
    ``--mecefo-policy auto`` the planner's costs become the clock's (:meth:`cost_profile`)."""
    metrics = getattr(trainer.args, "metrics_file", None)
    clock = clock_for(shape, f"{metrics}.clock{rank}.jsonl" if metrics else None)
    trainer.forward_backward = clock.wrap_forward_backward(trainer.forward_backward)
    trainer.optimizer.step = clock.wrap_optimizer_step(trainer.optimizer.step)
    policy = getattr(getattr(trainer, "controller", None), "policy", None)
    if hasattr(policy, "use_costs"):  # auto ranks its choices by what the clock charges
        policy.use_costs(clock.cost_profile(policy.profile))
    return clock


def read_logs(paths: List[str]) -> Dict[str, Any]:
    """Overrun counts over the per-step logs of several ranks (a torn last line is skipped),
    in total and per phase (``per_phase``: phases, overruns and the largest CPU time; logs
    written before the phases were named count in the totals only)."""
    steps = phases = over = 0
    per: Dict[str, Dict[str, Any]] = {}
    for path in paths:
        try:
            lines = open(path).read().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            steps += 1
            phases += rec["phases"]
            over += rec["overruns"]
            for name, busy, late in zip(
                rec.get("names", ()), rec["busy_s"], rec.get("over", ()), strict=False
            ):
                ph = per.setdefault(name, {"phases": 0, "overruns": 0, "max_busy_s": 0.0})
                ph["phases"] += 1
                ph["overruns"] += int(late)
                ph["max_busy_s"] = max(ph["max_busy_s"], busy)
    return {
        "rank_steps": steps,
        "phases": phases,
        "overruns": over,
        "overrun_fraction": round(over / phases, 4) if phases else None,
        "per_phase": per,
    }
