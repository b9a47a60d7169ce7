"""The rank side: run the example trainer through membership generations.

``run_recoverable(args, make_trainer)`` is what ``pretrain_gpt.py`` calls under the
supervisor. Per generation it waits until this process is a member, meets the other members
in the store, builds the torch.distributed world on the prefix ``world<g>/`` of the
supervisor's store, and lets the trainer build Megatron's parallel state, GPTModel, DDP and
the optimizer in it. :meth:`RecoverySession.on_built` then puts back the local state carried
from the previous world (or heals a joiner from a data-parallel peer), agreed on by an
all-gather of (valid, iteration) over the new world, and hooks the trainer:

* kill injection at each phase (``--mecefo-kill``);
* the commit vote before every optimizer step (:mod:`.commit`; rank 0's also sets the progress
  key);
* DDP's pre-reduction scale fixed to ``1/n`` of the *original* replica count, so with
  ``n - k`` members the re-weighted gradient equals the simulated-failure one;
* at every iteration boundary: a snapshot of RNG and counters and a look at the generation (a
  planned rejoin switches here).

A collective error or an aborted vote ends the generation: the rank exports its state at the
last committed boundary, drops every reference to the old groups (:mod:`.abort`), and waits for
the next generation, which redoes the in-flight iteration under the takeover plan.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import sys
import time
import traceback
from collections import deque
from dataclasses import asdict
from typing import Any, Callable, Deque, Dict, List, Optional

from megatron_mecefo.recovery import records as rec_mod
from megatron_mecefo.recovery.abort import GenerationWatchdog, build_aborter, release_megatron
from megatron_mecefo.recovery.commit import AsyncVoter, StepAborted, abort
from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.fault_injection import KillInjector, parse_kills
from megatron_mecefo.recovery.heartbeat import Heartbeat
from megatron_mecefo.recovery.membership import Generation, JobLayout, MembershipStore
from megatron_mecefo.recovery.membership_schedule import MembershipSchedule
from megatron_mecefo.recovery.state_transfer import (
    boundary_snapshot,
    export_state,
    heal,
    import_state,
)


class RegroupRequest(RuntimeError):
    """The generation changed: leave the world at this iteration boundary."""


class RecoveryAbort(SystemExit):
    """The job cannot continue in-process; the message has been printed."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        _EXIT["code"] = code


DIST_OPT_MESSAGE = (
    "a rank died while training with --use-distributed-optimizer: its optimizer shard died "
    "with it, there is no in-memory snapshot with parity nor a checkpoint in --save/--load to "
    "fall back to, and MeCeFO will not continue with a lost shard. Resume from the last "
    "checkpoint (--load); to survive rank deaths in-process, train with "
    "--mecefo-snapshot-interval K --mecefo-snapshot-redundancy 1 (the survivors rebuild the "
    "shard from their snapshots and parity), save checkpoints (--save DIR --save-interval N: "
    "the survivors fall back to the newest) or train without --use-distributed-optimizer"
)

DIST_OPT_REJOIN_MESSAGE = (
    "a replica cannot rejoin a run with --use-distributed-optimizer (its optimizer shard would "
    "have to be re-sharded over the grown world, which is not implemented); run the supervisor "
    "with --replace never, or resume from the last checkpoint (--load) with every replica"
)


class RecoverySession:
    """Per-process recovery state (see the module docstring).

    Args:
        args: The trainer's parsed flags.
        config: The supervisor's :class:`RecoveryConfig`.
    """

    def __init__(self, args: Any, config: RecoveryConfig) -> None:
        self.args, self.cfg = args, config
        self.slot = int(os.environ["MECEFO_RECOVERY_SLOT"])
        self.inc = int(os.environ.get("MECEFO_RECOVERY_INC", "0"))
        self.ms = MembershipStore.connect(config.store, config.init_timeout_s)
        self.heartbeat = Heartbeat(
            config.store, self.slot, self.inc, config.heartbeat_interval_s
        ).start()
        self.voter = AsyncVoter(config.store, config.poll_interval_s)
        self.layout = JobLayout(
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.data_parallel_size,
        )
        self.ms.set_json("layout", asdict(self.layout))
        kills = parse_kills(
            getattr(args, "mecefo_kill", []) or [],
            self.layout.world_size,
            args.train_iters,
            args.mecefo_config.seed,
        )
        self.injector = KillInjector(
            kills,
            self.slot,
            claim=lambda key: int(self.ms.store.add(f"killclaim/{key}", 1)) == 1,
            before_kill=lambda spec, t: self.ms.set_json(
                f"killed/{self.slot}/{self.inc}", {"t": t, "spec": spec.key}
            ),
        )
        self.gen: Optional[Generation] = None
        self.valid = self.inc == 0
        """Whether this process holds trained state (a joiner or a spare does not)."""
        self.carry: Optional[Dict[str, Any]] = None
        self.boundary: Optional[Dict[str, Any]] = None
        self.schedule: Optional[MembershipSchedule] = None
        self.times: Dict[str, float] = {}
        self.record_pending = False
        self.redone = False
        # Timings of the last TIMINGS_KEPT iterations (bounded: a run may be long).
        self.vote_s: Deque[float] = deque(maxlen=TIMINGS_KEPT)
        """Seconds the training thread waited for each commit decision (after the gradient
        preparation it overlaps; waiting for the slowest member included)."""
        self.vote_last_s: Deque[float] = deque(maxlen=TIMINGS_KEPT)
        """The same wait, for the votes this rank completed: it never waited for a peer, so
        this is the protocol's cost left after the overlap."""
        self.vote_protocol_s: Deque[float] = deque(maxlen=TIMINGS_KEPT)
        """Seconds of the store round trips of the votes this rank completed (overlapped or
        not): what the vote would cost if nothing overlapped it."""
        self.hooks_s: Deque[float] = deque(maxlen=TIMINGS_KEPT)
        """Seconds per iteration in the boundary hooks (:meth:`committed`, :meth:`at_boundary`)."""
        self.iterations_run = 0
        """Iterations this process committed (all of them, unlike the timings kept)."""
        self.watchdog_cpu_s = 0.0
        """CPU seconds of the finished generations' watchdog threads."""
        self.backend = "gloo" if args.device == "cpu" else "nccl"
        self.aborter = build_aborter(self.backend, int(config.store.rsplit(":", 1)[1]))
        self.watchdog: Optional[GenerationWatchdog] = None
        self.rank = -1
        self.snapshots: Any = None
        """The trainer's ``SnapshotManager``: kept across worlds (its slots and parity)."""
        self.takeover_pending = False
        """A rank died under the distributed optimizer: the next world rolls back to the last
        snapshot with parity and rebuilds the lost shards (:meth:`_take_over_from_snapshot`)."""
        self.takeover_info: Optional[Dict[str, Any]] = None
        self.saved_layouts: Dict[int, str] = {}
        """Checkpoint iteration -> this rank's position when it saved it (its per-rank files,
        e.g. the low-rank bases, are read back from there by the disk fallback)."""

    # ------------------------------------------------------------------ helpers
    def log(self, line: str, all_ranks: bool = False) -> None:
        if all_ranks or self.rank == 0:
            print(line, flush=True)

    def sleep(self) -> None:
        time.sleep(self.cfg.poll_interval_s)

    @property
    def generation(self) -> int:
        return -1 if self.gen is None else self.gen.number

    def world_changed(self) -> bool:
        """Whether a failure generation has been announced since this world was built (a
        rank waiting on its peers, e.g. for a snapshot commit, stops waiting)."""
        latest = self.watchdog.latest if self.watchdog is not None else self.generation
        return latest != self.generation and self.ms.generation(latest).at_iteration is None

    def fatal(self, message: str) -> None:
        """End the job with one message (every rank: the store's ``fatal`` key)."""
        self.ms.set_fatal(message)
        if self.rank <= 0:
            print(f"> MeCeFO recovery: error: {message}", flush=True)
        raise RecoveryAbort(3)

    # ------------------------------------------------------------------ membership
    def wait_for_membership(self, after: int) -> Optional[Generation]:
        """The next generation (numbered above ``after``) that has this process as a member;
        ``None`` when training finished meanwhile. Exits on an abort generation."""
        spare_noted = False
        while True:
            if self.ms.get_str("done") is not None:
                return None
            if self.ms.get_str("fatal") is not None:
                raise RecoveryAbort(1)
            number = self.ms.generation_number()
            if number > after:
                gen = self.ms.generation(number)
                if gen.abort:
                    if self.rank == 0 or self.slot == min(gen.spares or (self.slot,)):
                        print(f"> MeCeFO recovery: training aborted: {gen.abort}", flush=True)
                    raise RecoveryAbort(1)
                if gen.members.get(self.slot) == self.inc:
                    return gen
                after = number
                self.valid = False  # a spare's state goes stale; it is healed on rejoin
                self.carry = None
                if self.cfg.orphan == "exit" and self.inc == 0 and number > 0:
                    print(
                        f"> MeCeFO recovery: rank {self.slot} left generation {number}: its "
                        "replica lost a rank (--orphan exit)",
                        flush=True,
                    )
                    self.ms.store.set(f"left/{self.slot}/{self.inc}", "1")
                    raise RecoveryAbort(0)
                if not spare_noted:
                    spare_noted = True
                    print(
                        f"> MeCeFO recovery: rank {self.slot} (incarnation {self.inc}) waits as "
                        f"a spare (generation {number}, replicas {list(gen.replicas)})",
                        flush=True,
                    )
            self.sleep()

    def rendezvous(self, gen: Generation) -> bool:
        """Meet every member in the store before ``init_process_group``; False if the
        generation moved on meanwhile (a member died before arriving)."""
        self.ms.store.set(f"arrive/{gen.number}/{self.slot}", "1")
        keys = [f"arrive/{gen.number}/{s}" for s in gen.members]
        while not self.ms.store.check(keys):
            if self.ms.generation_number() != gen.number:
                return False
            self.sleep()
        return True

    def init_world(self, gen: Generation) -> None:
        import datetime

        import torch.distributed as dist

        rank = self.slot if gen.number == 0 else gen.rank_of(self.slot)
        host, port = self.cfg.store.rsplit(":", 1)
        store = dist.TCPStore(
            host,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=self.cfg.init_timeout_s),
        )
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"world{gen.number}/", store),
            rank=rank,
            world_size=gen.world_size,
            timeout=datetime.timedelta(seconds=self.cfg.collective_timeout_s),
        )
        self.rank = rank
        self.gen = gen

    # ------------------------------------------------------------------ trainer hooks
    def parallel_state_kwargs(self) -> Dict[str, Any]:
        """Extra ``initialize_model_parallel`` arguments: the backstop timeout."""
        return {"distributed_timeout_minutes": self.cfg.collective_timeout_s / 60.0}

    def replica_layout(self) -> tuple:
        """(this rank's original data-parallel index, the original replica count)."""
        return self.layout.replica_of(self.slot), self.layout.dp

    def wrap_schedule(self, base: Any) -> MembershipSchedule:
        if self.schedule is None:
            self.schedule = MembershipSchedule(base)
        return self.schedule

    def metrics_mode(self) -> str:
        return "a" if self.generation > 0 else "w"

    def on_built(self, trainer: Any) -> None:
        """The trainer is built in the new world: restore/heal, agree, hook (module doc)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        gen = self.gen
        assert gen is not None
        n = self.layout.dp
        for ddp in trainer.model:
            for buffer in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
                for bucket in buffer.buckets:
                    if bucket.gradient_scaling_factor != 1.0:  # 1.0: per-token loss
                        bucket.gradient_scaling_factor = 1.0 / n
        self.times["constructed"] = time.time()
        # Trained state: the carry of the previous world, or a fresh start in the first one.
        # The carry is kept until this world is established: if it fails before (e.g. a
        # joiner dies during the heal), the next world imports it again.
        self.valid = self.carry is not None or (gen.number == 0 and self.inc == 0)
        if self.carry is not None and self.takeover_pending:
            self._take_over_from_snapshot(trainer)
        elif self.carry is not None:
            import_state(trainer, self.carry)
        # Agree on the state: the members with valid state at the highest iteration are the
        # sources; everyone else in their data-parallel group is healed from them.
        mine = (self.slot, self.valid, trainer.iteration if self.valid else -1)
        every: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (mine, self.schedule.real if self.schedule else []))
        infos = [e[0] for e in every]
        target = max(it for _, ok, it in infos)
        if target < 0:
            raise RuntimeError("no member holds trained state; cannot heal")
        authority = next(i for i, (_, ok, it) in enumerate(infos) if ok and it == target)
        if self.schedule is not None:
            self.schedule.real = [list(e) for e in every[authority][1]]
        dp_group = ps.get_data_parallel_group()
        dp_ranks = dist.get_process_group_ranks(dp_group)
        needs = [not (infos[r][1] and infos[r][2] == target) for r in dp_ranks]
        any_heal = [not (ok and it == target) for _, ok, it in infos]
        if any(any_heal) and self.args.use_distributed_optimizer:
            self.fatal(DIST_OPT_REJOIN_MESSAGE)
        if any(any_heal):
            # Every data-parallel group runs the same number of broadcasts (one, or none).
            if any(needs):
                src = next(r for r, need in zip(dp_ranks, needs, strict=True) if not need)
                receiving = needs[dp_ranks.index(dist.get_rank())]
                if receiving:
                    self.injector.phase("heal", target + 1)
                state = None
                if dist.get_rank() == src:
                    state = export_state(trainer, self.boundary or boundary_snapshot(trainer))
                heal(trainer, state, src, dp_group, receiving)
            self.times["healed"] = time.time()
            self._check_replicas_identical(trainer, dp_group)
        self.valid = True
        self.carry = None
        self.boundary = boundary_snapshot(trainer)
        if self.schedule is not None and gen.number > 0:
            for line in self.schedule.apply_generation(gen.replicas, trainer.iteration + 1):
                self.log(f"> MeCeFO recovery: {line}")
        self._hook(trainer)
        self.times["built"] = time.time()
        self.record_pending = gen.number > 0
        # The watchdog sleeps in a store wait on the next generation's key (woken the moment
        # it is published, no polling), on a client of its own: a waiting client holds its
        # lock, and the previous generation's watchdog may still be in its last wait.
        watch = MembershipStore.connect(self.cfg.store, self.cfg.init_timeout_s)
        self.watchdog = GenerationWatchdog(
            watch.generation_number,
            gen.number,
            self.aborter,
            WATCHDOG_WAIT_S,
            is_failure=lambda n: watch.generation(n).at_iteration is None,
            wait_after=watch.wait_generation_after,
        ).start()

    def _take_over_from_snapshot(self, trainer: Any) -> None:
        """Distributed optimizer, after a real death: every member rolls back to the newest
        snapshot held with parity by all, the lost members' slots are rebuilt from their
        peers and parity, and the optimizer is re-sharded over this world's data-parallel
        group. When the snapshots cannot serve (more than m members of a group lost, or no
        snapshot with parity held by all: one verdict for the whole world), the members load
        the newest disk checkpoint instead (:meth:`_fall_back_to_disk`). The iterations after
        the restored one are then replayed with the dead replicas failed from its next
        iteration (the carry's history of them is dropped)."""
        from megatron.core import parallel_state as ps

        from megatron_mecefo.snapshot.erasure import SnapshotLost

        manager = trainer.snapshots
        state = trainer._snapshot_state()
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
            self._fall_back_to_disk(trainer, why)
            return
        s, carried = served["iteration"], self.carry["iteration"]
        trainer.iteration = int(state.counters["iteration"])
        trainer.consumed_samples = int(state.counters["consumed_samples"])
        ctrl = getattr(trainer, "controller", None)
        for key, value in state.extra.get("controller", {}).items():
            setattr(ctrl, key, value)
        self._replay_from(trainer, s)
        self.takeover_info = {
            "recovery_path": "peers+parity",
            "rolled_back_to": s,
            "replayed_to": carried + 1,  # up to the iteration that was in flight
            "samples_redone": (carried + 1 - s) * self.args.global_batch_size,
            "snapshot_restore_s": served["seconds"],
        }
        trainer._emit(
            {
                "type": "snapshot_restore",
                **served,
                "generation": self.generation,
                "discarded_iterations": list(range(s + 1, carried + 1)),
            }
        )
        self.takeover_pending = False

    def _fall_back_to_disk(self, trainer: Any, why: str) -> None:
        """Recovery path 4: load the newest checkpoint of ``--save``/``--load`` at or before
        the carried iteration into this world (the distributed optimizer re-sharded over its
        data-parallel size), and replay from the checkpoint's next iteration; without one,
        stop with a message naming the flags. Never continues with a lost shard."""
        import torch.distributed as dist

        carried = self.carry["iteration"]
        find = getattr(trainer, "recovery_checkpoint", None)
        found = find(carried) if find is not None else None
        # One file system, but one verdict all the same: every rank loads the same checkpoint
        # or none does.
        every: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, found)
        if found is None or any(e != every[0] for e in every):
            self.fatal(
                f"{why}, and there is no checkpoint to fall back to (neither --save nor --load "
                f"holds one at or before iteration {carried}): the job stops rather than "
                "continue with a lost optimizer shard. "
                "Save checkpoints (--save DIR --save-interval N) to fall back to disk, or raise "
                "--mecefo-snapshot-redundancy"
            )
        directory, c = found
        self.log(f"> MeCeFO recovery: {why}: falling back to the checkpoint of iteration {c}")
        seconds = trainer.load_recovery_checkpoint(directory, self.saved_layouts.get(c))
        if trainer.snapshots is not None:
            trainer.snapshots.forget()  # they belong to the discarded iterations
        history = [r for r in self.carry["history"] if r["iteration"] <= c]
        ctrl = getattr(trainer, "controller", None)
        if ctrl is not None:  # its running counts at c, as the uninterrupted run has them
            plans = [r["mecefo"] for r in history if "mecefo" in r]
            ctrl.degraded_iterations = sum(int(bool(p.get("degraded"))) for p in plans)
            ctrl.fallback_iterations = sum(int(bool(p.get("fallback"))) for p in plans)
            ctrl.samples_processed = sum(int(p.get("samples_processed", 0)) for p in plans)
            ctrl.samples_skipped = sum(int(p.get("samples_skipped", 0)) for p in plans)
        if self.schedule is not None:  # replicas lost after c are down from c + 1 in the replay
            from megatron_mecefo.takeover.failure_schedule import NEVER

            for event in self.schedule.real:
                if event[2] >= NEVER and event[1] > c + 1:
                    event[1] = c + 1
        self._replay_from(trainer, c)
        self.log(
            f"> MeCeFO recovery: recovery path disk (dist_checkpointing): iteration {c} from "
            f"{directory}, optimizer re-sharded over {len(self.gen.replicas)} replicas; "
            f"{seconds:.3f} s"
        )
        self.takeover_info = {
            "recovery_path": "disk",
            "rolled_back_to": c,
            "replayed_to": carried + 1,
            "samples_redone": (carried + 1 - c) * self.args.global_batch_size,
            "disk_load_s": seconds,
        }
        trainer._emit(
            {
                "type": "snapshot_restore",
                "path": "disk",
                "iteration": c,
                "seconds": seconds,
                "directory": directory,
                "reason": why,
                "generation": self.generation,
                "discarded_iterations": list(range(c + 1, carried + 1)),
            }
        )
        self.takeover_pending = False

    def _replay_from(self, trainer: Any, s: int) -> None:
        """The trainer's state is that of iteration ``s``: keep the carried history up to it
        and rewind the data iterator to its consumed samples."""
        trainer.history = [r for r in self.carry["history"] if r["iteration"] <= s]
        trainer.evals = [r for r in self.carry["evals"] if r.get("iteration", 0) <= s]
        trainer.saved = [i for i in self.carry["saved"] if i <= s]
        trainer.train_iter = trainer._iterators(trainer.train_ds, trainer.consumed_samples)

    def _check_replicas_identical(self, trainer: Any, dp_group: Any) -> None:
        """After a heal: parameters and optimizer state hash alike on every DP replica."""
        import torch
        import torch.distributed as dist

        from megatron_mecefo.recovery.state_transfer import state_digest

        digest = bytes.fromhex(state_digest(trainer))
        mine = torch.tensor(list(digest), dtype=torch.uint8)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(dp_group))]
        dist.all_gather(gathered, mine, group=dp_group)
        if not all(torch.equal(g, gathered[0]) for g in gathered):
            raise RuntimeError("heal: data-parallel replicas differ after the state copy")
        self.log(
            f"> MeCeFO recovery: healed; parameters and optimizer state identical on every "
            f"data-parallel replica (sha256 {digest.hex()[:16]})"
        )

    def _hook(self, trainer: Any) -> None:
        """Phase hooks (kill injection) and the commit vote around the trainer's calls."""
        session = self
        fwd_bwd = trainer.forward_backward

        @functools.wraps(fwd_bwd)
        def forward_backward(*, forward_step_func: Callable, **kw: Any) -> Any:
            if kw.get("forward_only", False):
                return fwd_bwd(forward_step_func=forward_step_func, **kw)
            iteration = trainer.iteration + 1
            fired = {"backward": False}

            def step(data_iterator: Any, model: Any, *a: Any, **k: Any) -> Any:
                session.injector.phase("forward", iteration)
                output, loss_func = forward_step_func(data_iterator, model, *a, **k)
                if output.requires_grad and not fired["backward"]:
                    fired["backward"] = True
                    output.register_hook(lambda g: session.injector.phase("backward", iteration))
                return output, loss_func

            return fwd_bwd(forward_step_func=step, **kw)

        trainer.forward_backward = forward_backward
        finalize = trainer.config.finalize_model_grads_func

        @functools.wraps(finalize)
        def finalize_model_grads(*a: Any, **k: Any) -> Any:
            session.injector.phase("grad-sync", trainer.iteration + 1)
            return finalize(*a, **k)

        trainer.config.finalize_model_grads_func = finalize_model_grads
        optimizer = trainer.optimizer
        optimizer_step, ready_step = optimizer.step, optimizer.step_with_ready_grads
        pending: Dict[str, Any] = {}

        def await_decision() -> None:
            future, iteration = pending.pop("vote")
            t_wait = time.perf_counter()
            commit, completed, protocol_s = future.result()
            waited = time.perf_counter() - t_wait
            session.vote_s.append(waited)
            if completed:
                session.vote_last_s.append(waited)
                session.vote_protocol_s.append(protocol_s)
            if not commit:
                raise StepAborted(f"iteration {iteration}: not every member finished its sync")

        def step_after_commit(*a: Any, **k: Any) -> Any:
            # The vote runs while the optimizer prepares the gradients (main grads, norm,
            # clipping: nothing a redo needs); the update itself waits for the decision.
            iteration, gen = trainer.iteration + 1, session.gen
            future = session.voter.start(
                gen.number, iteration, session.slot, gen.members, report_progress=session.rank == 0
            )
            pending["vote"] = (future, iteration)
            try:
                result = optimizer_step(*a, **k)
                if "vote" in pending:  # no update (inf/nan in the grads): agree all the same
                    await_decision()
                return result
            except BaseException:
                if pending.pop("vote", None) is not None and not future.done():
                    abort(session.ms, gen.number, iteration, len(gen.members))  # wakes the peers
                raise

        def update_after_commit(*a: Any, **k: Any) -> Any:
            if "vote" in pending:
                iteration = pending["vote"][1]
                await_decision()
                session.injector.phase("optimizer", iteration)
            return ready_step(*a, **k)

        optimizer.step, optimizer.step_with_ready_grads = step_after_commit, update_after_commit

    def committed(self, trainer: Any) -> None:
        """Right after a committed iteration: snapshot and the pending record (rank 0's vote
        worker has set the progress key at the commit)."""
        t0 = time.perf_counter()
        self.boundary = boundary_snapshot(trainer)
        self.hooks_s.append(time.perf_counter() - t0)
        self.iterations_run += 1
        if self.record_pending:
            self.record_pending = False
            self.times["done"] = time.time()
            self._write_record(trainer)

    def at_boundary(self, trainer: Any) -> None:
        """At the end of an iteration (after logging, eval, save): the generation check."""
        t0 = time.perf_counter()
        it = trainer.iteration
        # The watchdog thread polls the generation; a planned switch is announced several
        # iterations ahead, so its cached value is recent enough (no store round trip here).
        number = self.watchdog.latest if self.watchdog is not None else self.generation
        if number != self.generation:
            gen = self.ms.generation(number)
            if gen.at_iteration is None or it + 1 >= gen.at_iteration:
                raise RegroupRequest(f"generation {number} ({gen.reason}) at iteration {it + 1}")
        if self.hooks_s:
            self.hooks_s[-1] += time.perf_counter() - t0
        self.injector.phase("between", it)

    def _write_record(self, trainer: Any) -> None:
        gen = self.gen
        self.ms.set_json(f"rt/{gen.number}/{self.slot}", self.times)
        if self.rank != 0:
            return
        keys = [f"rt/{gen.number}/{s}" for s in gen.members]
        deadline = time.time() + self.cfg.collective_timeout_s
        while not self.ms.store.check(keys) and time.time() < deadline:
            self.sleep()
        times = {s: self.ms.get_json(f"rt/{gen.number}/{s}") or {} for s in gen.members}
        # A failure generation that was never formed (a replacement came up during the
        # regroup, so a planned generation superseded it before its rendezvous) still gets
        # its own record, timed by this generation's members.
        for skipped in self.ms.unformed_failures(gen.number):
            self._emit_record(trainer, skipped, times, superseded_by=gen.number)
        self._emit_record(trainer, gen, times)

    def _emit_record(
        self, trainer: Any, gen: Generation, times: Dict[int, Any], superseded_by: int = 0
    ) -> None:
        kills, deaths = {}, {}
        for s in gen.lost:
            inc = self._last_inc(s)
            k = self.ms.get_json(f"killed/{s}/{inc}")
            if k:
                kills[s] = k["t"]
            d = self.ms.dead_info(s, inc)
            if d:
                deaths[s] = d
        record = rec_mod.build_record(
            gen,
            times,
            kills,
            deaths,
            trainer.iteration,
            redone=gen.at_iteration is None,
            global_batch_size=self.args.global_batch_size,
        )
        if superseded_by:
            record["superseded_by"] = superseded_by
        if self.takeover_info is not None and not superseded_by:
            record.update(self.takeover_info)
            self.takeover_info = None
        self.ms.set_json(f"record/{gen.number}", record)
        trainer._emit(record)
        rec_mod.append_jsonl(self.cfg.records_file, record)
        print(rec_mod.log_line(record), flush=True)

    def _last_inc(self, slot: int) -> int:
        text = self.ms.get_str(f"inc/{slot}")
        inc = int(text) if text else 0
        while inc > 0 and self.ms.dead_info(slot, inc) is None:
            inc -= 1
        return inc

    def summary_rows(self) -> List[tuple]:
        rows = []
        if self.vote_s:
            votes = sorted(self.vote_s)
            rows.append(
                (
                    "commit vote",
                    f"p50 {1000 * votes[len(votes) // 2]:.1f} ms, max {1000 * votes[-1]:.1f} ms"
                    f" per iteration ({len(votes)} votes on rank 0)",
                )
            )
        records = []
        for g in range(1, self.generation + 1):
            r = self.ms.get_json(f"record/{g}")
            if r:
                records.append(r)
        return rows + rec_mod.summary_rows(records)

    def armed_cost(self, trainer: Any) -> Dict[str, Any]:
        """What the armed supervisor cost this rank in a run without failures: the commit
        votes this rank completed (no waiting for a peer: the training thread's wait for the
        decision after the overlap, and the store round trips themselves), the boundary
        hooks, and the CPU of the heartbeat, watchdog and vote threads; with the step time.
        ``benchmarks/recovery_latency.py`` aggregates these over the ranks."""
        watchdog_cpu = self.watchdog_cpu_s + (self.watchdog.cpu_s if self.watchdog else 0.0)
        steps = [r["step_time_s"] for r in trainer.history if r.get("type") == "train"]
        return {
            "type": "armed_cost",
            "slot": self.slot,
            "iterations": self.iterations_run,
            "vote_s": list(self.vote_s),
            "vote_last_s": list(self.vote_last_s),
            "vote_protocol_s": list(self.vote_protocol_s),
            "hooks_s": list(self.hooks_s),
            "thread_cpu_s": self.heartbeat.cpu_s + watchdog_cpu + self.voter.cpu_s,
            "thread_cpu_split_s": {
                "heartbeat": self.heartbeat.cpu_s,
                "watchdog": watchdog_cpu,
                "vote": self.voter.cpu_s,
            },
            "process_cpu_s": time.process_time(),
            "step_time_s": steps,
        }

    # ------------------------------------------------------------------ leaving a world
    def leave(self, trainer: Any, planned: bool) -> None:
        """Keep the state of the last boundary, drop every reference to the world's groups."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog_cpu_s += self.watchdog.cpu_s
            self.watchdog = None
        if self.snapshots is not None:
            self.snapshots.abandon()  # the copy in flight reads tensors released below
        if trainer is not None:
            self.saved_layouts.update(getattr(trainer, "saved_layouts", {}))
            if self.valid:
                self.carry = export_state(trainer, self.boundary or boundary_snapshot(trainer))
            self.times["exported"] = time.time()
            release_megatron(trainer.model_chunks, trainer.model, trainer.config)
            trainer.__dict__.clear()
        self.times["dropped"] = time.time()
        self.aborter.destroy()  # ends with gc.collect(): the sockets close now
        self.times["released"] = time.time()
        self.times.update(getattr(self.aborter, "last_split", {}))
        if os.environ.get("MECEFO_RECOVERY_DEBUG"):
            _report_stale_groups(self.slot)


def _report_stale_groups(slot: int) -> None:
    """Debug: print the objects that still reference a ProcessGroup after leaving."""
    import torch.distributed as dist

    found = 0
    for obj in gc.get_objects():
        items = []
        if isinstance(obj, dict):
            items = list(obj.values())
        elif isinstance(obj, (list, tuple)):
            items = list(obj)
        elif hasattr(obj, "__dict__") and isinstance(getattr(obj, "__dict__", None), dict):
            items = list(obj.__dict__.values())
        if any(isinstance(v, dist.ProcessGroup) for v in items):
            found += 1
            if found <= 12:
                keys = (
                    obj.get("__name__") if isinstance(obj, dict) else getattr(obj, "__name__", "")
                )
                if isinstance(obj, dict):
                    keys = (keys, [k for k, v in obj.items() if isinstance(v, dist.ProcessGroup)])
                print(f"[stale group ref rank {slot}] {type(obj).__name__} {keys}", flush=True)
    print(f"[stale group ref rank {slot}] {found} holders", flush=True)


TIMINGS_KEPT = 10_000
"""Per-iteration timings (votes, hooks) kept for the summary and the armed-cost report."""

WATCHDOG_WAIT_S = 600.0
"""Longest single store wait of a generation watchdog. Long, because torch logs a warning at
every store wait that times out; a stopped watchdog lingers in its wait until the next
generation is published (which wakes it) or this passes, harmlessly (own client, no abort)."""


def run_recoverable(args: Any, make_trainer: Callable[[RecoverySession], Any]) -> Any:
    """Train under the supervisor; returns the trainer that finished, or exits (module doc)."""
    config = RecoveryConfig.from_env()
    assert config is not None
    standby = os.environ.get("MECEFO_RECOVERY_STANDBY")
    if standby:  # a warm standby: import now, wait for the slot of a dead rank
        _warm_up()
        ms = MembershipStore.connect(config.store, config.init_timeout_s)
        # Blocks in the store until the supervisor assigns a slot (no polling: idle standbys
        # took the store's server thread from the ranks); the supervisor ends it with the job.
        while (assigned := ms.get_json(f"assign/{standby}")) is None:
            if ms.get_str("done") is not None or ms.get_str("fatal") is not None:
                raise SystemExit(0)
            ms.wait_for(f"assign/{standby}", config.init_timeout_s)
        os.environ.update(
            MECEFO_RECOVERY_SLOT=str(assigned["slot"]),
            MECEFO_RECOVERY_INC=str(assigned["inc"]),
            RANK=str(assigned["slot"]),
        )
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
    gc.freeze()
    session.ms.mark_ready(session.slot, session.inc, {"pid": os.getpid(), "t": time.time()})
    after = -1
    while True:
        gen = session.wait_for_membership(after)
        if gen is None:
            print(f"> MeCeFO recovery: rank {session.slot}: training finished; exiting", flush=True)
            raise RecoveryAbort(0)
        after = gen.number
        session.times["membership"] = time.time()
        if not session.rendezvous(gen):
            continue
        session.times["arrived"] = time.time()
        trainer, outcome, error = None, "failed", ""
        try:
            session.init_world(gen)
            session.times["world"] = time.time()
            trainer = make_trainer(session)
            outcome = _train(trainer)
        except RegroupRequest:
            outcome = "planned"
        except (RuntimeError, OSError) as err:  # gloo: "Connection closed by peer", timeouts
            outcome, error = "failed", f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            if os.environ.get("MECEFO_RECOVERY_TRACE"):
                traceback.print_exc()
        if outcome == "done":
            session.ms.store.set("done", "1")
            session.heartbeat.stop()
            rec_mod.append_jsonl(session.cfg.records_file, session.armed_cost(trainer))
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
            session.ms.report_error(gen.number, session.slot, error)
            print(
                f"> MeCeFO recovery: rank {session.slot} left generation {gen.number}: {error}",
                flush=True,
            )
        failed_iteration = trainer.iteration + 1 if trainer is not None else 0
        session.leave(trainer, planned=outcome == "planned")
        trainer = None
        if outcome == "failed":
            session.injector.phase("regroup", failed_iteration)


def _has_checkpoint(args: Any) -> bool:
    """Whether ``--save`` or ``--load`` names a checkpoint (a tracker file): the disk fallback
    of a death under the distributed optimizer (the next world checks it and agrees)."""
    return any(
        d and os.path.isfile(os.path.join(d, "latest_checkpointed_iteration.txt"))
        for d in (getattr(args, "save", None), getattr(args, "load", None))
    )


_EXIT = {"code": 0}


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


def _train(trainer: Any) -> str:
    trainer.train()
    return "done"
