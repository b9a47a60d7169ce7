"""The trainer's state, saved and brought back: ``--save`` checkpoints and ``--load``, the
in-memory snapshots (``--mecefo-snapshot-*``), and the recovery checkpoint the recovery
supervisor falls back to when no snapshot can serve. The file formats are ``checkpointing.py``'s.

Each function takes the :class:`pretrain_gpt.Trainer` whose state it saves or sets (its
model, optimizer, scheduler, ``iteration`` and ``consumed_samples``). Torch is imported inside
the functions (see ``building.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

from arguments import PROG

from megatron_mecefo.errors import fail

CONTROLLER_COUNTERS = (
    "degraded_iterations",
    "fallback_iterations",
    "samples_processed",
    "samples_skipped",
)
"""The MeCeFO controller's running counts, kept in snapshots."""


def save(trainer: Any) -> None:
    """Collective: a checkpoint of the current iteration to ``--save``."""
    from arguments import run_record
    from checkpointing import layout_name, save_checkpoint

    a = trainer.args
    recovery = getattr(trainer, "recovery", None)
    if recovery is not None:  # kill injection (--mecefo-kill R:I:save): the save starts
        recovery.injector.phase("save", trainer.iteration)
    path = save_checkpoint(
        a.save,
        trainer.iteration,
        trainer.model_chunks,
        trainer.optimizer,
        trainer.scheduler,
        trainer.consumed_samples,
        save_optimizer=not a.no_save_optim,
        dist_optimizer=a.use_distributed_optimizer,
        run_record=run_record(a),
        # --mecefo-kill R:I:save-write / save-finalize: in the write, in the finalize.
        phase=None if recovery is None else lambda n: recovery.injector.phase(n, trainer.iteration),
    )
    trainer.saved.append(trainer.iteration)
    trainer.saved_layouts[trainer.iteration] = layout_name()
    trainer.log.print(f"saved checkpoint at iteration {trainer.iteration} to {path}")
    if recovery is not None:  # --mecefo-kill R:I:saved: the save ended
        recovery.injector.phase("saved", trainer.iteration)


def load(trainer: Any) -> None:
    """Collective: resume from ``--load`` (no checkpoint there: from scratch, with a warning).

    A bad checkpoint stops every rank with one line (every rank checks the same files).
    """
    from arguments import ConfigError

    a = trainer.args
    t0 = time.perf_counter()
    try:
        loaded = _load_checkpoint(trainer, a.load)
    except ConfigError as err:  # every rank checks the same files: all stop here
        fail(str(err), PROG, err.exit_code)
    trainer.iteration, trainer.consumed_samples = loaded
    if trainer.iteration:
        trainer.recovery_path = "disk"
        trainer.log.print(
            f"loaded checkpoint from {a.load} at iteration {trainer.iteration} "
            f"(consumed samples {trainer.consumed_samples}); recovery path disk "
            f"(dist_checkpointing), {time.perf_counter() - t0:.3f} s"
        )


def _load_checkpoint(trainer: Any, directory: str) -> tuple[int, int]:
    """Collective: ``directory``'s newest checkpoint into ``trainer``'s model, optimizer and
    scheduler; returns ``(iteration, consumed_samples)``, ``(0, 0)`` without one."""
    from checkpointing import load_checkpoint

    a = trainer.args
    return load_checkpoint(
        directory,
        trainer.model_chunks,
        trainer.optimizer,
        trainer.scheduler,
        load_optimizer=not a.no_load_optim,
        dist_optimizer=a.use_distributed_optimizer,
    )


def load_basis(trainer: Any) -> None:
    """The MeCeFO low-rank bases of the ``--load`` checkpoint (after the MeCeFO modules exist)."""
    from checkpointing import load_mecefo_basis

    ckpt_dir = os.path.join(trainer.args.load, f"iter_{trainer.iteration:07d}")
    restored = load_mecefo_basis(ckpt_dir, trainer.model_chunks)
    if restored is None:
        trainer.log.print(
            "WARNING: the checkpoint holds no MeCeFO low-rank basis for this layout; V is "
            "recomputed at the first takeover, so the run may differ from an uninterrupted one"
        )
    elif restored:
        trainer.log.print(f"> MeCeFO: restored {restored} low-rank bases from the checkpoint")


def recovery_checkpoint(args: Any, before: int) -> Optional[tuple[str, int]]:
    """The newest checkpoint of ``--save``, else of ``--load``, at or before iteration
    ``before``, as ``(directory, iteration)``; None without one."""
    from arguments import ConfigError
    from checkpointing import latest_iteration

    for directory in (args.save, args.load):
        if not directory:
            continue
        try:
            iteration = latest_iteration(directory)
        except ConfigError:
            continue
        if iteration is not None and 0 < iteration <= before:
            return directory, iteration
    return None


def load_recovery_checkpoint(trainer: Any, directory: str, basis_layout: Optional[str]) -> float:
    """Collective: load the newest checkpoint of ``directory`` into ``trainer`` (the
    distributed optimizer re-sharded over this world's data-parallel size), and the low-rank
    bases this rank saved (``basis_layout``: its position when it saved); sets the iteration
    and consumed samples. Returns the seconds it took."""
    from checkpointing import load_mecefo_basis

    t0 = time.perf_counter()
    trainer.iteration, trainer.consumed_samples = _load_checkpoint(trainer, directory)
    ckpt_dir = os.path.join(directory, f"iter_{trainer.iteration:07d}")
    load_mecefo_basis(ckpt_dir, trainer.model_chunks, basis_layout)
    return time.perf_counter() - t0


def build_snapshots(
    config: Any, recovery: Any, rank: int, print_line: Callable[[str], None]
) -> Any:
    """The snapshot manager of ``--mecefo-snapshot-*`` (``config``), or None without one;
    under the recovery supervisor, the session's (it outlives the worlds)."""
    if config is None:
        return None
    if recovery is not None:
        return recovery.snapshot_manager(config)
    from megatron_mecefo.snapshot.manager import megatron_snapshot_manager

    manager = megatron_snapshot_manager(config, rank, print_line)
    manager.prepare()  # the parity group, built collectively by every rank (redundancy)
    return manager


def snapshot_state(trainer: Any) -> Any:
    """What a snapshot holds: model, optimizer, scheduler, counters, the controller's counts."""
    from megatron_mecefo.snapshot.contents import TrainingState

    extra = {}
    ctrl = getattr(trainer, "controller", None)
    if ctrl is not None:  # the takeover rolls back to the snapshot: these too
        extra["controller"] = {k: getattr(ctrl, k) for k in CONTROLLER_COUNTERS}
    return TrainingState(
        trainer.model_chunks,
        trainer.optimizer,
        trainer.scheduler,
        {"iteration": trainer.iteration, "consumed_samples": trainer.consumed_samples},
        extra,
    )


def restore_snapshot(trainer: Any) -> Optional[dict[str, Any]]:
    """Resume from the holder's newest snapshot every rank holds intact, if any; returns the
    ``snapshot_restore`` record to emit, or None when none served."""
    from megatron_mecefo.snapshot.contents import SnapshotMismatch

    state = snapshot_state(trainer)
    try:
        served = trainer.snapshots.restore(state)
    except SnapshotMismatch as err:  # every rank holds snapshots of the same run
        fail(
            f"--mecefo-snapshot-dir {trainer.args.snapshot_config.directory}: {err}; pass the "
            "flags of the run that took it, or start a new holder (another directory)",
            PROG,
            1,
        )
    if served is None:
        return None
    trainer.iteration = int(state.counters["iteration"])
    trainer.consumed_samples = int(state.counters["consumed_samples"])
    trainer.recovery_path = "local"
    return {"type": "snapshot_restore", **served}
