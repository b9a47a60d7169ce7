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
ALL_ACTIONS = (*ACTIONS, "injected")
OPS = ("qkv", "scores", "context", "proj")  # = config.OPS (kept torch- and import-free)


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
    """Counts of this process (``step``) and of all ranks (``step_global``, ``total``).

    The modules count into ``step``; ``AbftState.end_step`` sums the dense form over all
    ranks and calls :meth:`close_step`, which sets ``step_global`` and adds it to ``total``.
    Without torch.distributed the global counts are this process's. ``reset()`` clears all.
    """

    def __init__(self, max_events: int = 10_000) -> None:
        self.max_events = max_events
        self.reset()

    def reset(self) -> None:
        self.total: Counter = Counter()
        """(layer, op, kind, action) -> count over the run, all ranks (``injected`` included)."""
        self.step: Counter = Counter()
        """The same for the current step, this process."""
        self.step_global: Counter = Counter()
        """The last closed step, all ranks."""
        self.checks = 0
        """GEMM checks run over the run, all ranks."""
        self.step_checks = 0
        self.recomputes = 0
        self.events: List[Dict[str, Any]] = []
        """This process's detections and injections, with their indices (capped)."""

    def start_step(self) -> None:
        self.step = Counter()
        self.step_checks = 0

    def check(self) -> None:
        self.step_checks += 1

    def _event(self, **event: Any) -> None:
        if len(self.events) < self.max_events:
            self.events.append(event)

    def record(self, layer: int, op: str, kind: str, action: str, **where: Any) -> None:
        self.step[(layer, op, kind, action)] += 1
        self._event(layer=layer, op=op, kind=kind, action=action, **where)

    def record_injection(self, layer: int, op: str, kind: str, **where: Any) -> None:
        self.step[(layer, op, kind, "injected")] += 1
        self._event(layer=layer, op=op, kind=kind, action="injected", **where)

    def step_detections(self) -> int:
        return sum(n for k, n in self.step.items() if k[3] != "injected")

    # ------------------------------------------------------------------ all ranks
    def dense(self, num_layers: int) -> List[float]:
        """This step's counts as a flat list over (layer, op, kind, action) + [checks]."""
        cells = [0.0] * (num_layers * len(OPS) * len(KINDS) * len(ALL_ACTIONS))
        for (layer, op, kind, action), n in self.step.items():
            cells[_cell(layer, op, kind, action)] += n
        return cells + [float(self.step_checks)]

    def close_step(self, dense: List[float]) -> None:
        """Set ``step_global`` from the summed dense counts and add them to ``total``."""
        self.step_global = Counter()
        n_kinds, n_actions = len(KINDS), len(ALL_ACTIONS)
        for i, value in enumerate(dense[:-1]):
            if value:
                action = ALL_ACTIONS[i % n_actions]
                kind = KINDS[(i // n_actions) % n_kinds]
                op = OPS[(i // (n_actions * n_kinds)) % len(OPS)]
                layer = 1 + i // (n_actions * n_kinds * len(OPS))
                self.step_global[(layer, op, kind, action)] = int(value)
        self.total.update(self.step_global)
        self.checks += int(dense[-1])
        self._step_checks_global = int(dense[-1])

    @staticmethod
    def _by_action(counter: Counter) -> Dict[str, int]:
        out = {a: 0 for a in ALL_ACTIONS}
        for (_, _, _, action), n in counter.items():
            out[action] += n
        return out

    def step_record(self) -> Dict[str, Any]:
        """The closed step, all ranks: checks, counts by action, and each (layer, op, kind,
        action) with its count — what the trainer writes under ``abft`` in the metrics."""
        return {
            "checks": getattr(self, "_step_checks_global", self.step_checks),
            **self._by_action(self.step_global),
            "detections": [
                {"layer": layer, "op": op, "kind": kind, "action": action, "count": n}
                for (layer, op, kind, action), n in sorted(self.step_global.items())
            ],
        }

    def totals(self) -> Dict[str, Any]:
        """Run totals, all ranks: by action, and by ``op/kind/action``."""
        by_op: Counter = Counter()
        for (_, op, kind, action), n in self.total.items():
            by_op[(op, kind, action)] += n
        return {
            "checks": self.checks,
            **self._by_action(self.total),
            "by_op": {
                f"{op}/{kind}/{action}": n for (op, kind, action), n in sorted(by_op.items())
            },
        }

    def rows(self) -> List[Tuple[str, str]]:
        """Summary-table rows."""
        t = self.totals()
        rows = [
            ("abft GEMM checks", f"{t['checks']} (all ranks)"),
            (
                "abft faults",
                f"{t['injected']} injected; detected: {t['corrected']} corrected,"
                f" {t['recomputed']} recomputed, {t['uncorrectable']} uncorrectable",
            ),
        ]
        detected = {k: n for k, n in t["by_op"].items() if not k.endswith("/injected")}
        if detected:
            rows.append(("abft by op/kind", ", ".join(f"{k}: {n}" for k, n in detected.items())))
        return rows


def _cell(layer: int, op: str, kind: str, action: str) -> int:
    return (((layer - 1) * len(OPS) + OPS.index(op)) * len(KINDS) + KINDS.index(kind)) * len(
        ALL_ACTIONS
    ) + ALL_ACTIONS.index(action)
