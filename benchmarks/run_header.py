"""The header every store benchmark's JSON starts with: its name, the date and the machine."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any, Dict


def run_header(benchmark: str) -> Dict[str, Any]:
    """``benchmark``, ``date`` and ``machine`` (cores, Python, load average at the start)."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_start": os.getloadavg(),
        },
    }
