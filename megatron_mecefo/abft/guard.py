"""The protocol every protected GEMM runs after it computes its output.

1. inject (tests and demos: the injector writes its faults for this site, if any);
2. primary check over the token-sum lines, correcting single bad elements in place;
3. if a line is left bad and the op has a second direction (``scores``, ``context``):
   the feature-sum check corrects what it can, then the primary check confirms;
4. if still bad (or in detection-only mode, on any mismatch): recompute the GEMM once,
   copy it over the output and check again;
5. if still bad: :meth:`AbftState.escalate` (skip the step, or raise).

Every detection is counted in ``state.counters`` with layer, op, kind, action and index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from megatron_mecefo.abft.correction import CheckOutcome, correct_lines
from megatron_mecefo.abft.state import AbftState

Index = Tuple[int, ...]


@dataclass
class Direction:
    """One checksum direction of a GEMM output.

    ``lines`` is a ``[B, n, m]`` view of the output (lines along dim 1); ``expected`` the
    carried checksums ``[B, k, m]``; ``actual()`` recomputes the output's own checksums;
    ``bound`` bounds ``Σ|x|`` per line; ``index`` maps (block, position, line) to the
    output's natural index, for the reports.
    """

    lines: torch.Tensor
    expected: torch.Tensor
    actual: Callable[[], torch.Tensor]
    bound: Optional[torch.Tensor]
    index: Callable[[int, int, int], Index]


def _run(state: AbftState, d: Direction, rel: float, correct: bool) -> CheckOutcome:
    cfg = state.config
    return correct_lines(
        d.lines, d.expected, d.actual(), d.bound, cfg.abs_threshold, rel,
        cfg.near_inf_threshold, correct,
    )  # fmt: skip


def inject_only(
    state: AbftState,
    layer: int,
    op: str,
    lines: torch.Tensor,
    index: Callable[[int, int, int], Index],
    causal: bool = False,
    training: bool = True,
) -> None:
    """Write this site's faults with no check (an unchecked op, or ``check=False``)."""
    if state.injector is None or not training:
        return
    for f in state.injector.inject(
        layer, op, lines, state.iteration, state.current_microbatch, causal
    ):
        state.counters.record_injection(
            layer, op, f.kind, index=index(f.block, f.position, f.line),
            iteration=f.iteration, microbatch=f.microbatch,
        )  # fmt: skip


def protect(
    state: AbftState,
    layer: int,
    op: str,
    out: torch.Tensor,
    directions: Sequence[Callable[[], Direction]],
    recompute: Callable[[], torch.Tensor],
    rel: float,
    inject_lines: Optional[torch.Tensor] = None,
    inject_index: Optional[Callable[[int, int, int], Index]] = None,
    causal: bool = False,
    training: bool = True,
    any_rank: Optional[Callable[[bool], bool]] = None,
) -> None:
    """Run the protocol on ``out`` (modified in place).

    Args:
        directions: Builders of the primary direction and the optional second one (built
            lazily: the second costs a pass over the output and runs only when needed).
        recompute: Recomputes the GEMM output (called under ``no_grad``).
        rel: Relative detection threshold for this GEMM's dtype.
        inject_lines: The ``[B, n, m]`` view the injector writes into (default: primary's).
        any_rank: For GEMMs whose recompute is a collective (sequence-parallel QKV): turns
            this rank's "recompute needed" into the TP group's.
    """
    cfg = state.config
    counters = state.counters
    correct = cfg.mode == "correct"
    # After an uncorrectable GEMM the bad values flow on (the step will be skipped): later
    # checks still run (their collectives must match the TP group's) but are not counted.
    quiet = state.poisoned
    primary = directions[0]()
    inject_only(
        state, layer, op, primary.lines if inject_lines is None else inject_lines,
        primary.index if inject_index is None else inject_index, causal, training,
    )  # fmt: skip
    counters.check()
    result = _run(state, primary, rel, correct)
    fixes: List[Tuple[Direction, object]] = [(primary, f) for f in result.fixes if f.corrected]
    if result.uncorrectable and correct and len(directions) > 1:
        for build in directions[1:]:
            second = build()
            fixes += [(second, f) for f in _run(state, second, rel, True).fixes if f.corrected]
        result = _run(state, primary, rel, False)  # confirm in the primary direction
    where = dict(iteration=state.iteration, microbatch=state.current_microbatch)
    for d, f in fixes:
        index = d.index(f.block, f.position, f.line)
        counters.record(layer, op, f.kind, "corrected", index=index, **where)
    pending = [(b, j, k) for (b, j), k in zip(result.uncorrectable, result.kinds, strict=True)]
    need = bool(pending) if any_rank is None else any_rank(bool(pending))
    if not need:
        return
    still = {(b, j) for b, j, _ in pending}
    if cfg.recompute:
        counters.recomputes += 1
        with torch.no_grad():
            out.copy_(recompute())
        still = set(_run(state, primary, rel, False).uncorrectable)
    if quiet:
        return
    for b, j, kind in pending:
        action = "uncorrectable" if (b, j) in still else "recomputed"
        counters.record(layer, op, kind, action, block=b, line=j, **where)
    if still:
        state.escalate(layer, op, f"{len(still)} line(s) with bad values")
