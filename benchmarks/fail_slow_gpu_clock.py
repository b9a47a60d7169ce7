"""Fail-slow detection on a GPU: the host clock against CUDA events, with a GPU really slowed.

A GPU only shows this: the host *queues* a step's kernels and returns long before the device
has run them, so a replica whose GPU is slow (throttled, shared) queues as fast as a healthy
one. :class:`~megatron_mecefo.failslow.compute_clock.ComputeClock` therefore times with CUDA
events on a GPU. This benchmark runs the same step with both clocks around the same calls
(the host clock as ``ComputeClock(use_cuda=False)``, the one a CPU run uses):

* the step: a bf16 MLP (``--layers`` x Linear(``--hidden``), batch ``--batch``), forward,
  backward, the clocks stopped where ``finalize_model_grads`` would start, then ``.item()`` of
  the loss (a trainer's own per-step synchronisation: logging, the found-inf check);
* phases: ``calm`` (``--steps``), ``slowed`` (another process runs bf16 products on the same
  GPU without pause: the GPU time-slices between the two, a real slowdown of this replica's
  device), ``calm`` again;
* the detector (:class:`~megatron_mecefo.failslow.detector.FailSlowDetector`, the default
  flags) is fed, per step, replica 0 = the first calm phase's median (a healthy twin) and
  replica 1 = this step's time, once with each clock: which clock sees the slow replica.

Writes JSON (every step's times) and one summary line. Needs a CUDA device; ``--cpu-smoke``
runs the flow on the CPU only to check the script (its numbers mean nothing).
Usage: ``python benchmarks/fail_slow_gpu_clock.py [--output results/fail_slow_gpu_clock.json]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for path in (BENCH, REPO):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from run_header import run_header  # noqa: E402

HOG = """
import sys, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print("ready", flush=True)
while True:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""


def _step(model: Any, x: Any, host: Any, device: Any, sync: Any) -> float:
    """One step; returns its wall time up to the loss's ``.item()``."""
    t0 = time.perf_counter()
    host.start(tag=1)
    device.start(tag=1)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    host.stop()  # where finalize_model_grads (the gradient sync) would start
    device.stop()
    loss.item()
    sync()
    return time.perf_counter() - t0


def _detect(reference: float, times: List[float], phases: List[str]) -> Dict[str, Any]:
    """Feed the detector (replica 0: ``reference``, replica 1: each step's time)."""
    from megatron_mecefo.failslow import FailSlowConfig, FailSlowDetector

    det = FailSlowDetector(2, FailSlowConfig(mode="detect"))
    flagged: List[int] = []
    for t in times:
        state = det.update([reference, t])
        flagged.append(int(1 in state.slow))
    slowed = [f for f, p in zip(flagged, phases, strict=True) if p == "slowed"]
    last_calm = [f for f, p in zip(flagged, phases, strict=True) if p == "calm_after"]
    return {
        "flagged_per_step": flagged,
        "slowed_steps_flagged": sum(slowed),
        "slowed_steps": len(slowed),
        "flagged_at_end_of_slowed": bool(slowed and slowed[-1]),
        "flagged_at_end_after_recovery": bool(last_calm and last_calm[-1]),
    }


def _summarise(records: List[Dict[str, Any]]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Per-phase medians of each clock, and the detector's verdicts from each clock."""

    def med(phase: str, key: str) -> float:
        vals = [r[key] for r in records if r["phase"] == phase and r[key] is not None]
        return statistics.median(vals) if vals else float("nan")

    phases = [r["phase"] for r in records]
    summary: Dict[str, Any] = {}
    for key in ("wall_ms", "host_ms", "device_ms"):
        calm, slowed = med("calm", key), med("slowed", key)
        summary[key] = {
            "calm": round(calm, 3),
            "slowed": round(slowed, 3),
            "calm_after": round(med("calm_after", key), 3),
            "slowed_over_calm": round(slowed / calm, 3),
        }
    detection = {}
    for key in ("host_ms", "device_ms"):
        ref = med("calm", key) / 1e3
        times = [(r[key] or 0.0) / 1e3 for r in records]
        detection[key] = _detect(ref, times, phases)
    return summary, detection


def _line(machine: Dict[str, Any], summary: Dict[str, Any], detection: Dict[str, Any]) -> str:
    host, dev = detection["host_ms"], detection["device_ms"]
    return (
        f"fail_slow_gpu_clock ({machine.get('gpu', 'cpu smoke')}): slowed/calm step "
        f"{summary['wall_ms']['slowed_over_calm']:.2f}x; host clock "
        f"{summary['host_ms']['slowed_over_calm']:.2f}x, flagged "
        f"{host['slowed_steps_flagged']}/{host['slowed_steps']} slowed steps; CUDA events "
        f"{summary['device_ms']['slowed_over_calm']:.2f}x, flagged "
        f"{dev['slowed_steps_flagged']}/{dev['slowed_steps']}; recovered at the end: "
        f"{not dev['flagged_at_end_after_recovery']}"
    )


def _redetect(path: Path) -> int:
    out = json.loads(path.read_text())
    summary, detection = _summarise(out["steps"])
    out["medians_ms"], out["detection"] = summary, detection
    out["summary"] = _line(out["machine"], summary, detection)
    out["redetected"] = (
        "detection recomputed from the recorded steps with the detector of "
        f"{datetime.date.today().isoformat()} (the GPU run itself is unchanged)"
    )
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(out["summary"])
    return 0


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=30, help="steps per phase")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument(
        "--redetect",
        action="store_true",
        help="no GPU run: recompute the detection of --output's recorded steps with the "
        "current detector (its rules changed after the run) and rewrite the file",
    )
    p.add_argument("--output", default=str(REPO / "results" / "fail_slow_gpu_clock.json"))
    a = p.parse_args(argv)

    if a.redetect:
        return _redetect(Path(a.output))

    import torch

    from megatron_mecefo.failslow.compute_clock import ComputeClock

    if not a.cpu_smoke and not torch.cuda.is_available():
        print("fail_slow_gpu_clock: needs a CUDA device (--cpu-smoke checks the script only)")
        return 2
    dev = "cpu" if a.cpu_smoke else "cuda"
    dtype = torch.float32 if a.cpu_smoke else torch.bfloat16
    if not a.cpu_smoke:
        torch.cuda.init()
    sync = (lambda: None) if a.cpu_smoke else torch.cuda.synchronize
    layers = [torch.nn.Linear(a.hidden, a.hidden) for _ in range(a.layers)]
    model = torch.nn.Sequential(*layers).to(dev, dtype)
    x = torch.randn(a.batch, a.hidden, device=dev, dtype=dtype)
    host, device = ComputeClock(use_cuda=False), ComputeClock(use_cuda=not a.cpu_smoke)

    for _ in range(5):  # warm-up: cuBLAS handles, the caching allocator
        _step(model, x, host, device, sync)
    device.take()
    host.take()

    records: List[Dict[str, Any]] = []

    def run_phase(phase: str) -> None:
        for _ in range(a.steps):
            wall = _step(model, x, host, device, sync)
            host_s, dev_s = host.take(), device.take()
            rec = {"phase": phase, "wall_ms": wall * 1e3, "host_ms": host_s[0] * 1e3}
            rec["device_ms"] = None
            # CUDA events of step i are read at step i+1's start: they belong to the record
            # before this one.
            target = rec if not device.use_cuda else (records[-1] if records else None)
            if dev_s is not None and target is not None:
                target["device_ms"] = dev_s[0] * 1e3
            records.append(rec)

    def finish_pending() -> None:
        # The last step's events, read with one more (empty, unrecorded) measurement's start.
        device.start(tag=0)
        device.stop()
        got = device.take()
        if got is not None and records and records[-1]["device_ms"] is None:
            records[-1]["device_ms"] = got[0] * 1e3

    run_phase("calm")
    hog = None
    if not a.cpu_smoke:
        hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
        assert hog.stdout is not None
        hog.stdout.readline()  # "ready": its context and operand exist
        time.sleep(1.0)
    try:
        run_phase("slowed")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    time.sleep(0.5)
    run_phase("calm_after")
    finish_pending()

    summary, detection = _summarise(records)

    out = run_header("fail_slow_gpu_clock")
    if not a.cpu_smoke:
        out["machine"]["gpu"] = torch.cuda.get_device_name(0)
        out["machine"]["torch"] = torch.__version__
    out["config"] = {
        "hidden": a.hidden, "layers": a.layers, "batch": a.batch, "steps_per_phase": a.steps,
        "dtype": str(dtype), "slowdown": "a second process running 8192^3 bf16 products on "
        "the same GPU without pause (the GPU time-slices between the two)",
        "detector": "FailSlowConfig() defaults; replica 0 = the calm phase's median",
        "cpu_smoke": a.cpu_smoke,
    }  # fmt: skip
    out["medians_ms"] = summary
    out["detection"] = detection
    out["steps"] = records
    line = _line(out["machine"], summary, detection)
    out["summary"] = line
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=1) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
