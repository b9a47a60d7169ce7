"""The rank side's per-process recovery state: :class:`RecoverySession`.

One session lives through every membership generation of a rank (the loop is in
:mod:`.generations`). It holds the membership store, the heartbeat, the commit voter and the
state carried between worlds, and it works on any :class:`~.trainer.RecoverableTrainer`. Once
the trainer's model and optimizer exist in a new world, :meth:`RecoverySession.on_built` puts
back the local state carried from the previous world (or heals a joiner from a data-parallel
peer; a death under the distributed optimizer goes through :mod:`.restore`), agreed on by an
all-gather of (valid, iteration) over the new world, and hooks the trainer
(:mod:`.step_hooks`):

* kill injection at each phase (``--mecefo-kill``);
* the commit vote before every optimizer step (:mod:`.commit`; rank 0's also sets the progress
  key);
* DDP's pre-reduction scale fixed to ``1/n`` of the *original* replica count, so with
  ``n - k`` members the re-weighted gradient equals the simulated-failure one;
* at every iteration boundary: a snapshot of RNG and counters and a look at the generation (a
  planned rejoin switches here).

A collective error or an aborted vote ends the generation: the rank exports its state at the
last committed boundary, drops every reference to the old groups (:mod:`.abort`), and waits for
the next generation, which redoes the in-flight iteration under the takeover plan. The records
and summary rows are in :mod:`.reporting`.
"""

from __future__ import annotations

import gc
import os
import resource
import time
from collections import deque
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict
from typing import Any, Deque, Dict, Iterator, List, Optional

from megatron_mecefo.recovery import node_vote_host, reporting
from megatron_mecefo.recovery.abort import GenerationWatchdog, build_aborter, release_megatron
from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.failures import checkpoint_line
from megatron_mecefo.recovery.fault_injection import KillInjector, parse_kills
from megatron_mecefo.recovery.heartbeat import Heartbeat
from megatron_mecefo.recovery.membership import Generation, JobLayout, MembershipStore
from megatron_mecefo.recovery.membership_schedule import MembershipSchedule
from megatron_mecefo.recovery.prepared import PreparedStep, applied_by_someone, resolve, settle
from megatron_mecefo.recovery.restore import take_over_from_snapshot
from megatron_mecefo.recovery.state import heal as healing
from megatron_mecefo.recovery.state.carry import boundary_snapshot, export_state, import_state
from megatron_mecefo.recovery.state.checksum import state_checksum
from megatron_mecefo.recovery.state.grad_buffers import GradBufferReuse, free, take_grad_buffers
from megatron_mecefo.recovery.state.link_probe import probe_link
from megatron_mecefo.recovery.state.link_probe import repetitions as link_probe_repetitions
from megatron_mecefo.recovery.state.memory import (
    mapped_allocations,
    mem_trace,
    release_unused,
    written_bytes,
)
from megatron_mecefo.recovery.state.tensor_stream import stream_config
from megatron_mecefo.recovery.state.warm_heap import WarmHeap, publish
from megatron_mecefo.recovery.step_hooks import install_commit_vote
from megatron_mecefo.recovery.store_forwarding import store_addresses
from megatron_mecefo.recovery.world_store import BuildAborter, WorldBuildAborted, WorldStore


class RegroupRequest(RuntimeError):
    """The generation changed: leave the world at this iteration boundary."""


_EXIT = {"code": 0}
"""The exit code the process ends with (``generations._exit_now``)."""


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
    "a replica rejoining a run with --use-distributed-optimizer needs the members' in-memory "
    "snapshots of the boundary it joins at, to re-shard the optimizer over the grown world "
    "(--mecefo-snapshot-interval K --mecefo-snapshot-redundancy 1); run the supervisor with "
    "--replace never, or resume from the last checkpoint (--load) with every replica"
)


def rescale_gradients(model: Any, dp: int) -> None:
    """Make each DDP chunk average its gradients over the job's ``dp`` replicas, not over the
    members of this world's data-parallel group.

    Megatron scales the reduced gradients by ``1 / (this world's data-parallel size)``: its
    bucket's ``gradient_scaling_factor``, or an averaging collective. The takeover plan's loss
    weights assume the job's own size (the survivors absorb the lost replicas' micro-batches),
    so the factor is reset to ``1 / dp`` (``m / dp`` before an averaging collective over ``m``
    members). Per-token loss is left alone (the global token count normalises). Decided from
    the configs, not from the factor: in a world of one data-parallel member the factor is 1.0
    either way (PP2 x DP2 that lost a replica applied twice the gradient, as a run without
    gradient clipping showed against the simulated run).
    """
    for ddp in model:
        if getattr(ddp.config, "calculate_per_token_loss", False):
            continue
        members = ddp.dp_cp_group.size() if hasattr(ddp, "dp_cp_group") else 1
        averaged = getattr(ddp.ddp_config, "average_in_collective", False)
        dense = (members if averaged else 1.0) / dp
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                bucket.gradient_scaling_factor = dense
        for buffer in getattr(ddp, "expert_parallel_buffers", []):
            for bucket in buffer.buckets:
                if not averaged:  # (averaged expert buffers: Megatron's edp/dp rule, kept)
                    bucket.gradient_scaling_factor = 1.0 / dp


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
        # A vote reader's bound on a stalled writer: past its heartbeat timeout, it has been
        # declared dead and killed (commit.DECISION_WAIT_S).
        self.decision_wait_s = 2 * config.heartbeat_timeout_s
        # Per rank (AsyncVoter), or through the node's supervisor with MECEFO_NODE_VOTE=1.
        self.voter = node_vote_host.voter(
            config.store, config.poll_interval_s, self.decision_wait_s
        )
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
        self.grad_buffers: List[Any] = []
        """The last world's CPU gradient buffers, for the next model (:meth:`building_model`)."""
        self.boundary: Optional[Dict[str, Any]] = None
        self.schedule: Optional[MembershipSchedule] = None
        self.times: Dict[str, Any] = {}
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
        # gloo on GPU tensors: several ranks sharing one GPU (NCCL refuses two ranks on one
        # device), as the one-GPU recovery benchmark runs them (benchmarks/recovery_scale_gpu.py).
        self.backend = os.environ.get("MECEFO_RECOVERY_BACKEND") or (
            "gloo" if args.device == "cpu" else "nccl"
        )
        self.aborter = build_aborter(
            self.backend,
            [*store_addresses(config.store), self.ms.address()],  # etcd mode: the hot store
            config.collective_timeout_s + 30.0,
        )
        self.watchdog: Optional[GenerationWatchdog] = None
        self.rank = -1
        self.snapshots: Any = None
        """The trainer's ``SnapshotManager``: kept across worlds (its slots and parity)."""
        self.takeover_pending = False
        """A rank died under the distributed optimizer: the next world rolls back to the last
        snapshot with parity and rebuilds the lost shards
        (:func:`.restore.take_over_from_snapshot`)."""
        self.takeover_info: Optional[Dict[str, Any]] = None
        self.prepared: Optional[PreparedStep] = None
        """The step of an iteration whose commit vote ended in doubt (:meth:`keep_prepared`),
        kept until a new world resolves its outcome (:meth:`_settle_prepared`)."""
        self.trim_after: Optional[int] = None
        """The iteration after which freed memory is given back once more (a new world's
        second step; :meth:`committed`)."""
        self.warm_heap = (
            config.warm_heap and self.backend == "gloo" and getattr(args, "device", "cpu") == "cpu"
        )
        """Whether this rank keeps a warm heap for its slot's joiners (:mod:`.state.warm_heap`):
        CPU ranks only (a GPU's destinations take no page faults)."""
        self.warm: Optional[WarmHeap] = None
        """A joiner's heap block, faulted in while it waits for its world
        (:meth:`start_warm_heap`)."""
        self.published_heap = -1
        """The generation whose state size this rank last published for its slot's joiners."""
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
        # Any failure since this world's generation (a rejoin may have been published after it).
        return any(
            self.ms.generation(n).at_iteration is None
            for n in range(self.generation + 1, latest + 1)
        )

    def fatal(self, message: str, say: bool = True) -> None:
        """End the job with one message (every rank: the store's ``fatal`` key); ``say``:
        rank 0 prints it too (every node's supervisor ends with it: "training aborted")."""
        self.ms.set_fatal(message)
        if say and self.rank <= 0:
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
                self.prepared = None
                free(self.grad_buffers)  # nor does a spare hold gradient buffers meanwhile
                self.grad_buffers = []
                self.start_warm_heap()
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
            # Training finished before this generation's switch (a rejoin announced for an
            # iteration past the last one): its members never arrive. Measured: a promoted
            # standby waited here for ever and its supervisor never exited.
            if self.ms.get_str("done") is not None or self.ms.get_str("fatal") is not None:
                return False
            self.sleep()
        return True

    def start_warm_heap(self) -> None:
        """A CPU rank without trained state (a joiner, a spare): fault in a heap block of its
        slot's state size while it waits for its world (:mod:`.state.warm_heap`)."""
        if self.warm_heap and self.warm is None and not self.valid:
            self.warm = WarmHeap.for_slot(self.ms.store, self.slot)

    def release_warm_heap(self) -> None:
        """Every member arrived: the block goes to the heap, for the model and the heal."""
        if self.warm is not None:
            self.times["warm_heap_bytes"] = self.warm.release()

    def close_warm_heap(self) -> None:
        """After the heal (or a world that failed): the allocator's defaults back."""
        if self.warm is not None:
            self.warm.close()
            self.warm = None

    def init_world(self, gen: Generation) -> None:
        import datetime

        import torch.distributed as dist

        rank = self.slot if gen.number == 0 else gen.rank_of(self.slot)
        if self.backend == "nccl":
            # The slot's GPU (LOCAL_RANK: a promoted standby's comes with its assignment)
            # before the first NCCL call: Megatron-LM sets no device once the world exists.
            import torch

            torch.cuda.set_device(
                int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            )
        # Sockets opened from here until on_built are the world's (the abort shuts them).
        self.aborter.open_world()
        # The watchdog runs from before the world's rendezvous: a member that dies while the
        # world is built (in init_process_group's or a new group's store wait, or in the
        # heal) must not leave the others waiting for the store timeout (world_store.py).
        world_store = WorldStore()
        self._start_watchdog(gen, BuildAborter(self.aborter, world_store))
        # The store that serves now: the new leader's, once the old one was lost (etcd mode).
        host, port = self.ms.address().rsplit(":", 1)
        store = world_store.connect(host, int(port), self.cfg.init_timeout_s)
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"world{gen.number}/", store),
            rank=rank,
            world_size=gen.world_size,
            timeout=datetime.timedelta(seconds=self.cfg.collective_timeout_s),
        )
        self.aborter.arm()
        if world_store.aborted:  # an abort before arm() cleared it: this world is over
            raise WorldBuildAborted("a newer generation was announced")
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

    def snapshot_manager(self, config: Any) -> Any:
        """The rank's ``SnapshotManager`` for ``config``: made in the first world, kept across
        worlds (its slots and parity outlive a regroup); each world builds its parity group
        (:meth:`~megatron_mecefo.snapshot.manager.SnapshotManager.prepare`, collective)."""
        if self.snapshots is None:
            from megatron_mecefo.snapshot.manager import megatron_snapshot_manager

            self.snapshots = megatron_snapshot_manager(config, self.slot, self.log)
            self.snapshots.should_abort = self.world_changed
        self.snapshots.prepare()
        return self.snapshots

    @property
    def imports_carry(self) -> bool:
        """Whether the model built now takes the carried state, tensor by tensor (a survivor's
        regroup; a snapshot roll-back takes its state from the snapshots instead)."""
        return self.carry is not None and not self.takeover_pending

    def initializes_model(self) -> bool:
        """Whether the trainer must initialise the weights of the model it builds now: not when
        the carried state or a peer's (the heal) overwrites every one of them. Built without
        initialisation (Megatron's ``perform_initialization=False``), the new weights' pages are
        untouched until the carry replaces or fills them, tensor by tensor (:mod:`.state.carry`),
        so a survivor never holds two copies of its weights. The same rule as
        :meth:`on_built`'s ``valid``."""
        if self.imports_carry:
            return False
        if self.takeover_pending:  # a snapshot roll-back: keep the plain path
            return True
        if self.gen is not None and self.gen.number == 0 and self.inc == 0:
            return True
        return self.ms.get_str("progress") is None  # nothing committed: all start from the seed

    def building_model(self) -> AbstractContextManager:
        """Around the construction of the model's DDP wrappers: their gradient buffers reuse
        the last world's (same model, same sizes) instead of fresh ``torch.zeros``, whose page
        faults and the old buffers' unmapping grew a survivor's regroup with the model
        (:mod:`.state.grad_buffers`). A survivor's new parameters, replaced by the carried
        storage at once, are mapped on their own (:func:`.state.memory.mapped_allocations`), so
        they leave no holes in the heap."""
        stack = ExitStack()
        if self.imports_carry:
            stack.enter_context(mapped_allocations())
        if self.grad_buffers:
            kept, self.grad_buffers = self.grad_buffers, []
            stack.enter_context(self._reusing(kept))
        return stack

    @contextmanager
    def _reusing(self, kept: List[Any]) -> Iterator[None]:
        """:class:`GradBufferReuse` (frees what it did not hand out, on exit); the count it
        handed out goes into the record (``grad_buffers_reused``: 0 would be a miss)."""
        reuse = GradBufferReuse(kept)
        with reuse:
            yield
        self.times["grad_buffers_reused"] = reuse.reused

    def metrics_mode(self) -> str:
        return "a" if self.generation > 0 else "w"

    def on_built(self, trainer: Any) -> None:
        """The trainer is built in the new world: restore/heal, agree, hook (module doc)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        gen = self.gen
        assert gen is not None
        rescale_gradients(trainer.model, self.layout.dp)
        self.times["constructed"] = time.time()
        # Trained state: the carry of the previous world, or a fresh start in the first one.
        # The carry is kept until this world is established: if it fails before (e.g. a
        # joiner dies during the heal), the next world imports it again.
        # Nothing committed yet (a rank died before the first commit, maybe before anyone had
        # built a model): every member starts from the seed, as generation 0 did; otherwise
        # no member would hold trained state, and the job would loop on the heal.
        untrained = self.carry is None and self.ms.get_str("progress") is None
        self.valid = self.carry is not None or (gen.number == 0 and self.inc == 0) or untrained
        if self.takeover_pending and self.prepared is not None:  # the roll-back redoes it
            self._drop_prepared("a snapshot roll-back redoes it")
        if self.carry is not None and self.takeover_pending:
            take_over_from_snapshot(self, trainer)
        elif self.imports_carry:
            boundary = self.carry["boundary"]
            # Consumes the carried weights as it copies; what it could not free is recorded.
            self.times["carry_kept_bytes"] = import_state(trainer, self.carry)
            # Kept (sharing the new model's tensors) until this world is established: if it
            # fails before, the next world imports it again.
            self.carry = export_state(trainer, boundary)
            release_unused()
        # Agree on the state: the members with valid state at the highest iteration are the
        # sources; everyone else in their data-parallel group is healed from them.
        mine = (self.slot, self.valid, trainer.iteration if self.valid else -1)
        dp_group = ps.get_data_parallel_group()
        dp_ranks = dist.get_process_group_ranks(dp_group)
        every: List[Any] = [None] * dist.get_world_size()
        kept = self._prepared_entry(trainer)
        dist.all_gather_object(
            every, (mine, self.schedule.real if self.schedule else [], dp_ranks, kept)
        )
        infos = [e[0] for e in every]
        if any(e[3] is not None for e in every):  # a split vote: settled before the heal
            infos = self._settle_prepared(trainer, infos, [e[3] for e in every])
        try:
            target = healing.heal_target(infos)
        except healing.NoTrainedState as err:
            # Every member decides this from the same all-gather, and so stops alike: a next
            # generation would hold joiners only again (a loop of generations, before).
            self.fatal(f"{err}; {checkpoint_line(self.args)}", say=False)
        authority = next(i for i, (_, ok, it) in enumerate(infos) if ok and it == target)
        if self.schedule is not None:
            self.schedule.real = [list(e) for e in every[authority][1]]
        # Every group's plan, on every rank: a lost shard stops every rank with the same
        # message (one group stopping alone would leave the others waiting for it).
        try:
            plans = {tuple(e[2]): healing.heal_plan(infos, e[2], target) for e in every}
        except healing.ShardLost as err:
            self.fatal(str(err))
        any_heal = [not (ok and it == target) for _, ok, it in infos]
        if any(any_heal):
            # A benchmark's diagnostic (off by default): gloo's one tensor between the first
            # sender and its joiner, in these processes, before the heal's clock starts.
            link = probe_link(trainer, plans[tuple(dp_ranks)], dist.get_rank(), dp_group,
                              link_probe_repetitions())  # fmt: skip
            if link is not None:
                self.times["heal_link_gbps"] = link
            self.times["heal_start"] = time.time()
            self._heal(trainer, plans, plans[tuple(dp_ranks)], target, dp_group)
            if self.args.use_distributed_optimizer:
                self._regrow(trainer, target, joiner=any_heal[dist.get_rank()])
            self.times["healed"] = time.time()
            self._check_replicas_identical(trainer, dp_group)
        self.valid = True
        self.carry = None
        self.close_warm_heap()
        release_unused()  # the carry's and the heal's freed buffers, back to the OS
        self.boundary = boundary_snapshot(trainer)
        if self.schedule is not None and gen.number > 0:
            for line in self.schedule.apply_generation(gen.replicas, trainer.iteration + 1):
                self.log(f"> MeCeFO recovery: {line}")
        mem_trace(self.slot, self.inc, "built", trainer.iteration)
        self._hook(trainer)
        # Every group (and its connections) exists now: later sockets are not the world's.
        self.aborter.seal_world()
        self.times["built"] = time.time()
        self.record_pending = gen.number > 0
        # A recovery's buffers and the first (degraded or healed) steps' working set are
        # freed by then; glibc keeps them resident unless trimmed (state/memory.py).
        self.trim_after = trainer.iteration + 2 if gen.number > 0 else None

    def keep_prepared(
        self, trainer: Any, iteration: int, counted: Optional[int], skipped: bool
    ) -> None:
        """The commit vote of ``iteration`` ended in doubt (the step hook, before it raises):
        keep the step prepared, i.e. the optimizer's reduced, clipped gradients (one extra copy
        of the main gradients, held only while in doubt) and the iteration's end state (RNG,
        counters), for the next world's resolution (:mod:`.prepared`). ``skipped``: the
        optimizer found inf/nan and updates nothing."""
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        assert self.gen is not None
        record = dict(getattr(trainer, "pending_record", None) or {})  # its record's fields
        self.prepared = PreparedStep.keep(
            self.gen.number, iteration, counted or 0, [] if skipped else params,
            skipped=skipped, boundary=boundary_snapshot(trainer), record=record,
        )  # fmt: skip

    def _prepared_entry(self, trainer: Any) -> Optional[tuple]:
        """What this rank tells the world of its kept step: ``(generation, iteration,
        counted)``, or None. A kept step is dropped (the old rule: the heal settles it) where
        it cannot be applied: no trained state, the distributed optimizer, a trainer without
        ``apply_prepared_step``, a state not at the iteration before it, or an optimizer of
        another layout (a snapshot roll-back drops it earlier, in :meth:`on_built`)."""
        step = self.prepared
        if step is None:
            return None
        if not self.valid:
            self._drop_prepared("this rank holds no trained state")
        elif getattr(self.args, "use_distributed_optimizer", False):
            # Its update gathers the parameters over the data-parallel group: the step is
            # applied by the in-doubt members alone (a death rolls back to a snapshot anyway).
            self._drop_prepared("the distributed optimizer's update is collective")
        elif not hasattr(trainer, "apply_prepared_step"):
            self._drop_prepared("the trainer has no apply_prepared_step")
        elif trainer.iteration + 1 != step.iteration:
            self._drop_prepared(f"the state is at iteration {trainer.iteration}")
        elif not step.fits([p for g in trainer.optimizer.param_groups for p in g["params"]]):
            self._drop_prepared("the optimizer's parameters changed shape")
        else:
            return (step.generation, step.iteration, step.counted or None)
        return None

    def _drop_prepared(self, why: str) -> None:
        """Forget the kept step (the old rule: the heal settles the iteration, if it can)."""
        assert self.prepared is not None
        self.log(
            f"> MeCeFO recovery: rank {self.slot}: the kept step of the in-doubt iteration "
            f"{self.prepared.iteration} is dropped: {why}",
            True,
        )
        self.prepared = None

    def _settle_prepared(
        self, trainer: Any, infos: List[tuple], entries: List[Optional[tuple]]
    ) -> List[tuple]:
        """Resolve each in-doubt iteration (as claimed on etcd in etcd mode; else committed if
        a member applied it or its count was complete: :func:`.prepared.resolve`, by its
        lowest-ranked holder, recorded in the store and broadcast), apply or drop this rank's
        kept step, and return the members' infos after it: every member of a stage ends at the
        same iteration, with no same-stage peer needed (issue 54, C1)."""
        import torch.distributed as dist

        me = dist.get_rank()
        outcomes: Dict[tuple, bool] = {}
        for key in sorted({e[:2] for e in entries if e is not None}):
            holders = [r for r, e in enumerate(entries) if e is not None and e[:2] == key]
            counted = next((entries[r][2] for r in holders if entries[r][2]), None)
            resolver = holders[0]
            box: List[Any] = [None]
            if me == resolver:
                applied = applied_by_someone(infos, key[1])
                box[0] = resolve(self.ms, *key, counted, applied, self.decision_wait_s)
                print(
                    f"> MeCeFO recovery: iteration {key[1]} of generation {key[0]}, in doubt on "
                    f"{len(holders)} rank(s), was "
                    + ("committed: they apply their kept step" if box[0] else "aborted"),
                    flush=True,
                )
            dist.broadcast_object_list(box, src=resolver)
            outcomes[key] = bool(box[0])
        step, self.prepared = self.prepared, None
        if step is not None:
            if outcomes[step.key]:
                trainer.apply_prepared_step(step)
                # The carry (kept until this world is established) is the applied state now.
                self.carry = export_state(trainer, step.extra["boundary"])
        return settle(infos, [e[:2] if e is not None else None for e in entries], outcomes)

    def _start_watchdog(self, gen: Generation, aborter: Any) -> None:
        """Watch for a failure generation after ``gen`` until :meth:`leave`. It sleeps in a
        store wait on the next generation's key (woken the moment it is published, no
        polling), on a client of its own: a waiting client holds its lock, and the previous
        generation's watchdog may still be in its last wait."""
        watch = MembershipStore.connect(self.cfg.store, self.cfg.init_timeout_s)
        self.watchdog = GenerationWatchdog(
            watch.generation_number,
            gen.number,
            aborter,
            WATCHDOG_WAIT_S,
            is_failure=lambda n: watch.generation(n).at_iteration is None,
            wait_after=watch.wait_generation_after,
        ).start()

    def _regrow(self, trainer: Any, target: int, joiner: bool) -> None:
        """A rejoin under the distributed optimizer: the heal copied the parameters and the
        data-parallel-independent state; the optimizer's parameter state is re-sharded over
        the grown world from the members' snapshots of ``target`` (collective)."""
        from megatron.core import parallel_state as ps

        from megatron_mecefo.snapshot.erasure import SnapshotLost

        manager = getattr(trainer, "snapshots", None)
        if manager is None:  # the flag checks require snapshots with the distributed optimizer
            self.fatal(DIST_OPT_REJOIN_MESSAGE)
        # Megatron's OptimizerParamScheduler.load_state_dict adds the saved steps to its own,
        # and the heal or the carry loaded them already.
        trainer.scheduler.num_steps = 0
        try:
            done = manager.regrow(
                trainer.snapshot_state(), ps.get_data_parallel_group_gloo(), target, joiner
            )
        except SnapshotLost as err:
            self.fatal(f"{err}; {DIST_OPT_REJOIN_MESSAGE}")
        self.takeover_info = {"recovery_path": "regrow", "regrow_s": done["seconds"]}

    def _heal(
        self, trainer: Any, plans: Dict[tuple, Dict[int, List[int]]], mine: Dict[int, List[int]],
        target: int, dp_group: Any,
    ) -> None:  # fmt: skip
        """Stream the state from each source to its receivers (``mine``: this rank's data-
        parallel group's plan), then wait with every member until every receiver in the world
        is done (:mod:`.state.heal`). The bytes and seconds go into the recovery record."""
        import torch.distributed as dist

        me = dist.get_rank()
        config = stream_config(self.cfg.collective_timeout_s)
        prefix = f"heal/{self.generation}"
        t0, written = time.time(), written_bytes()
        lanes = healing.stream_groups(dp_group, config)
        stats = None
        steps: Dict[str, float] = {}  # where this member's heal time went (records.py)
        if me in mine:
            t_export = time.perf_counter()
            state = export_state(trainer, self.boundary or boundary_snapshot(trainer))
            steps["export"] = time.perf_counter() - t_export
            report = healing.progress_reporter(self.ms.store, f"{prefix}/sent/{me}", 0.5)
            stats = healing.send_state(state, mine[me], dp_group, config, report, lanes)
            del state
            self.times["heal_role"] = "sender"
        else:
            src = next((s for s, dsts in mine.items() if me in dsts), None)
            if src is not None:
                self.injector.phase("heal", target + 1)
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                try:
                    stats = healing.receive_state(trainer, src, dp_group, config, lanes)
                except healing.ChecksumMismatch as err:
                    self.fatal(str(err))
                # Pages made resident during the receive, by whichever thread: with the warm
                # heap, few (its destinations were faulted in before the world formed).
                self.times["heal_page_faults"] = (
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                )
                healing.mark_done(self.ms.store, prefix, me)
                self.times["heal_role"] = "joiner"
            else:
                self.times["heal_role"] = "bystander"
        # What this rank sent, as the kernel counts it (a member holding the state sends 0).
        self.times["heal_written_bytes"] = written_bytes() - written
        if stats is not None:
            self.times["heal_bytes"] = stats.bytes
            self.times["heal_transfer_s"] = stats.seconds
            steps.update(structure=stats.structure_s, transfer=stats.seconds)
            if stats.import_s:
                steps["import"] = stats.import_s
        receivers = sorted(r for plan in plans.values() for dsts in plan.values() for r in dsts)
        sources = sorted(s for plan in plans.values() for s in plan)
        self.times["heal_wait_s"] = healing.wait_for_heals(
            self.ms.store, prefix, receivers, sources, stall_s=self.cfg.collective_timeout_s,
            poll_s=self.cfg.poll_interval_s, abort_check=self._heal_abort_reason,
        )  # fmt: skip
        steps["wait"] = self.times["heal_wait_s"]
        self.times["heal_steps_s"] = steps
        self.times["heal_s"] = time.time() - t0
        mem_trace(self.slot, self.inc, f"heal-{self.times['heal_role']}", target)
        t_release = time.perf_counter()
        release_unused()
        steps["release"] = time.perf_counter() - t_release

    def _heal_abort_reason(self) -> Optional[str]:
        """Why a member waiting for the heals stops: a newer generation, or a fatal error."""
        if self.ms.get_str("fatal") is not None:
            raise RecoveryAbort(1)
        latest = self.watchdog.latest if self.watchdog is not None else self.generation
        if latest != self.generation:
            return f"generation {latest} was announced"
        return None

    def _check_replicas_identical(self, trainer: Any, dp_group: Any) -> None:
        """After a heal: parameters and optimizer state checksum alike on every DP replica."""
        import torch
        import torch.distributed as dist

        digest = bytes.fromhex(state_digest(trainer))
        mine = torch.tensor(list(digest), dtype=torch.uint8)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(dp_group))]
        dist.all_gather(gathered, mine, group=dp_group)
        if not all(torch.equal(g, gathered[0]) for g in gathered):
            raise RuntimeError("heal: data-parallel replicas differ after the state copy")
        self.log(
            f"> MeCeFO recovery: healed; parameters and optimizer state identical on every "
            f"data-parallel replica (checksum {digest.hex()[:16]})"
        )

    def _hook(self, trainer: Any) -> None:
        """Phase hooks (kill injection) and the commit vote around the trainer's calls."""
        trainer.hook_phases(self.injector.phase)
        install_commit_vote(self, trainer)

    def committed(self, trainer: Any) -> None:
        """Right after a committed iteration: snapshot and the pending record (rank 0's vote
        worker has set the progress key at the commit)."""
        mem_trace(self.slot, self.inc, "iteration", trainer.iteration)
        t0 = time.perf_counter()
        self.boundary = boundary_snapshot(trainer)
        self.hooks_s.append(time.perf_counter() - t0)
        self.iterations_run += 1
        if self.warm_heap and self.published_heap != self.generation:
            self.published_heap = self.generation  # once per world: Adam's moments exist now
            publish(self.ms.store, self.slot, trainer)
        if self.trim_after is not None and trainer.iteration >= self.trim_after:
            self.trim_after = None
            release_unused()
        if self.record_pending:
            self.record_pending = False
            self.times["done"] = time.time()
            reporting.write_record(self, trainer)

    def logged(self, iteration: int) -> None:
        """The logging rank wrote ``iteration``'s line and record: noted in the store (a plain
        ``set``), so that after its death the next logging rank writes the committed
        iterations it did not (:meth:`unlogged`)."""
        self.ms.set_durable("logged", str(iteration))

    def unlogged(self, history: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """The records of committed iterations that no logging rank wrote: it died after the
        commit and before its line (the carried history has them)."""
        text = self.ms.get_str("logged")
        done = int(text) if text is not None else 0
        return [r for r in history if r.get("type") == "train" and r["iteration"] > done]

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
                snapshots = getattr(trainer, "snapshots", None)
                dist_opt = self.args.use_distributed_optimizer and snapshots is not None
                if gen.at_iteration is not None and dist_opt:
                    # Every member is at this boundary: its snapshot is what the grown world
                    # re-shards the optimizer from (SnapshotManager.regrow).
                    snapshots.seal_boundary(trainer.snapshot_state(), it)
                raise RegroupRequest(f"generation {number} ({gen.reason}) at iteration {it + 1}")
        if self.hooks_s:
            self.hooks_s[-1] += time.perf_counter() - t0
        self.injector.phase("between", it)

    def summary_rows(self) -> List[tuple]:
        """The summary's recovery rows (:func:`.reporting.summary_rows`)."""
        return reporting.summary_rows(self)

    def leave(self, trainer: Any, planned: bool) -> None:
        """Keep the state of the last boundary, drop every reference to the world's groups."""
        mem_trace(self.slot, self.inc, "leave", getattr(trainer, "iteration", -1))
        self.close_warm_heap()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog_cpu_s += self.watchdog.cpu_s
            self.watchdog = None
        if self.snapshots is not None:
            self.snapshots.abandon()  # the copy in flight reads tensors released below
        free(self.grad_buffers)  # a world that failed before its model took them
        self.grad_buffers = []
        if trainer is not None:
            self.saved_layouts.update(getattr(trainer, "saved_layouts", {}))
            if self.valid and trainer.built:
                self.carry = export_state(trainer, self.boundary or boundary_snapshot(trainer))
            self.times["exported"] = time.time()
            if trainer.built:
                # Kept for the next world's model (building_model); release_megatron frees
                # the buffers it does not take.
                self.grad_buffers = take_grad_buffers(trainer.model)
                release_megatron(trainer.model_chunks, trainer.model, trainer.config)
            trainer.release()
        self.times["dropped"] = time.time()
        self.aborter.destroy()  # ends with gc.collect(): the sockets close now
        self.times["released"] = time.time()
        self.times.update(getattr(self.aborter, "last_split", {}))
        if os.environ.get("MECEFO_RECOVERY_DEBUG"):
            _report_stale_groups(self.slot)


def state_digest(trainer: Any) -> str:
    """The parameters' and optimizer state's checksum (:mod:`.state.checksum`), with the
    learning rate and weight decay the next step will use (the scheduler's state)."""
    lrs = repr([(g["lr"], g.get("weight_decay")) for g in trainer.optimizer.param_groups])
    params = [p for chunk in trainer.model_chunks for _, p in sorted(chunk.named_parameters())]
    return state_checksum(params, trainer.optimizer.state_dict(), lrs)


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
