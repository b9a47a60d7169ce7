"""Restore paths after a death under the distributed optimizer: peers+parity, then disk.

A dead rank's optimizer shard died with it. The survivors roll back to the newest in-memory
snapshot held with parity by all and rebuild the lost shards from their peers and parity
(:func:`take_over_from_snapshot`); when the snapshots cannot serve, they load the newest disk
checkpoint (:func:`fall_back_to_disk`). Either way the iterations after the restored one are
replayed (:func:`replay_from`). The local path (a survivor's own carried state) and the heal
of a joiner are in :mod:`.state`.
"""

from __future__ import annotations

from typing import Any, List


def take_over_from_snapshot(session: Any, trainer: Any) -> None:
    """Distributed optimizer, after a real death: every member rolls back to the newest
    snapshot held with parity by all, the lost members' slots are rebuilt from their
    peers and parity, and the optimizer is re-sharded over this world's data-parallel
    group. When the snapshots cannot serve (more than m members of a group lost, or no
    snapshot with parity held by all: one verdict for the whole world), the members load
    the newest disk checkpoint instead (:func:`fall_back_to_disk`). The iterations after
    the restored one are then replayed with the dead replicas failed from its next
    iteration (the carry's history of them is dropped)."""
    from megatron.core import parallel_state as ps

    from megatron_mecefo.snapshot.erasure import SnapshotLost

    manager = trainer.snapshots
    state = trainer.snapshot_state()
    # Megatron's OptimizerParamScheduler.load_state_dict adds the saved steps to its own.
    trainer.scheduler.num_steps = 0
    served, why = None, ""
    if manager is None or not manager.config.redundancy:
        why = "no in-memory snapshots with parity"
    else:
        try:  # every branch below is taken alike on every rank (manager.takeover agrees)
            served = manager.takeover(state, ps.get_data_parallel_group_gloo())
        except SnapshotLost as err:
            why = str(err).split("; falling back")[0]
        if served is None and not why:
            why = "no snapshot with parity is held by every survivor"
    if served is None:
        fall_back_to_disk(session, trainer, why)
        return
    s, carried = served["iteration"], session.carry["iteration"]
    trainer.iteration = int(state.counters["iteration"])
    trainer.consumed_samples = int(state.counters["consumed_samples"])
    ctrl = getattr(trainer, "controller", None)
    for key, value in state.extra.get("controller", {}).items():
        setattr(ctrl, key, value)
    replay_from(session, trainer, s)
    session.takeover_info = {
        "recovery_path": "peers+parity",
        "rolled_back_to": s,
        "replayed_to": carried + 1,  # up to the iteration that was in flight
        "samples_redone": (carried + 1 - s) * session.args.global_batch_size,
        "snapshot_restore_s": served["seconds"],
    }
    trainer.emit(
        {
            "type": "snapshot_restore",
            **served,
            "generation": session.generation,
            "discarded_iterations": list(range(s + 1, carried + 1)),
        }
    )
    session.takeover_pending = False


def fall_back_to_disk(session: Any, trainer: Any, why: str) -> None:
    """Recovery path 4: load the newest checkpoint of ``--save``/``--load`` at or before
    the carried iteration into this world (the distributed optimizer re-sharded over its
    data-parallel size), and replay from the checkpoint's next iteration; without one,
    stop with a message naming the flags. Never continues with a lost shard."""
    import torch.distributed as dist

    carried = session.carry["iteration"]
    find = getattr(trainer, "recovery_checkpoint", None)
    found = find(carried) if find is not None else None
    # One file system, but one verdict all the same: every rank loads the same checkpoint
    # or none does.
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    if found is None or any(e != every[0] for e in every):
        session.fatal(
            f"{why}, and there is no checkpoint to fall back to (neither --save nor --load "
            f"holds one at or before iteration {carried}): the job stops rather than "
            "continue with a lost optimizer shard. "
            "Save checkpoints (--save DIR --save-interval N) to fall back to disk, or raise "
            "--mecefo-snapshot-redundancy"
        )
    directory, c = found
    session.log(f"> MeCeFO recovery: {why}: falling back to the checkpoint of iteration {c}")
    seconds = trainer.load_recovery_checkpoint(directory, session.saved_layouts.get(c))
    if trainer.snapshots is not None:
        trainer.snapshots.forget()  # they belong to the discarded iterations
    history = [r for r in session.carry["history"] if r["iteration"] <= c]
    ctrl = getattr(trainer, "controller", None)
    if ctrl is not None:  # its running counts at c, as the uninterrupted run has them
        plans = [r["mecefo"] for r in history if "mecefo" in r]
        ctrl.degraded_iterations = sum(int(bool(p.get("degraded"))) for p in plans)
        ctrl.fallback_iterations = sum(int(bool(p.get("fallback"))) for p in plans)
        ctrl.samples_processed = sum(int(p.get("samples_processed", 0)) for p in plans)
        ctrl.samples_skipped = sum(int(p.get("samples_skipped", 0)) for p in plans)
    if session.schedule is not None:  # replicas lost after c are down from c + 1 in the replay
        from megatron_mecefo.takeover.failure_schedule import NEVER

        for event in session.schedule.real:
            if event[2] >= NEVER and event[1] > c + 1:
                event[1] = c + 1
    replay_from(session, trainer, c)
    session.log(
        f"> MeCeFO recovery: recovery path disk (dist_checkpointing): iteration {c} from "
        f"{directory}, optimizer re-sharded over {len(session.gen.replicas)} replicas; "
        f"{seconds:.3f} s"
    )
    session.takeover_info = {
        "recovery_path": "disk",
        "rolled_back_to": c,
        "replayed_to": carried + 1,
        "samples_redone": (carried + 1 - c) * session.args.global_batch_size,
        "disk_load_s": seconds,
    }
    trainer.emit(
        {
            "type": "snapshot_restore",
            "path": "disk",
            "iteration": c,
            "seconds": seconds,
            "directory": directory,
            "reason": why,
            "generation": session.generation,
            "discarded_iterations": list(range(c + 1, carried + 1)),
        }
    )
    session.takeover_pending = False


def replay_from(session: Any, trainer: Any, s: int) -> None:
    """The trainer's state is that of iteration ``s``: keep the carried history up to it
    and rewind the data iterator to its consumed samples."""
    trainer.history = [r for r in session.carry["history"] if r["iteration"] <= s]
    trainer.evals = [r for r in session.carry["evals"] if r.get("iteration", 0) <= s]
    trainer.saved = [i for i in session.carry["saved"] if i <= s]
    trainer.rewind_data(trainer.consumed_samples)
