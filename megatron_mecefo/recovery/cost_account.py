"""The supervisor's own CPU (its loop, the coordinator and, on node 0, the store's server
thread), recorded for the armed-cost account of ``benchmarks/recovery_latency.py``."""

from __future__ import annotations

import resource
import time
from typing import TYPE_CHECKING, Optional

from megatron_mecefo.recovery.records import append_jsonl

if TYPE_CHECKING:
    from megatron_mecefo.recovery.membership import MembershipStore

STEADY_FROM_ITERATION = 5
"""The armed-cost account leaves out the iterations before this one (start-up)."""


def cpu_s() -> float:
    """This process's user and system CPU seconds so far."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


class SupervisorCost:
    """One ``supervisor_cost`` record per node at exit, when ``--records`` is given."""

    def __init__(self, records_file: Optional[str], node: int) -> None:
        self.records_file = records_file
        self.node = node
        self.t_start = time.monotonic()
        self._steady: Optional[tuple] = None  # (CPU seconds, iteration) once training runs

    def start(self) -> None:
        """The supervisor starts now (its wall time counts from here)."""
        self.t_start = time.monotonic()

    def note_steady_cpu(self, ms: "MembershipStore") -> None:
        """Once training is past its first iterations (imports, connecting, compiling), note
        this process's CPU and the iteration, so :meth:`record` can give the CPU of the armed
        supervisor per iteration without its start-up."""
        if self._steady is None and self.records_file:
            progress = int(ms.get_str("progress") or 0)
            if progress >= STEADY_FROM_ITERATION:
                self._steady = (cpu_s(), progress)

    def record(self, ms: "MembershipStore") -> None:
        """Append the record: CPU and wall seconds, and the steady part's CPU per iteration."""
        if not self.records_file:
            return
        record = {"type": "supervisor_cost", "node": self.node, "cpu_s": cpu_s(),
                  "wall_s": time.monotonic() - self.t_start}  # fmt: skip
        if self._steady is not None:
            try:  # node 0's store may be gone already (this node finished after it)
                last = int(ms.get_str("progress") or 0)
            except Exception:  # noqa: BLE001 (a statistic, never a reason to fail the exit)
                last = None
            if last is not None:
                record["steady"] = {"cpu_s": record["cpu_s"] - self._steady[0],
                                    "iterations": last - self._steady[1]}  # fmt: skip
        append_jsonl(self.records_file, record)
