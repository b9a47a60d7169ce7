"""Counters of checks, detections and corrections, by layer, op and kind.

Every detected bad element or line becomes one event with an *action*:

* ``corrected``: repaired in place from the checksums;
* ``recomputed``: the GEMM was recomputed and the recomputed output passed the check;
* ``uncorrectable``: still bad after the recompute (the step is skipped, or the run raises).

``AbftCounters.step_record()`` is what the trainer puts under ``abft`` in each train record of
the metrics JSONL; ``totals()`` feeds the run summary.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Tuple

ACTIONS = ("corrected", "recomputed", "uncorrectable")
KINDS = ("nan", "inf", "near_inf", "error")


def classify(value: float, near_inf: float) -> str:
    """The kind of a bad value: ``nan``, ``inf``, ``near_inf`` or ``error`` (finite)."""
    if value != value:
        return "nan"
    if value in (float("inf"), float("-inf")):
        return "inf"
    if abs(value) > near_inf:
        return "near_inf"
    return "error"


class AbftCounters:
    """Per-process counts; ``reset()`` clears them."""

    def __init__(self, max_events: int = 10_000) -> None:
        self.max_events = max_events
        self.reset()

    def reset(self) -> None:
        self.total: Counter = Counter()
        """(layer, op, kind, action) -> count, over the run."""
        self.step: Counter = Counter()
        """The same for the current step."""
        self.checks = 0
        self.step_checks = 0
        self.recomputes = 0
        self.events: List[Dict[str, Any]] = []
        self.injected: Counter = Counter()
        """(layer, op, kind) -> faults the injector wrote, over the run."""
        self.step_injected: List[Dict[str, Any]] = []

    def start_step(self) -> None:
        self.step = Counter()
        self.step_checks = 0
        self.step_injected = []

    def check(self) -> None:
        self.checks += 1
        self.step_checks += 1

    def record(self, layer: int, op: str, kind: str, action: str, **where: Any) -> None:
        key = (layer, op, kind, action)
        self.total[key] += 1
        self.step[key] += 1
        if len(self.events) < self.max_events:
            self.events.append(dict(layer=layer, op=op, kind=kind, action=action, **where))

    def record_injection(self, layer: int, op: str, kind: str, **where: Any) -> None:
        self.injected[(layer, op, kind)] += 1
        self.step_injected.append(dict(layer=layer, op=op, kind=kind, **where))

    @staticmethod
    def _by_action(counter: Counter) -> Dict[str, int]:
        out = {a: 0 for a in ACTIONS}
        for (_, _, _, action), n in counter.items():
            out[action] += n
        return out

    def step_detections(self) -> int:
        return sum(self.step.values())

    def step_uncorrectable(self) -> int:
        return sum(n for k, n in self.step.items() if k[3] == "uncorrectable")

    def step_record(self) -> Dict[str, Any]:
        """This step's counts (this process), with one entry per (layer, op, kind, action)."""
        return {
            "checks": self.step_checks,
            **self._by_action(self.step),
            "detections": [
                {"layer": layer, "op": op, "kind": kind, "action": action, "count": n}
                for (layer, op, kind, action), n in sorted(self.step.items())
            ],
            "injected": list(self.step_injected),
        }

    def totals(self) -> Dict[str, Any]:
        """Run totals: by action, and by (op, kind, action)."""
        by_op: Counter = Counter()
        for (_, op, kind, action), n in self.total.items():
            by_op[(op, kind, action)] += n
        return {
            "checks": self.checks,
            **self._by_action(self.total),
            "injected": sum(self.injected.values()),
            "by_op": {f"{op}/{kind}/{action}": n for (op, kind, action), n in sorted(by_op.items())},
        }

    def rows(self) -> List[Tuple[str, str]]:
        """Summary-table rows."""
        t = self.totals()
        rows = [
            (
                "abft checks / faults injected",
                f"{t['checks']} GEMM checks, {t['injected']} faults injected",
            ),
            (
                "abft detected",
                f"{t['corrected']} corrected, {t['recomputed']} recomputed,"
                f" {t['uncorrectable']} uncorrectable",
            ),
        ]
        if t["by_op"]:
            rows.append(
                ("abft by op/kind", ", ".join(f"{k}: {n}" for k, n in t["by_op"].items()))
            )
        return rows
