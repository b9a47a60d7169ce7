"""A real slowdown for tests and benchmarks: an outside process stops and continues another
with SIGSTOP / SIGCONT on a duty cycle, so that it runs ``speed`` of the wall time.

    python -m megatron_mecefo.failslow.duty_cycle --pid PID --speed 0.5 --period-ms 20

runs until SIGTERM / SIGINT (or ``--duration`` seconds) and always leaves the target continued.
The target is not instrumented: it only sees its wall time stretch, as under a throttled GPU or
a noisy neighbour. :class:`DutyCycle` starts and ends the tool from Python, by PID.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional, Sequence


def run(pid: int, speed: float, period_s: float, duration_s: Optional[float]) -> int:
    """Slow ``pid`` down until told to stop; returns the cycles run."""
    stop = {"now": False}

    def handler(_signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    end = None if duration_s is None else time.monotonic() + duration_s
    run_s, stopped_s = speed * period_s, (1.0 - speed) * period_s
    cycles = 0
    try:
        while not stop["now"] and (end is None or time.monotonic() < end):
            t0 = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            _sleep_until(t0 + stopped_s)
            os.kill(pid, signal.SIGCONT)
            _sleep_until(t0 + stopped_s + run_s)
            cycles += 1
    except ProcessLookupError:
        return cycles  # the target ended
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    return cycles


def _sleep_until(deadline: float) -> None:
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)


class DutyCycle:
    """Start the tool on ``pid`` as a child process; :meth:`stop` ends it by its PID and
    continues the target (also usable as a context manager).

    Args:
        pid: The process to slow down.
        speed: Share of each period it runs (0.5: half speed).
        period_ms: The period.
        cpu: Pin the tool to this core (None: anywhere).
    """

    def __init__(
        self, pid: int, speed: float = 0.5, period_ms: float = 20.0, cpu: Optional[int] = None
    ) -> None:
        self.pid = pid
        cmd = [sys.executable, "-m", "megatron_mecefo.failslow.duty_cycle", "--pid", str(pid),
               "--speed", str(speed), "--period-ms", str(period_ms)]  # fmt: skip
        if cpu is not None:
            cmd = ["taskset", "-c", str(cpu), *cmd]
        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(cmd, env=env)

    def stop(self) -> None:
        """End the tool (SIGTERM, then SIGKILL) and make sure the target runs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def __enter__(self) -> DutyCycle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="duty_cycle", description=__doc__.split("\n\n")[0])
    p.add_argument("--pid", type=int, required=True, help="The process to slow down.")
    p.add_argument("--speed", type=float, default=0.5, help="Share of time it runs (0, 1).")
    p.add_argument("--period-ms", type=float, default=20.0, help="Stop/continue period.")
    p.add_argument("--duration", type=float, default=None, help="Seconds (default: until "
                   "SIGTERM).")  # fmt: skip
    a = p.parse_args(list(argv) if argv is not None else None)
    problems: List[str] = []
    if not 0.0 < a.speed < 1.0:
        problems.append(f"--speed={a.speed}: give a share of time strictly between 0 and 1")
    if not a.period_ms > 0:
        problems.append(f"--period-ms={a.period_ms}: must be positive")
    if problems:
        p.error(problems[0])
    run(a.pid, a.speed, a.period_ms / 1e3, a.duration)


if __name__ == "__main__":
    main()
