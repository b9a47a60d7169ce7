"""The rank side's generation loop: ``run_recoverable(args, make_trainer)``.

A trainer calls it under the supervisor (``MECEFO_RECOVERY`` set). Per membership generation
it waits until this process is a member, meets the other members in the store, builds the
torch.distributed world on the prefix ``world<g>/`` of the supervisor's store, and runs the
trainer that ``make_trainer(session)`` returns. The trainer calls
:meth:`~.session.RecoverySession.on_built` once its model and optimizer exist in the world
(restore, heal, hooks). A collective error (whatever exception the trainer wrapped it in:
:mod:`.failures`), an aborted world or an aborted vote ends the generation: the rank
keeps its state at the last committed boundary, drops the world (:meth:`~.session.
RecoverySession.leave`) and waits for the next generation, which redoes the in-flight
iteration under the takeover plan. ``training finished`` ends the loop with the trainer.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
import traceback
import weakref
from typing import Any, Callable, List, NoReturn, Optional

from megatron_mecefo.recovery import failures, reporting
from megatron_mecefo.recovery import records as rec_mod
from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.heartbeat import SUPERVISOR_ENV
from megatron_mecefo.recovery.membership import Generation, MembershipStore
from megatron_mecefo.recovery.session import (
    _EXIT,
    DIST_OPT_MESSAGE,
    RecoveryAbort,
    RecoverySession,
    RegroupRequest,
)


def run_recoverable(
    args: Any,
    make_trainer: Callable[[RecoverySession], Any],
    prepare: Optional[Callable[[], None]] = None,
) -> Any:
    """Train under the supervisor; returns the trainer that finished, or exits (module doc).

    ``prepare()`` runs once, before the process says it is ready: the trainer's one-time work
    that needs no world (e.g. compiling kernels). A joiner does it there, off the clock of the
    survivors, who otherwise wait for it inside the rejoin's first collective; a warm standby
    on the CPU does it before it is even assigned a slot (on a GPU the slot picks the
    device the work must be done on).
    """
    config = RecoveryConfig.from_env()
    assert config is not None
    standby = os.environ.get("MECEFO_RECOVERY_STANDBY")
    if standby:  # a warm standby: import now, wait for the slot of a dead rank
        _warm_up()
        if prepare is not None and args.device == "cpu":  # a GPU's is known with the slot
            prepare()
            prepare = None
        await_assignment(MembershipStore.connect(config.store, config.init_timeout_s), standby,
                         config.init_timeout_s)  # fmt: skip
    # Worlds left after a failure can leave gloo threads in leaked C++ objects, which abort
    # ("terminate called without an active exception") when the interpreter tears them down
    # at exit: end the process right after the Python-level exit handlers instead.
    atexit.register(_exit_now)
    sys.excepthook = _record_crash
    try:
        session = RecoverySession(args, config)
    except Exception as err:
        print(f"error: {err}", file=sys.stderr)
        raise RecoveryAbort(2) from None
    # Import what the trainer imports now (a joiner: before it says ready, not inside the
    # switch window), then freeze those objects out of the garbage collector: the full
    # collection that closes an old world's sockets then scans only what was built since
    # (measured at DP4 under load: 0.8 s -> see the recovery records' release_split_s).
    _warm_up()
    if prepare is not None:
        prepare()
    gc.freeze()
    # The supervisor that started this process (its heartbeat: coordinator.py) and can kill it.
    supervisor = os.environ.get(SUPERVISOR_ENV)
    session.ms.mark_ready(
        session.slot, session.inc, {"pid": os.getpid(), "t": time.time(), "supervisor": supervisor}
    )
    after = -1
    # The iteration the last world left off at (a failure or a planned rejoin), for the
    # recovery-phase kills of fault_injection.py: kept when a world fails before its trainer
    # was built.
    recovering = 0
    # The trainers of this process's worlds, kept (weakly) only for the test hook.
    earlier: Optional[List[weakref.ref]] = [] if os.environ.get(EARLIER_TRAINERS_ENV) else None
    while True:
        session.start_warm_heap()
        gen = session.wait_for_membership(after)
        if gen is None:
            print(f"> MeCeFO recovery: rank {session.slot}: training finished; exiting", flush=True)
            raise RecoveryAbort(0)
        after = gen.number
        session.times["membership"] = time.time()
        if not session.rendezvous(gen):
            continue
        session.times["arrived"] = time.time()
        session.release_warm_heap()
        trainer, outcome, error = None, "failed", ""
        report_earlier_trainers(session.slot, earlier)
        try:
            session.injector.phase("world", recovering)
            session.init_world(gen)
            session.times["world"] = time.time()
            session.injector.phase("groups", recovering)
            trainer = make_trainer(session)
            if earlier is not None:
                earlier.append(weakref.ref(trainer))
            trainer.train()
            outcome = "done"
        except RegroupRequest:
            outcome = "planned"
        except Exception as err:  # noqa: BLE001  (classified: failures.generation_failure)
            # gloo's "Connection closed by peer", timeouts, an aborted world: whatever
            # Megatron-LM or the user's code wrapped them in, the generation failed, not the
            # rank (which, exiting, would be counted as a death).
            if not failures.generation_failure(err, world_aborted(session, gen)):
                raise
            outcome, error = "failed", describe(err)
            # Not a loop variable: one would outlive the except block and, through the
            # exception's traceback, keep the failed step's frames (the old world's model,
            # its activations) resident until the next failure: measured +13% of a survivor's
            # steady memory after a rejoin at 0.1 GiB of state per rank.
            dead_loader = next((c for c in failures.causes(err) if loader_worker_died(c)), None)
            if dead_loader is not None:
                exit_for_loader_worker(session.slot, first_line(dead_loader))
            if os.environ.get("MECEFO_RECOVERY_TRACE"):
                traceback.print_exc()
        if outcome == "done":
            session.ms.store.set("done", "1")
            session.heartbeat.stop()
            rec_mod.append_jsonl(session.cfg.records_file, reporting.armed_cost(session, trainer))
            return trainer
        now = time.time()
        if outcome == "failed" and args.use_distributed_optimizer and session.valid:
            snaps = session.snapshots
            parity = snaps is not None and snaps.config.redundancy and snaps.parity_snapshots()
            if not parity and not _has_checkpoint(args):
                session.ms.set_fatal(DIST_OPT_MESSAGE)
                print(f"> MeCeFO recovery: error: {DIST_OPT_MESSAGE}", flush=True)
                raise RecoveryAbort(3)
            # The next world rebuilds the lost shards from the snapshots' parity, or loads the
            # disk checkpoint when they cannot serve.
            session.takeover_pending = True
        session.times = {"detect": now, "left": now}
        if outcome == "failed":
            try:  # a hint for the coordinator (a death is found without it): best effort
                session.ms.report_error(gen.number, session.slot, error)
            except RuntimeError as err:
                reason = str(err).partition("\n")[0][:200]  # an empty message has no line 0
                error += f" (not reported: {reason})"
            print(
                f"> MeCeFO recovery: rank {session.slot} left generation {gen.number}: {error}",
                flush=True,
            )
        failed_iteration = trainer.iteration + 1 if getattr(trainer, "built", False) else 0
        recovering = failed_iteration or recovering
        session.leave(trainer, planned=outcome == "planned")
        trainer = None
        if outcome == "failed":
            session.injector.phase("regroup", failed_iteration)


EARLIER_TRAINERS_ENV = "MECEFO_TEST_EARLIER_TRAINERS"
"""Test hook: set to 1, a rank prints at the start of each world after its first how many
trainers of its earlier worlds are still alive after a full collection
(``[mecefo-test] slot=S earlier trainers alive: N``; 0 unless something still holds one: a
kept exception's traceback did, with the old world's model and activations)."""


def report_earlier_trainers(slot: int, earlier: Optional[List[weakref.ref]]) -> None:
    """With :data:`EARLIER_TRAINERS_ENV` set (``earlier`` a list) and a trainer built before:
    print how many of ``earlier`` survive ``gc.collect()``."""
    if not earlier:
        return
    gc.collect()
    alive = sum(ref() is not None for ref in earlier)
    print(f"[mecefo-test] slot={slot} earlier trainers alive: {alive}", flush=True)


def world_aborted(session: RecoverySession, gen: Generation) -> bool:
    """Whether ``gen``'s world was ended from outside: its watchdog aborted it, or the store
    holds a failure generation after it (the watchdog may not have looked yet)."""
    watchdog = session.watchdog
    if watchdog is not None and watchdog.fired is not None:
        return True
    try:
        latest = session.ms.generation_number()
        return any(
            session.ms.generation(n).at_iteration is None for n in range(gen.number + 1, latest + 1)
        )
    except Exception:  # noqa: BLE001  (the store is being taken over: the error's chain decides)
        return False


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (an empty message has no line 0)."""
    return str(err).partition("\n")[0]


def describe(err: BaseException) -> str:
    """``Type: first line`` of ``err``, with the collective error it wraps, if any."""
    text = f"{type(err).__name__}: {first_line(err)[:300]}"
    root = failures.root_collective_error(err)
    if root is not None:
        text += f" (from {type(root).__name__}: {first_line(root)[:200]})"
    return text


def loader_worker_died(err: BaseException) -> bool:
    """Whether ``err`` is torch's report of a dead DataLoader worker ("DataLoader worker (pid
    N) is killed by signal: Killed", "... exited unexpectedly"), raised in the training thread
    by the loader's SIGCHLD handler or its next fetch."""
    return "DataLoader worker (pid" in str(err)


def exit_for_loader_worker(slot: int, what: str) -> NoReturn:
    """A data-loader worker of this rank died: the rank exits at once, so that the supervisor
    reports a death and the survivors take its replica over as after a SIGKILL (about a
    second). Left to the generation loop, the rank would leave the world with no rank lost:
    its peers' collectives fail, the coordinator waits out its error timeout and forms a
    generation with nobody lost (measured: regroup 27.3 s). Restarting the loader in place
    would need every rank to agree on the batch it was fetching; a rank's death is already
    the exact, tested path (and ``--replace`` brings the rank back)."""
    print(
        f"> MeCeFO recovery: rank {slot}: a data-loader worker died ({what[:200]}); the rank "
        "exits so that its replica is taken over",
        flush=True,
    )
    sys.stderr.flush()
    os._exit(LOADER_WORKER_EXIT)


LOADER_WORKER_EXIT = 75
"""Exit code of a rank whose data-loader worker died (EX_TEMPFAIL: a replacement may succeed)."""


def await_assignment(ms: MembershipStore, standby: str, timeout_s: float) -> None:
    """A warm standby: wait for the slot the supervisor assigns it (``assign/<standby>``),
    then take that slot's identity in this process's environment: ``RANK``, the incarnation
    and ``LOCAL_RANK``, which picks the device (``torch.cuda.set_device``), before the trainer
    touches CUDA. Exits when the job ends first."""
    # Blocks in the store until the supervisor assigns a slot (no polling: idle standbys took
    # the store's server thread from the ranks); the supervisor ends it with the job.
    while (assigned := ms.get_json(f"assign/{standby}")) is None:
        if ms.get_str("done") is not None or ms.get_str("fatal") is not None:
            raise SystemExit(0)
        ms.wait_for(f"assign/{standby}", timeout_s)
    os.environ.update(
        MECEFO_RECOVERY_SLOT=str(assigned["slot"]),
        MECEFO_RECOVERY_INC=str(assigned["inc"]),
        RANK=str(assigned["slot"]),
        LOCAL_RANK=str(assigned["local_rank"]),
    )


def _has_checkpoint(args: Any) -> bool:
    """Whether ``--save`` or ``--load`` names a checkpoint (a tracker file): the disk fallback
    of a death under the distributed optimizer (the next world checks it and agrees)."""
    return any(
        failures.tracked_iteration(d) is not None
        for d in (getattr(args, "save", None), getattr(args, "load", None))
    )


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT["code"])


def _record_crash(exc_type: Any, exc: Any, tb: Any, _hook: Any = sys.excepthook) -> None:
    if isinstance(exc, SystemExit):
        _EXIT["code"] = exc.code if isinstance(exc.code, int) else 1
    else:
        _EXIT["code"] = 1
    _hook(exc_type, exc, tb)


def _warm_up() -> None:
    """Import what building the trainer imports (about 10 s of a cold start under load)."""
    import importlib

    for name in (
        "megatron.core.models.gpt",
        "megatron.core.distributed",
        "megatron.core.optimizer",
        "megatron.core.optimizer_param_scheduler",
        "megatron.core.pipeline_parallel",
        "megatron.core.transformer.transformer_config",
        "megatron_mecefo.data",
        "megatron_mecefo.gpt.layer_specs",
        "megatron_mecefo.techniques.specs",
        "megatron_mecefo.takeover.controller",
        "megatron_mecefo.runtime",
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
