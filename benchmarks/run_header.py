"""The header every store benchmark's JSON starts with: its name, the date and the machine; and
where a benchmark's plot goes."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any, Dict

RESULTS = Path(__file__).resolve().parents[1] / "results"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``): these benchmarks' machines differ from run to
    run, and a loopback link's speed with them (gloo's one tensor 1.7-5.5 GB/s)."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or "unknown"


def run_header(benchmark: str) -> Dict[str, Any]:
    """``benchmark``, ``date`` and ``machine`` (cores, CPU model, Python, load average at the
    start)."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "python": platform.python_version(),
            "loadavg_start": os.getloadavg(),
        },
    }


def plot_path(output: Path) -> Path:
    """Where the plot of a run written to ``output`` goes: beside the committed results' plots
    (``results/plots/<name>.png``) for an output in ``results/``, else next to the output, so
    that a trial run written elsewhere does not overwrite a committed plot."""
    if output.resolve().parent == RESULTS:
        return RESULTS / "plots" / f"{output.stem}.png"
    return output.with_suffix(".png")
