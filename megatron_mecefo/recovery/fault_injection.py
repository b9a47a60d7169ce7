"""``--mecefo-kill RANK:ITERATION:PHASE``: SIGKILL a rank at a chosen point, for tests/demos.

PHASE is one of :data:`PHASES`: ``forward`` (the first micro-batch's forward starts),
``backward`` (the first backward starts), ``grad-sync`` (the data-parallel gradient sync is
about to start), ``optimizer`` (the commit vote passed, the update is about to run) or
``between`` (after iteration ITERATION committed, before the next one starts), ``save`` and
``saved`` (the checkpoint save of iteration ITERATION starts, or has ended), ``save-write``
(the save's write: this rank is about to write its files, or, writing none, to wait for the
writers) and ``save-finalize`` (the write is done on every rank; the tracker file is not
written yet); and, for tests
of a failure during a recovery, ``regroup``, ``world``, ``groups``, ``heal`` and
``dataset-build`` (:data:`RECOVERY_PHASES`). Any field may be
``?``: it is drawn from a ``random.Random(seed)``, so every rank draws the same kill. Each kill
fires once per job (a replacement process of the same rank does not fire it again). An
external ``kill -9`` is handled the same way.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

PHASES = (
    "forward", "backward", "grad-sync", "optimizer", "between", "regroup", "heal", "world",
    "groups", "save", "saved", "save-write", "save-finalize", "dataset-build",
)  # fmt: skip
RECOVERY_PHASES = ("regroup", "heal", "world", "groups", "dataset-build")
"""Phases inside a recovery, for tests of a failure during a failure: ``regroup`` fires in a
survivor that has just left a world whose iteration ITERATION (or later) failed; ``world`` in
a rank that left a world at iteration ITERATION or later (a failure, or a planned switch such
as a rejoin) once every member of the next generation arrived in the store, just before
``init_process_group`` (the others then wait in its rendezvous for this rank); ``groups`` in
it once that world exists, before the trainer builds Megatron's groups (the others wait in a
``new_group``'s rendezvous); ``heal`` in a joiner about to receive its state at a rejoin at
iteration ITERATION or later; ``dataset-build`` in Megatron-LM's ``pretrain_gpt.py`` (the
example trainer builds its data before the state is known and does not fire it), in a rank
whose ``pretrain()``, entered to run iteration ITERATION or later, is about to build its
datasets (the state is restored or healed by then; the others wait in the dataset builder's
barrier)."""
RANDOM_PHASES = PHASES[:7]
"""What a ``?`` phase is drawn from: the phases before ``world`` and ``groups`` were added, so
that a seeded schedule draws the kills it drew before."""


SAVE_PHASES = ("save", "save-write", "save-finalize", "saved")
"""Phases inside a checkpoint save: they fire only at an iteration that saves."""


def save_iterations(
    train_iters: int,
    save_interval: Optional[int],
    exit_interval: Optional[int] = None,
    more_intervals: Sequence[Optional[int]] = (),
) -> List[int]:
    """The iterations a run saves a checkpoint at, in both trainers: every multiple of each
    interval, and the last iteration (the end of training, or the first multiple of
    ``exit_interval``, where the run stops and saves)."""
    last = min(train_iters, exit_interval) if exit_interval else train_iters
    out = {last}
    for every in (save_interval, *more_intervals):
        if every and every > 0:
            out.update(range(every, last + 1, every))
    return sorted(out)


def _iterations_text(iterations: Sequence[int]) -> str:
    shown = [str(i) for i in iterations[:4]]
    if len(iterations) > 5:
        shown.append("...")
    if len(iterations) > 4:
        shown.append(str(iterations[-1]))
    return ", ".join(shown)


def unreachable_save_kill(
    kills: Sequence["KillSpec"], saves: Optional[Sequence[int]], flags: str
) -> Optional[str]:
    """The error for a kill at a save phase (:data:`SAVE_PHASES`) of an iteration that saves
    no checkpoint: it would never fire, and a run meant to test a death in a save would pass
    without one. None when every such kill has its save.

    Args:
        kills: The parsed kills.
        saves: The iterations that save (:func:`save_iterations`); None without ``--save``.
        flags: The flags that set ``saves``, for the message (e.g. ``--save-interval=10``).
    """
    for k in kills:
        if k.phase not in SAVE_PHASES:
            continue
        if saves is None:
            return (
                f"--mecefo-kill={k.key}: {k.phase} fires inside a checkpoint save and no "
                "--save is given, so nothing is saved and the kill never fires; add --save "
                f"DIR --save-interval {k.iteration}, or kill at another phase (e.g. "
                f"{k.rank}:{k.iteration}:backward)"
            )
        if k.iteration not in saves:
            near = min(saves, key=lambda i: (abs(i - k.iteration), i))
            return (
                f"--mecefo-kill={k.key}: no checkpoint is saved at iteration {k.iteration} "
                f"({flags} saves at {_iterations_text(saves)}), so the kill never fires; kill "
                f"at an iteration that saves (e.g. {k.rank}:{near}:{k.phase}) or save at "
                f"{k.iteration} (e.g. --save-interval {k.iteration})"
            )
    return None


class KillSpecError(ValueError):
    """A bad ``--mecefo-kill`` value; the message names the fix."""


@dataclass(frozen=True)
class KillSpec:
    """Kill ``rank`` (original global rank) at ``phase`` of (1-based) ``iteration``."""

    rank: int
    iteration: int
    phase: str

    @property
    def key(self) -> str:
        return f"{self.rank}:{self.iteration}:{self.phase}"


def parse_kills(
    specs: Sequence[str], world_size: int, train_iters: int, seed: int
) -> List[KillSpec]:
    """Parse ``RANK:ITERATION:PHASE`` values; ``?`` fields are drawn from ``seed``."""
    rng = random.Random(seed)
    out = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) != 3:
            raise KillSpecError(
                f"--mecefo-kill={spec}: expected RANK:ITERATION:PHASE, e.g. 1:5:backward"
            )
        r, it, phase = parts
        try:
            rank = rng.randrange(world_size) if r == "?" else int(r)
            iteration = rng.randrange(2, max(3, train_iters)) if it == "?" else int(it)
        except ValueError:
            raise KillSpecError(
                f"--mecefo-kill={spec}: RANK and ITERATION must be integers or ?"
            ) from None
        phase = rng.choice(RANDOM_PHASES) if phase == "?" else phase
        if phase not in PHASES:
            raise KillSpecError(f"--mecefo-kill={spec}: PHASE must be one of {', '.join(PHASES)}")
        if not 0 <= rank < world_size:
            raise KillSpecError(
                f"--mecefo-kill={spec}: rank {rank} does not exist (world size {world_size})"
            )
        if not 1 <= iteration <= train_iters:
            raise KillSpecError(
                f"--mecefo-kill={spec}: iteration {iteration} is outside 1..{train_iters}"
            )
        out.append(KillSpec(rank, iteration, phase))
    return out


class KillInjector:
    """Fires this rank's kills.

    Args:
        kills: Every kill of the job (only those of ``slot`` fire here).
        slot: This process's original global rank.
        claim: ``claim(key) -> bool``: True the first time a kill fires in the job (a store
            ``add``), so a replacement of the same rank does not fire it again.
        before_kill: Called with the spec just before the SIGKILL (records the kill time).
    """

    def __init__(
        self,
        kills: Sequence[KillSpec],
        slot: int,
        claim: Callable[[str], bool],
        before_kill: Optional[Callable[[KillSpec, float], None]] = None,
    ) -> None:
        self.kills = [k for k in kills if k.rank == slot]
        self.claim = claim
        self.before_kill = before_kill

    def phase(self, name: str, iteration: int) -> None:
        """This rank reached ``name`` of ``iteration``: SIGKILL it if a kill says so."""
        for k in self.kills:
            due = k.iteration <= iteration if name in RECOVERY_PHASES else k.iteration == iteration
            if due and k.phase == name and self.claim(k.key):
                if self.before_kill is not None:
                    self.before_kill(k, time.time())
                os.kill(os.getpid(), signal.SIGKILL)


DIE_AT_ENV = "MECEFO_TEST_DIE_AT"
"""Tests only: ``POINT:ITERATION``: the process SIGKILLs itself the first time it reaches POINT
of the commit protocol at ITERATION or later (a supervisor: its node dies, its ranks with it,
``processes._die_with_parent``). Where ``--mecefo-kill`` stops a rank at a phase of its step,
this stops a node at a point of the vote that no signal sent from outside can hit reliably.
:data:`DIE_POINTS` lists the points."""
DIE_POINTS = ("after-claim", "after-hot-vote")
"""``after-claim``: :func:`.commit._commit`, the commit claimed on etcd (etcd mode) and not yet
announced by the commit key; ``after-hot-vote``: a group head's collector
(:mod:`.group_vote`), its group's vote or abort decided on the hot store and not yet told to
its group."""


def die_at(point: str, iteration: int) -> None:
    """SIGKILL this process if :data:`DIE_AT_ENV` names ``point`` at ``iteration`` or earlier."""
    spec = os.environ.get(DIE_AT_ENV)
    if not spec:
        return
    where, _, at = spec.rpartition(":")
    if where == point and iteration >= int(at):
        os.kill(os.getpid(), signal.SIGKILL)
