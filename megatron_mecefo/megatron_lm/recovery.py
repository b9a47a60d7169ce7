"""MeCeFO's in-process recovery inside Megatron-LM's own ``pretrain_gpt.py``.

Megatron-LM re-enters ``pretrain()`` in-process after a fault through
``megatron/training/inprocess_restart.py`` (nvidia-resiliency-ext's ``inprocess.Wrapper``, which
reloads a checkpoint). The patch in ``patches/`` calls :func:`maybe_wrap_for_inprocess_restart`
at that call site instead: outside MeCeFO's supervisor it is Megatron-LM's own function; under
it (``MECEFO_RECOVERY`` set) ``pretrain`` runs through the recovery session's generation loop
(:func:`megatron_mecefo.recovery.generations.run_recoverable`), once per membership generation:

1. the session builds the generation's world (store prefix ``world<g>/``, ranks in Megatron's
   order); Megatron-LM's ``_initialize_distributed`` finds it initialised and keeps it;
2. ``pretrain()`` is entered; ``WORLD_SIZE`` stays the job's, so ``validate_args`` derives the
   *original* data-parallel size (the micro-batch calculator, the LR increment), while
   Megatron-Core's groups span the members only;
3. ``setup_model_and_optimizer`` is wrapped (:class:`MegatronLMTrainer`): in a later generation
   its checkpoint load is skipped (``args.load`` hidden for that call), and the session puts
   back the state carried in memory from the last committed iteration (parameters, optimizer,
   LR scheduler, RNG, counters, MeCeFO bases and controller counts) or heals a joiner from a
   data-parallel peer, checked by digest;
4. the optimizer's ``step`` waits for the commit vote (no step is half-applied; the in-flight
   iteration is redone with the same samples), and the iteration is booked at the commit
   (iteration, consumed samples, the LR scheduler's step);
5. the failed set comes from membership (the controller's schedule), the training loader reads
   each replica's *original* share, and DDP's scale is 1/n of the original replicas;
6. a failure leaves ``pretrain()`` with an exception: the state of the last commit is kept,
   Megatron-LM's global state is destroyed as its in-process restart does
   (``destroy_global_state``, ``destroy_rerun_state_machine``), and the next generation starts.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_mecefo.cli import exit_with_config_error
from megatron_mecefo.megatron_lm.checkpoint_writer import start_checkpoint_writer
from megatron_mecefo.megatron_lm.flags import check_recovery_args, job_args
from megatron_mecefo.recovery.config import ENV

__all__ = [
    "MegatronLMTrainer",
    "check_recovery_args",
    "job_args",
    "maybe_wrap_for_inprocess_restart",
    "run_pretrain",
    "warm_jit_fusions",
]

_TRAINING = "megatron.training.training"
_ACTIVE: Optional["MegatronLMTrainer"] = None
"""The adapter of the generation in progress: the wrapped Megatron-LM names delegate to it."""
_INSTALLED: List[bool] = []
_CONTROLLER_COUNTS = ("degraded_iterations", "fallback_iterations", "samples_processed",
                      "samples_skipped")  # fmt: skip
"""The MeCeFO controller's running counts, kept in snapshots."""


def maybe_wrap_for_inprocess_restart(pretrain: Callable) -> Tuple[Callable, Any]:
    """The patched call site in ``pretrain_gpt.py``: Megatron-LM's own function, or MeCeFO's
    in-process recovery under ``python -m megatron_mecefo.recovery.supervisor``.

    Returns ``(pretrain, store)`` as Megatron-LM's ``maybe_wrap_for_inprocess_restart`` does.
    """
    if not os.environ.get(ENV):
        from megatron.training import inprocess_restart

        return inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    if any(a == "--inprocess-restart" for a in sys.argv):
        exit_with_config_error(
            "--inprocess-restart (nvidia-resiliency-ext's in-process restart, which reloads a "
            "checkpoint) cannot run under the MeCeFO recovery supervisor, which re-enters "
            "pretrain() itself with the state in memory; drop --inprocess-restart"
        )

    @functools.wraps(pretrain)
    def recoverable(*a: Any, **kw: Any) -> None:
        run_pretrain(pretrain, a, kw)

    return recoverable, None


def run_pretrain(pretrain: Callable, a: tuple, kw: Dict[str, Any]) -> None:
    """``pretrain(*a, **kw)`` once per membership generation until training finishes."""
    from megatron.training.arguments import parse_args

    from megatron_mecefo.megatron_lm.integration import current
    from megatron_mecefo.recovery.generations import run_recoverable

    integration = current()
    if integration is None:
        exit_with_config_error(
            "the MeCeFO recovery supervisor needs the plugin installed in pretrain_gpt.py "
            "(mecefo.install(), patches/megatron-lm-core_v0.16.1.patch); apply the patch"
        )
    from megatron.training import global_vars

    _cache_parse_args()
    # core_v0.19: pretrain_gpt.py parsed and validated the flags before pretrain(); up to
    # core_v0.17, pretrain() parses them: parse them as it will (the plugin's checks run in the
    # parser hook).
    parsed = global_vars._GLOBAL_ARGS  # noqa: SLF001  (None until then; get_args asserts)
    args = parsed if parsed is not None else parse_args(kw.get("extra_args_provider"))
    job = job_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    run_recoverable(
        job,
        lambda session: MegatronLMTrainer(
            session, integration, pretrain, a, kw, parsed_args=parsed
        ),
        prepare=lambda: (warm_jit_fusions(args, job.device), start_checkpoint_writer(args)),
    )


def warm_jit_fusions(args: Any, device: str) -> None:
    """Compile Megatron-LM's fused kernels before the process says it is ready.

    ``pretrain()`` calls ``set_jit_fusion_options()``, which ``torch.compile``s the
    bias-GeLU/SwiGLU and bias-dropout-add fusions on their first call (2.1 s at DP4 on a
    CPU). A joiner made that call inside the rejoin's world, and the survivors waited for it
    in the first collective after it (the start-time all-reduce). Made here, with the same
    arguments, the compiled code is cached in the process, and ``pretrain()``'s own call (kept:
    it draws the same random numbers after the seed is set) reuses it. Best effort: a
    failure here leaves the compilation to ``pretrain()``.
    """
    import time

    import torch
    from megatron.core import parallel_state
    from megatron.training import global_vars, initialize

    t0 = time.perf_counter()
    own = global_vars._GLOBAL_ARGS is None  # noqa: SLF001  (core_v0.19 set them already)
    if own:  # up to core_v0.17 the flags are parsed, not validated yet: derive what it reads
        args = _warm_up_view(args)
    if device == "cuda":
        # The slot's device, as init_world will set it, so that nothing lands on GPU 0.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    compiled = False
    try:
        if own:
            global_vars._GLOBAL_ARGS = args  # noqa: SLF001
        # With --sequence-parallel the warm-up reads the TP size from parallel_state.
        parallel_state.set_tensor_model_parallel_world_size(args.tensor_model_parallel_size)
        initialize.set_jit_fusion_options()
        compiled = True
    except Exception as err:  # noqa: BLE001  (pretrain() compiles them then)
        print(f"> MeCeFO recovery: the fused kernels were not compiled early: {err}", flush=True)
    finally:
        parallel_state.set_tensor_model_parallel_world_size(None)
        if own:
            global_vars._GLOBAL_ARGS = None  # noqa: SLF001
    if compiled and int(os.environ.get("MECEFO_RECOVERY_INC", "0")) > 0:
        print(
            f"> MeCeFO recovery: rank {os.environ.get('RANK', '?')}: fused kernels compiled "
            f"before ready in {time.perf_counter() - t0:.2f} s",
            flush=True,
        )


def _warm_up_view(args: Any) -> Any:
    """A copy of the parsed flags with the values ``_warmup_jit_function`` reads set as
    ``validate_args`` sets them (the shapes must match for ``pretrain()`` to reuse the code)."""
    import copy

    view = copy.copy(args)
    if view.ffn_hidden_size is None:  # arguments.py validate_args, "Checks."
        four_h = 4 * view.hidden_size
        view.ffn_hidden_size = int(four_h * 2 / 3 / 64) * 64 if view.swiglu else four_h
    if view.seq_length is None:
        view.seq_length = view.encoder_seq_length
    view.context_parallel_size = view.context_parallel_size or 1
    if view.tensor_model_parallel_size == 1:
        view.sequence_parallel = False
    return view


def _cache_parse_args() -> None:
    """Parse Megatron-LM's flags once per process, not at every ``pretrain()``.

    Each entry parses the command line twice (``ft_integration.setup`` and
    ``initialize_megatron``), building a parser of about a thousand options each time
    (0.07-0.26 s apiece, measured at load 16): every regroup paid it, on the survivors'
    clock. The command line does not change between generations, so later parses return a
    copy of the first one's result (``validate_args`` changes the copy it gets), with
    ``RANK`` and ``WORLD_SIZE`` read again as ``parse_args`` reads them.
    """
    from megatron.training import arguments

    if getattr(arguments.parse_args, "mecefo_cached", False):
        return
    parse = arguments.parse_args
    parsed: Dict[Any, Any] = {}

    @functools.wraps(parse)
    def parse_args(extra_args_provider: Any = None, ignore_unknown_args: bool = False) -> Any:
        import copy

        key = (extra_args_provider, bool(ignore_unknown_args), tuple(sys.argv))
        if key not in parsed:
            parsed[key] = parse(extra_args_provider, ignore_unknown_args)
            # The provider may normalise sys.argv in place: the next call's key is this one.
            parsed[(extra_args_provider, bool(ignore_unknown_args), tuple(sys.argv))] = parsed[key]
        args = copy.deepcopy(parsed[key])
        args.rank = int(os.getenv("RANK", "0"))
        args.world_size = int(os.getenv("WORLD_SIZE", "1"))
        return args

    parse_args.mecefo_cached = True  # type: ignore[attr-defined]
    arguments.parse_args = parse_args
    try:
        from megatron.training import initialize
    except ImportError:  # a stand-in megatron.training (unit tests)
        return
    if getattr(initialize, "parse_args", None) is parse:  # imported by name there
        initialize.parse_args = parse_args


class _DataParallelView:
    """``megatron.core.mpu`` with the original data-parallel rank and size (the samplers')."""

    def __init__(self, mpu: Any, rank: int, size: int) -> None:
        self._mpu, self._rank, self._size = mpu, rank, size

    def get_data_parallel_rank(self, *a: Any, **k: Any) -> int:
        return self._rank

    def get_data_parallel_world_size(self, *a: Any, **k: Any) -> int:
        return self._size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mpu, name)


class MegatronLMTrainer:
    """Megatron-LM's ``pretrain()`` as a :class:`~megatron_mecefo.recovery.trainer.
    RecoverableTrainer` for one membership generation (see the module docstring).

    Args:
        session: The rank's :class:`~megatron_mecefo.recovery.session.RecoverySession`.
        integration: The plugin's :class:`~.integration.MegatronLMIntegration`.
        pretrain: Megatron-LM's ``pretrain``; ``a`` and ``kw`` are its arguments.
        parsed_args: core_v0.19: the flags ``pretrain_gpt.py`` parsed before ``pretrain()``
            (which then reads them from Megatron-LM's globals); None up to core_v0.17.
    """

    def __init__(
        self,
        session: Any,
        integration: Any,
        pretrain: Callable,
        a: tuple,
        kw: Dict[str, Any],
        parsed_args: Any = None,
    ) -> None:
        self.session, self.integration = session, integration
        self._pretrain, self._a, self._kw = pretrain, a, kw
        self._parsed_args = parsed_args
        self.built = False
        self.iteration = 0
        self.consumed_samples = 0
        self.model: List[Any] = []
        self.model_chunks: List[Any] = []
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.config: Any = None
        self.history: List[Dict[str, Any]] = []
        self.evals: List[Dict[str, Any]] = []
        self.saved: List[int] = []
        self.snapshots: Any = None
        self.flops = 0.0
        """Megatron-LM's ``num_floating_point_operations_so_far`` at the last commit."""
        self.consumed_valid = 0
        """``args.consumed_valid_samples`` at the last boundary."""
        self._phase: Optional[Callable[[str, int], None]] = None
        self._loaders: List[Any] = []
        """This world's data loaders (:meth:`build_loader`): their workers end at
        :meth:`release`."""
        self._scheduler_booked = False

    # ------------------------------------------------------------------ RecoverableTrainer
    @property
    def controller(self) -> Any:
        return self.integration.controller

    def train(self) -> None:
        """Enter Megatron-LM's ``pretrain()`` in this generation's world."""
        global _ACTIVE
        _install_hooks()
        self.integration.reset()
        self.integration.recovery = self
        # Megatron-LM reads RANK in parse_args (rank-0 printing before the world exists);
        # WORLD_SIZE stays the job's: the original data-parallel size (module docstring).
        os.environ["RANK"] = str(self.session.rank)
        if self._parsed_args is not None:
            # A promoted standby parsed the flags before its slot, and LOCAL_RANK, were known.
            self._parsed_args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            self._restore_global_args()
        _ACTIVE = self
        try:
            self._pretrain(*self._a, **self._kw)
        except SystemExit as stop:
            # --exit-signal-handler, --exit-duration-in-mins, --exit-interval: Megatron-LM saved
            # (with --save) and ended train() with sys.exit(0). For the recovery that is a
            # finished run (the supervisor reports the save); any other status stays an exit.
            if stop.code not in (0, None):
                raise
            self.session.log(
                f"> MeCeFO recovery: Megatron-LM stopped at iteration {self.iteration} "
                "(--exit-signal-handler / --exit-duration-in-mins / --exit-interval)"
            )
        if self.snapshots is not None:
            self.snapshots.flush()

    def _restore_global_args(self) -> None:
        """core_v0.19: ``pretrain()`` reads the flags from Megatron-LM's globals, which the
        previous generation's :meth:`release` destroyed (as its in-process restart does): set
        them again, with this world's rank and the job's world size (the original
        data-parallel size is kept: ``validate_args`` derived it from ``WORLD_SIZE``)."""
        from megatron.training import global_vars

        if global_vars._GLOBAL_ARGS is not None:  # noqa: SLF001  (the first generation)
            return
        args = self._parsed_args
        args.rank = self.session.rank
        args.world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
        global_vars.set_global_variables(args)

    def rewind_data(self, consumed_samples: int) -> None:
        """Megatron-LM builds its loaders after the restore, at ``consumed_samples``."""
        self.consumed_samples = int(consumed_samples)

    def extra_state(self) -> Dict[str, Any]:
        return {"flops": self.flops, "consumed_valid_samples": self.consumed_valid}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        self.flops = float(state.get("flops", 0.0))
        self.consumed_valid = int(state.get("consumed_valid_samples", 0))

    def hook_phases(self, phase: Callable[[str, int], None]) -> None:
        """The integration's forward-backward and finalize wrappers call :meth:`phase`."""
        self._phase = phase

    def phase(self, name: str, iteration: int) -> None:
        if self._phase is not None:
            self._phase(name, iteration)

    def emit(self, record: Dict[str, Any]) -> None:
        """Megatron-LM keeps no metrics file of ours: the records file and log have them."""

    def snapshot_state(self) -> Any:
        """What an in-memory snapshot holds: model chunks, optimizer (the distributed
        optimizer's shard), scheduler, counters and the controller's counts."""
        from megatron_mecefo.snapshot.contents import TrainingState

        extra = {}
        if self.controller is not None:  # the takeover rolls back to the snapshot: these too
            extra["controller"] = {k: getattr(self.controller, k) for k in _CONTROLLER_COUNTS}
        counters = {"iteration": self.iteration, "consumed_samples": self.consumed_samples}
        return TrainingState(self.model_chunks, self.optimizer, self.scheduler, counters, extra)

    def recovery_checkpoint(self, before: int) -> Optional[Tuple[str, int]]:
        """None: the disk fallback is the example trainer's only (Megatron-LM's checkpoints
        are not loaded into a running world); when the snapshots cannot serve, the job stops
        with one message."""
        return None

    def load_recovery_checkpoint(self, directory: str, basis_layout: Optional[str]) -> float:
        raise NotImplementedError("the disk fallback is not wired into Megatron-LM's loop")

    def release(self) -> None:
        """Drop this world's objects and Megatron-LM's global state, as its in-process restart
        does (``inprocess_restart.destroy_state``)."""
        global _ACTIVE
        from megatron.core import rerun_state_machine
        from megatron.training import global_vars, training

        stop_loader_workers(self._loaders)
        self._loaders = []
        self.integration.reset()
        self.model, self.model_chunks, self.optimizer, self.scheduler = [], [], None, None
        self.config, self.built, self._phase = None, False, None
        writer = getattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", None)
        if writer is not None:
            writer.close()
        try:
            from megatron.training.async_utils import reset_persistent_async_worker

            reset_persistent_async_worker()
        except ImportError:
            pass
        training.destroy_global_state()
        rerun_state_machine.destroy_rerun_state_machine()
        _ACTIVE = None

    # ------------------------------------------------------------------ Megatron-LM hooks
    def replica_layout(self) -> Tuple[int, int]:
        return self.session.replica_layout()

    def schedule(self, build: Callable[[], Any]) -> Any:
        """The session's membership schedule; ``build()`` makes its simulated base, once per
        process (later generations keep the first one and its real failures)."""
        if self.session.schedule is not None:
            return self.session.schedule
        return self.session.wrap_schedule(build())

    def summary_rows(self) -> List[tuple]:
        return self.session.summary_rows()

    def build_loader(self, build: Callable, dataset: Any, consumed_samples: int) -> Any:
        """Megatron-LM's loader with the original data-parallel rank and size."""
        from megatron.training.datasets import data_samplers

        replica, n = self.session.replica_layout()
        mpu = data_samplers.mpu
        data_samplers.mpu = _DataParallelView(mpu, replica, n)
        try:
            loader = build(dataset, consumed_samples)
        finally:
            data_samplers.mpu = mpu
        self._loaders.append(loader)
        return loader

    def setup(self, original: Callable, a: tuple, kw: Dict[str, Any]) -> Any:
        """``setup_model_and_optimizer``, then the session's restore/heal/hooks."""
        from megatron.core.utils import get_model_config
        from megatron.training import get_args
        from megatron.training.utils import unwrap_model

        args = get_args()
        hidden = (args.load, args.pretrained_checkpoint)
        had_init = hasattr(args, "perform_initialization")
        if self.session.generation > 0:  # the state comes from memory, not from --load
            args.load = args.pretrained_checkpoint = None
        if not self.session.initializes_model():
            # core_transformer_config_from_args copies every args field that TransformerConfig
            # has: the carry or the heal overwrites each weight, so none is initialised.
            args.perform_initialization = False
        try:
            # A survivor's new DDP wrappers take the last world's gradient buffers.
            with self.session.building_model():
                model, optimizer, scheduler = original(*a, **kw)
        finally:
            args.load, args.pretrained_checkpoint = hidden
            if not had_init and hasattr(args, "perform_initialization"):
                del args.perform_initialization
        self.model, self.model_chunks = model, unwrap_model(model)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.config = get_model_config(model[0])
        self.iteration = int(args.iteration)
        self.consumed_samples = int(args.consumed_train_samples)
        self.flops = float(args.num_floating_point_operations_so_far)
        self.consumed_valid = int(args.consumed_valid_samples)
        if self.integration.config is not None and self.integration.config.enabled:
            self.integration.controller or self.integration._build_controller()
        self.snapshots = self._build_snapshots(args)
        self.built = True
        if self.session.generation > 0:
            self.session.log(
                "> MeCeFO recovery: pretrain() re-entered in generation "
                f"{self.session.generation}; no checkpoint read, the state comes from memory"
            )
        self.session.on_built(self)
        args.iteration = self.iteration
        args.consumed_train_samples = self.consumed_samples
        args.num_floating_point_operations_so_far = self.flops
        args.consumed_valid_samples = self.consumed_valid
        self._book_at_commit(args)
        return model, optimizer, scheduler

    def _build_snapshots(self, args: Any) -> Any:
        """The in-memory snapshots (``--mecefo-snapshot-*``): one manager per process, its
        slots and parity kept across worlds; each world builds its parity group."""
        from megatron_mecefo.snapshot.arguments import validate

        config = validate(args, self.session.layout.dp)
        return None if config is None else self.session.snapshot_manager(config)

    def _book_at_commit(self, args: Any) -> None:
        """Book an iteration the moment its update is applied (the vote committed): its
        number, samples, FLOPs and the LR scheduler's step, then the session's boundary
        snapshot. Megatron-LM books it later (after the loss reduction, which a death can
        interrupt), and counts samples with the *members'* data-parallel size."""
        from megatron.training import training

        optimizer, scheduler = self.optimizer, self.scheduler
        step, scheduler_step = optimizer.step, scheduler.step
        gbs = int(args.global_batch_size)

        def step_and_book(*a: Any, **k: Any) -> Any:
            if self.snapshots is not None:  # the snapshot copy reads what the step writes
                self.snapshots.before_optimizer_step()
            result = step(*a, **k)
            self.iteration += 1
            self.consumed_samples += gbs
            self.flops += _flops(training, args, gbs)
            if result[0]:  # update_successful: the scheduler steps now, not after the reduction
                scheduler_step(increment=gbs)
                self._scheduler_booked = True
            if self.snapshots is not None:
                self.snapshots.after_step(self.snapshot_state(), self.iteration)
            self.session.committed(self)
            return result

        def scheduler_step_once(*a: Any, **k: Any) -> Any:
            if self._scheduler_booked:  # train_step's own call for the booked iteration
                self._scheduler_booked = False
                return None
            return scheduler_step(*a, **k)

        optimizer.step, scheduler.step = step_and_book, scheduler_step_once

    def apply_prepared_step(self, step: Any) -> None:
        """Finish an iteration whose commit vote was in doubt and was resolved committed
        (:mod:`megatron_mecefo.recovery.prepared`; from :meth:`setup`'s ``on_built``, before
        the loaders are built and the booking is hooked): the update from the kept gradients,
        booked as :meth:`_book_at_commit` books one, and the RNG states at its end."""
        from megatron.training import get_args, training

        from megatron_mecefo.recovery.state.carry import restore_boundary

        args = get_args()
        ok = False
        if not step.extra.get("skipped"):
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            ok = bool(step.apply(params, self.optimizer.step_with_ready_grads))
        gbs = int(args.global_batch_size)
        self.iteration += 1
        self.consumed_samples += gbs
        self.flops += _flops(training, args, gbs)
        if ok:
            self.scheduler.step(increment=gbs)
        restore_boundary(self, step.extra["boundary"])

    def log_iteration(self) -> None:
        """Before Megatron-LM logs an iteration: its sample count is the booked one."""
        from megatron.training import get_args

        get_args().consumed_train_samples = self.consumed_samples

    def boundary(self) -> None:
        """After the iteration's evaluation and checkpoint: the generation check."""
        from megatron.training import get_args

        self.consumed_valid = int(get_args().consumed_valid_samples)
        self.session.at_boundary(self)


def _flops(training: Any, args: Any, batch_size: int) -> float:
    """Megatron-LM's FLOP count of one global batch (0 where its signature is not known)."""
    try:
        return float(training.num_floating_point_operations(args, batch_size))
    except (TypeError, AttributeError):
        return 0.0


def _install_hooks() -> None:
    """Wrap the ``megatron.training.training`` names the adapter needs (once per process)."""
    if _INSTALLED:
        return
    import importlib

    training = importlib.import_module(_TRAINING)
    setup = training.setup_model_and_optimizer
    log = training.training_log
    decide = training.checkpoint_and_decide_exit
    build_datasets = getattr(training, "build_train_valid_test_datasets", None)

    @functools.wraps(setup)
    def setup_model_and_optimizer(*a: Any, **kw: Any) -> Any:
        if _ACTIVE is None:
            return setup(*a, **kw)
        return _ACTIVE.setup(setup, a, kw)

    @functools.wraps(log)
    def training_log(*a: Any, **kw: Any) -> Any:
        if _ACTIVE is not None:
            _ACTIVE.log_iteration()
        return log(*a, **kw)

    @functools.wraps(decide)
    def checkpoint_and_decide_exit(*a: Any, **kw: Any) -> Any:
        result = decide(*a, **kw)
        if _ACTIVE is not None and not result:
            _ACTIVE.boundary()
        return result

    training.setup_model_and_optimizer = setup_model_and_optimizer
    if build_datasets is not None:  # a tag without it builds its data elsewhere: no kill phase
        training.build_train_valid_test_datasets = _dataset_build_phase(build_datasets)
    training.training_log = training_log
    training.checkpoint_and_decide_exit = checkpoint_and_decide_exit
    _INSTALLED.append(True)


def _dataset_build_phase(build: Callable) -> Callable:
    """``build_train_valid_test_datasets`` with the kill phase ``dataset-build`` before it
    (``--mecefo-kill R:I:dataset-build``): the state is in place by then, and the peers meet
    in the dataset builder's barrier next."""

    @functools.wraps(build)
    def build_train_valid_test_datasets(*a: Any, **kw: Any) -> Any:
        if _ACTIVE is not None:
            _ACTIVE.phase("dataset-build", _ACTIVE.iteration + 1)
        return build(*a, **kw)

    return build_train_valid_test_datasets


def stop_loader_workers(loaders: List[Any]) -> None:
    """End the worker processes of ``loaders`` (torch DataLoaders with persistent workers,
    ``--num-workers N``) now, while their iterators and queues are alive.

    Left to the garbage collector, an iterator that a failure's traceback holds in a reference
    cycle is collected with its queues: the queues' weakref finalizers run before the
    iterator's ``__del__`` and end their feeder threads, so the shutdown's "exit" message to
    each worker is never sent, and ``_shutdown_workers`` waits out its 5 s join timeout per
    worker. Measured with ``--num-workers 1`` (a training, a validation and a test loader):
    15.3 s in the release of every rejoin, or wherever the collector ran (a failure's regroup
    of 15.2 s, in ``init_process_group`` and the build).
    Shut down here, each worker gets its message and exits in milliseconds."""
    for loader in loaders:
        shutdown = getattr(getattr(loader, "_iterator", None), "_shutdown_workers", None)
        if shutdown is not None:  # a single-process iterator (--num-workers 0) has none
            try:
                shutdown()
            except Exception:  # a dead worker's loader: torch terminates what is left
                pass
