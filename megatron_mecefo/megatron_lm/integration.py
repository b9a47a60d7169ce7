"""MeCeFO in Megatron-LM's own training loop (``pretrain_gpt.py``), through ``patches/``.

The patch for each Megatron-LM tag adds a few lines to ``pretrain_gpt.py`` and nothing to
``megatron/``; everything else happens here:

* ``extra_args_provider`` adds ``--mecefo`` and the ``--mecefo-*`` flags;
* the layer spec becomes the MeCeFO spec: through ``wrap_builder(gpt_builder)`` up to
  core_v0.17 (``pretrain()`` builds the model through ``model_provider``), and through the
  model config's ``transformer_layer_spec`` and ``post_wrap_hooks`` from core_v0.19 on. A
  ``--spec`` given by the user is kept, and must be a MeCeFO spec;
* five names in ``megatron.training.training`` are wrapped, only with ``--mecefo``:
  ``get_forward_backward_func`` (the replica runs its planned micro-batches),
  ``finalize_model_grads`` (the MHA-group re-weighting after the sync; ``train()`` installs
  it as ``config.finalize_model_grads_func``) and ``build_pretraining_data_loader`` (to read
  a failed replica's samples from the training dataset); ``save_checkpoint`` and
  ``load_checkpoint`` also keep each rank's low-rank basis V (:mod:`.basis_checkpoint`).

``--mecefo-abft`` (attention checksums, :mod:`megatron_mecefo.abft`) works with or without
``--mecefo``: the layer spec also goes through ``abft_spec``, and
``get_forward_backward_func`` is wrapped to count steps and micro-batches (for the policy and
the injector) and to sum the counts over ranks (rank 0 prints a line for each iteration with
a fault or a detection, and a summary at exit); an output that stays bad after its recompute
goes to Megatron's ``rerun_state_machine`` (``on_uncorrectable="raise"``).

Without ``--mecefo`` and ``--mecefo-abft*`` nothing is wrapped and Megatron-LM runs exactly as
unpatched.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import sys
from typing import Any, Callable, List, Optional

from megatron_mecefo.cli import exit_with_config_error, mecefo_flags_given, normalize_argv
from megatron_mecefo.takeover.arguments import add_arguments
from megatron_mecefo.takeover.config import FaultToleranceConfig, MecefoConfigError

_TRAINING = "megatron.training.training"


def extra_args_provider(other: Optional[Callable] = None) -> Callable:
    """An ``extra_args_provider`` adding the MeCeFO flags after ``other``'s (e.g. modelopt).

    It also makes the plugin's flag checks run as soon as Megatron-LM has parsed the command
    line, before it initialises anything (:func:`check_parsed_args`), reads
    ``--mecefo-fail -1:5:10`` as a value rather than an option, and lets
    ``MECEFO_PG_TIMEOUT_MIN`` set ``--distributed-timeout-minutes`` when that is not given.
    """

    def provider(parser: Any) -> Any:
        if other is not None:
            parser = other(parser)
        parser = add_arguments(parser)
        from megatron_mecefo.recovery.arguments import add_arguments as add_recovery_arguments

        parser = add_recovery_arguments(parser)  # --mecefo-kill (under the supervisor)
        from megatron_mecefo.snapshot.arguments import add_arguments as add_snapshot_arguments

        add_snapshot_arguments(parser)  # --mecefo-snapshot-* (the distributed optimizer's)
        sys.argv[:] = normalize_argv(sys.argv)
        _check_after_parsing(parser)
        return parser

    return provider


def _check_after_parsing(parser: Any) -> None:
    """Run :func:`check_parsed_args` on what ``parser`` parses (``parse_args`` goes through
    ``parse_known_args``), once."""
    if "--tensor-model-parallel-size" not in parser._option_string_actions:  # noqa: SLF001
        return  # not Megatron-LM's parser
    original = parser.parse_known_args
    done: List[bool] = []

    def parse_known_args(*a: Any, **kw: Any) -> Any:
        result = original(*a, **kw)
        if not done:
            done.append(True)
            check_parsed_args(result[0])
        return result

    parser.parse_known_args = parse_known_args


def check_parsed_args(args: Any) -> None:
    """The plugin's start-up checks on freshly parsed Megatron-LM flags, before Megatron's
    own ``validate_args`` and before any process group exists: a bad ``--mecefo-*`` flag
    stops every rank within seconds instead of after Megatron's initialisation.

    The derived values the checks need are computed here as ``validate_args`` will:
    the data-parallel size from ``WORLD_SIZE`` and the TP/PP/CP sizes, the default global
    batch size. Anything Megatron-LM itself rejects is left to it.
    """
    timeout = os.environ.get("MECEFO_PG_TIMEOUT_MIN")
    if timeout and "--distributed-timeout-minutes" not in " ".join(sys.argv):
        # Megatron-LM passes this to init_process_group and to every group of
        # initialize_model_parallel (DP, TP, PP, CP, embedding, ...).
        from megatron_mecefo.runtime.timeout import timeout_minutes

        try:
            args.distributed_timeout_minutes = timeout_minutes(timeout)
        except ValueError as err:
            exit_with_config_error(err)
    from megatron_mecefo.abft.arguments import abft_config_from_args
    from megatron_mecefo.abft.config import AbftConfigError

    try:  # ABFT works with or without --mecefo
        abft_config_from_args(args, getattr(args, "transformer_impl", None), "raise")
    except AbftConfigError as err:
        exit_with_config_error(err)
    supervised = os.environ.get("MECEFO_RECOVERY")
    save = getattr(args, "save", None)
    if save and (supervised or getattr(args, "mecefo", False)):
        # Megatron-LM finds an unwritable --save only at the first save, after the training
        # it was meant to keep: try a real write now.
        from megatron_mecefo.errors import UserError, check_writable_dir

        try:
            check_writable_dir("--save", save)
        except UserError as err:
            exit_with_config_error(err)
    interval = getattr(args, "snapshot_interval", 0)
    if interval and not supervised:
        exit_with_config_error(
            f"--mecefo-snapshot-interval={interval}: in Megatron-LM the in-memory snapshots "
            "serve the recovery supervisor's takeover of a dead rank's distributed-optimizer "
            "shard; launch under python -m megatron_mecefo.recovery.supervisor, or drop it"
        )
    if supervised or getattr(args, "mecefo_kill", None):
        from megatron_mecefo.megatron_lm.recovery import check_recovery_args

        check_recovery_args(args)
    if not getattr(args, "mecefo", False):
        given = mecefo_flags_given(args, add_arguments(argparse.ArgumentParser()))
        if given:
            exit_with_config_error(
                f"{given} was given without --mecefo, so it would be ignored; add --mecefo "
                "or drop it"
            )
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = 1
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        model *= int(getattr(args, name, None) or 1)
    if world % model:
        return  # Megatron-LM's validate_args says so
    ns = argparse.Namespace(**vars(args))
    ns.data_parallel_size = world // model
    if getattr(ns, "global_batch_size", None) is None:
        if getattr(ns, "micro_batch_size", None) is None:
            return  # not Megatron-LM's parser: nothing to derive from
        ns.global_batch_size = ns.micro_batch_size * ns.data_parallel_size
    if getattr(ns, "num_layers_per_virtual_pipeline_stage", None):
        ns.virtual_pipeline_model_parallel_size = ns.num_layers_per_virtual_pipeline_stage
    if not getattr(ns, "train_iters", None) and not getattr(ns, "train_samples", None):
        return
    try:
        _validated_config(ns)
    except MecefoConfigError as err:
        exit_with_config_error(err)


class MegatronLMIntegration:
    """The per-process MeCeFO wiring of one Megatron-LM run; see the module docstring."""

    def __init__(self) -> None:
        self._hooks_installed = False
        self._abft_hooks_installed = False
        self._summary_registered = False
        self.reset()

    def reset(self) -> None:
        """Forget the model, the controller and the dataset (before ``pretrain()`` is entered
        again in a new world). The wrapped ``megatron.training.training`` names stay: they
        read this object's state at every call."""
        self.config: Optional[FaultToleranceConfig] = None
        self.state: Any = None
        self.chunks: List[Any] = []
        self.controller: Any = None
        self.train_dataset: Any = None
        self.loader_offset = 0
        """``args.consumed_train_samples`` minus the sample offset the training data loader
        was built at: nonzero in a later phase of ``--phase-transition-iterations``, where
        Megatron-LM builds it at ``consumed_train_samples_in_current_phase``."""
        self.abft_config: Any = None
        self.abft: Any = None
        self._abft_open_step: Optional[int] = None
        self.recovery: Any = None
        """The Megatron-LM adapter of the recovery session
        (:class:`~megatron_mecefo.megatron_lm.recovery.MegatronLMTrainer`) under the
        supervisor: the original replica layout, the schedule of real failures, the phase
        hooks and the summary's recovery rows come from it."""

    # ------------------------------------------------------------------ set-up
    def _setup(self, args: Any) -> bool:
        """Validate the flags once args exist; returns whether ``--mecefo`` is on."""
        if self.config is not None:
            return self.config.enabled
        from megatron_mecefo.abft.arguments import abft_config_from_args
        from megatron_mecefo.abft.config import AbftConfigError

        warnings: List[str] = []
        try:
            self.config = _validated_config(args, warnings)
            self.abft_config = abft_config_from_args(
                args, getattr(args, "transformer_impl", None), on_uncorrectable="raise"
            )
        except (MecefoConfigError, AbftConfigError) as err:
            exit_with_config_error(err)
        if int(os.environ.get("RANK", "0")) == 0:
            for line in warnings:
                print(f"WARNING: MeCeFO: {line}", flush=True)
        if self.config.enabled:
            from megatron_mecefo.techniques.state import MecefoState

            self.state = MecefoState(self.config.techniques)
            self._install_training_hooks()
        if self.abft_config is not None:
            self._install_abft_hooks()
        return self.config.enabled

    def _rewrite_spec(self, spec: Any) -> Any:
        """The MeCeFO and/or ABFT rewrite of a stock layer spec, as the flags ask."""
        if self.config.enabled:
            from megatron_mecefo.techniques.specs import mecefo_spec

            spec = mecefo_spec(spec, lowrank=self.config.techniques.lowrank_ffn)
        if self.abft_config is not None:
            from megatron_mecefo.abft.spec import abft_spec

            spec = abft_spec(spec)
        return spec

    def layer_spec(self, config: Any, vp_stage: Optional[int] = None) -> Any:
        """The callable spec for core_v0.19 (``model_cfg.transformer_layer_spec``)."""
        if self.config.enabled:
            from megatron_mecefo.techniques.specs import mecefo_layer_spec

            spec = mecefo_layer_spec(config, vp_stage)
            return spec if self.abft_config is None else _abft(spec)
        try:
            from megatron.training.models.gpt import default_layer_spec
        except ImportError:
            from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec

            return self._rewrite_spec(gpt_decoder_spec(config, "local", vp_stage))
        return self._rewrite_spec(default_layer_spec(config, vp_stage))

    def wrap_builder(self, gpt_builder: Callable) -> Callable:
        """Megatron-LM <= core_v0.17: ``gpt_builder`` building the MeCeFO spec with --mecefo."""

        @functools.wraps(gpt_builder)
        def builder(args: Any, pre_process: bool, post_process: bool, *a: Any, **kw: Any) -> Any:
            if not self._setup(args) and self.abft_config is None:
                return gpt_builder(args, pre_process, post_process, *a, **kw)
            namespace = gpt_builder.__globals__
            original = namespace.get("_get_transformer_layer_spec")
            if original is not None and args.spec is None:
                namespace["_get_transformer_layer_spec"] = lambda *s, **k: self._rewrite_spec(
                    original(*s, **k)
                )
            try:
                model = gpt_builder(args, pre_process, post_process, *a, **kw)
            finally:
                if original is not None:
                    namespace["_get_transformer_layer_spec"] = original
            self._bind([model])
            return model

        return builder

    def configure_model(self, args: Any, model_cfg: Any) -> None:
        """Megatron-LM >= core_v0.19: set the spec and the post-wrap hook on ``model_cfg``."""
        if not self._setup(args) and self.abft_config is None:
            return
        if getattr(args, "spec", None) is None:
            model_cfg.transformer_layer_spec = self.layer_spec
        model_cfg.post_wrap_hooks.append(self._post_wrap)

    def _post_wrap(self, model: List[Any]) -> List[Any]:
        self._bind(model)
        return model

    def _bind(self, chunks: List[Any]) -> None:
        if self.config.enabled:
            from megatron_mecefo.techniques.apply import apply_mecefo

            try:
                apply_mecefo(chunks, self.state)
            except ValueError as err:
                exit_with_config_error(
                    f"--mecefo: {err} (with --spec, pass a MeCeFO spec such as "
                    "megatron_mecefo.techniques.specs mecefo_layer_spec)"
                )
        if self.abft_config is not None:
            import torch

            from megatron_mecefo.abft import AbftState, apply_abft

            if self.abft is None:
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
                self.abft = AbftState(self.abft_config, rank)
            try:
                apply_abft(chunks, self.abft)
            except ValueError as err:
                exit_with_config_error(f"--mecefo-abft: {err} (a --spec must be an ABFT spec)")
        self.chunks.extend(chunks)

    def _install_abft_hooks(self) -> None:
        """Wrap ``get_forward_backward_func``: steps, micro-batches and all-rank counts."""
        import atexit
        import importlib

        if self._abft_hooks_installed:
            return
        self._abft_hooks_installed = True
        training = importlib.import_module(_TRAINING)
        get_fbf = training.get_forward_backward_func

        @functools.wraps(get_fbf)
        def get_forward_backward_func(*a: Any, **kw: Any) -> Callable:
            inner = get_fbf(*a, **kw)

            def run(**kwargs: Any) -> Any:
                state = self.abft
                if state is None or kwargs.get("forward_only", False):
                    return inner(**kwargs)
                from megatron.training import get_args

                state.start_step(get_args().curr_iteration + 1)
                self._abft_open_step = state.iteration  # until end_step has summed it
                kwargs["forward_step_func"] = state.wrap_forward_step(kwargs["forward_step_func"])
                result = inner(**kwargs)
                self._abft_log(state.end_step())  # every rank: sums the counts
                self._abft_open_step = None
                return result

            return run

        training.get_forward_backward_func = get_forward_backward_func
        atexit.register(self._abft_summary)

    def _abft_log(self, record: dict) -> None:
        """Rank 0 prints a step's injections and detections (all ranks), if it had any."""
        import torch

        if torch.distributed.is_initialized() and torch.distributed.get_rank():
            return
        if not record["detections"]:
            return
        where = ", ".join(
            f"layer {d['layer']} {d['op']} {d['kind']} {d['action']}"
            + (f" x{d['count']}" if d["count"] > 1 else "")
            for d in record["detections"]
        )
        print(
            f"> MeCeFO ABFT: iteration {self.abft.iteration}: {record['injected']} injected, "
            f"{record['corrected']} corrected, {record['recomputed']} recomputed, "
            f"{record['uncorrectable']} uncorrectable ({where})",
            flush=True,
        )

    def _abft_summary(self) -> None:
        import torch

        if self.abft is None or (
            torch.distributed.is_initialized() and torch.distributed.get_rank()
        ):
            return
        rows = "; ".join(f"{k}: {v}" for k, v in self.abft.counters.rows())
        if self._abft_open_step is not None:  # e.g. a NaN loss raised inside the step
            rows += f"; iteration {self._abft_open_step} did not finish and is not counted"
        print(f"> MeCeFO ABFT summary: {rows}", flush=True)

    def _install_training_hooks(self) -> None:
        if self._hooks_installed:
            return
        import importlib

        training = importlib.import_module(_TRAINING)
        get_fbf = training.get_forward_backward_func
        finalize = training.finalize_model_grads
        build_loader = training.build_pretraining_data_loader

        @functools.wraps(get_fbf)
        def get_forward_backward_func(*a: Any, **kw: Any) -> Callable:
            return self._forward_backward(get_fbf(*a, **kw))

        @functools.wraps(build_loader)
        def build_pretraining_data_loader(dataset: Any, consumed_samples: int) -> Any:
            if self.train_dataset is None and dataset is not None:
                # The first call builds the training loader, at Megatron's phase-local offset.
                from megatron.training import get_args

                self.train_dataset = dataset
                self.loader_offset = int(get_args().consumed_train_samples) - int(
                    consumed_samples or 0
                )
            if self.recovery is not None:  # each replica reads its original share
                return self.recovery.build_loader(build_loader, dataset, consumed_samples)
            return build_loader(dataset, consumed_samples)

        self._finalize = self._wrap_finalize_lazily(finalize)
        training.get_forward_backward_func = get_forward_backward_func
        training.finalize_model_grads = self._finalize
        training.build_pretraining_data_loader = build_pretraining_data_loader
        # The low-rank basis V (and its refresh step) in the checkpoints.
        from megatron_mecefo.megatron_lm import basis_checkpoint

        training.save_checkpoint = basis_checkpoint.wrap_save(training.save_checkpoint)
        training.load_checkpoint = basis_checkpoint.wrap_load(training.load_checkpoint)
        self._hooks_installed = True

    def _wrap_finalize_lazily(self, finalize: Callable) -> Callable:
        @functools.wraps(finalize)
        def wrapped(*a: Any, **kw: Any) -> Any:
            if self.recovery is not None:  # kill injection (--mecefo-kill R:I:grad-sync)
                from megatron.training import get_args

                self.recovery.phase("grad-sync", get_args().curr_iteration + 1)
            if self.controller is None:
                return finalize(*a, **kw)
            return self.controller.wrap_finalize(finalize)(*a, **kw)

        wrapped.mecefo_wrapped = True  # type: ignore[attr-defined]
        return wrapped

    def finalize_hook(self, config: Any) -> Optional[Callable]:
        """The model config's ``finalize_model_grads_func``, with the MHA re-weighting.

        Megatron-LM up to core_v0.17 always installs ``finalize_model_grads`` (wrapped here
        by name). From core_v0.19, ``train()`` keeps a hook a model builder already set, so
        the name-level wrap never runs; such a hook is wrapped here, in place, on the first
        training step, so the re-weighting is never skipped silently.
        """
        hook = getattr(config, "finalize_model_grads_func", None)
        if hook is not None and not getattr(hook, "mecefo_wrapped", False):
            hook = config.finalize_model_grads_func = self._wrap_finalize_lazily(hook)
        return hook

    # ------------------------------------------------------------------ per iteration
    def _build_controller(self) -> Any:
        import torch
        from megatron.core import parallel_state as ps
        from megatron.training import get_args

        args = get_args()
        ft = self.config
        dp, replica = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        if self.recovery is not None:  # the original replicas, plus the real failures
            replica, dp = self.recovery.replica_layout()
            schedule = self.recovery.schedule(lambda: ft.build_schedule(dp, _train_iters(args)))
        else:
            schedule = ft.build_schedule(dp, _train_iters(args))
        self.controller = ft.build_controller(args, self.state, self.chunks, replica, dp, schedule)
        self._device = next(self.chunks[0].parameters()).device
        self._collate = torch.utils.data.default_collate
        from megatron_mecefo.takeover.topology import ORDERS, ReplicaTopology

        order = ORDERS[1] if getattr(args, "use_tp_pp_dp_mapping", False) else ORDERS[0]
        units = ReplicaTopology.from_parallel_state(order).describe()
        # Under the supervisor, a later generation's changes are logged by the session.
        first = self.recovery is None or self.recovery.session.generation == 0
        if torch.distributed.get_rank() == 0 and first:
            print(
                f"> MeCeFO: policy {ft.policy}, {self.controller.schedule.description}; "
                f"failure units: {units}",
                flush=True,
            )
        if not self._summary_registered:  # once per process, whatever its rank becomes
            self._summary_registered = True
            atexit.register(self._summary)
        return self.controller

    def _fetch(self, indices: List[int]) -> Any:
        if self.train_dataset is None:
            return None  # a rank that reads no data (TP rank > 0, middle pipeline stage)
        return self._collate([self.train_dataset[i] for i in indices])

    def _forward_backward(self, inner: Callable) -> Callable:
        import torch
        from megatron.core import parallel_state as ps

        def run(**kw: Any) -> Any:
            if kw.get("forward_only", False):
                return inner(**kw)
            from megatron.training import get_args

            ctrl = self.controller or self._build_controller()
            args = get_args()
            from megatron.core.utils import get_model_config

            model = kw["model"]
            finalize = self.finalize_hook(
                get_model_config(model[0] if isinstance(model, list) else model)
            )
            # The sampler's offset, not the run's: they differ after a phase transition.
            consumed = args.consumed_train_samples - self.loader_offset
            ctrl.begin_iteration(args.curr_iteration + 1, consumed)
            self._log(ctrl)
            if self.recovery is not None:  # kill injection at forward and backward
                from megatron_mecefo.recovery.step_hooks import phase_forward_step

                kw["forward_step_func"] = phase_forward_step(
                    kw["forward_step_func"], self.recovery.phase, args.curr_iteration + 1
                )
            wrapped = ctrl.wrap_forward_backward(
                inner,
                fetch=self._fetch,
                finalize=finalize,
                zero_report=lambda: {"lm loss": torch.zeros(2, device=self._device)},
                is_last_stage=lambda: ps.is_pipeline_last_stage(ignore_virtual=True),
            )
            return wrapped(**kw)

        return run

    def _log(self, ctrl: Any) -> None:
        import torch

        lines = ctrl.announcements()  # every rank: it records what was announced
        if torch.distributed.get_rank() == 0:
            for line in lines:
                print(line, flush=True)

    def _summary(self) -> None:
        import torch

        c = self.controller
        if c is None or (torch.distributed.is_initialized() and torch.distributed.get_rank()):
            return  # the summary is rank 0's (under recovery: of the last world)
        print(
            f"> MeCeFO summary: {c.degraded_iterations} degraded iterations "
            f"({c.fallback_iterations} with a fallback), samples processed "
            f"{c.samples_processed} / skipped {c.samples_skipped}",
            flush=True,
        )
        if self.recovery is not None:
            for key, value in self.recovery.summary_rows():
                print(f"> MeCeFO recovery summary: {key}: {value}", flush=True)


_CURRENT: Optional[MegatronLMIntegration] = None
"""The integration :func:`install` made in this process (the recovery wrapper finds it)."""


def current() -> Optional[MegatronLMIntegration]:
    """The integration :func:`install` made in this process, if any."""
    return _CURRENT


def _abft(spec: Any) -> Any:
    from megatron_mecefo.abft.spec import abft_spec

    return abft_spec(spec)


def install(args: Any = None, model_cfg: Any = None) -> MegatronLMIntegration:
    """Wire MeCeFO into Megatron-LM's ``pretrain_gpt.py`` (see ``patches/``).

    Megatron-LM <= core_v0.17 (flags parsed inside ``pretrain``): call it with no arguments
    and pass ``integration.wrap_builder(gpt_builder)`` and ``extra_args_provider(...)`` to
    ``pretrain``. core_v0.19 and later: call it with the parsed ``args`` and the
    ``GPTModelConfig`` before ``pretrain(full_config, ...)``.
    """
    global _CURRENT
    integration = _CURRENT = MegatronLMIntegration()
    if args is not None and model_cfg is not None:
        integration.configure_model(args, model_cfg)
    return integration


def _train_iters(args: Any) -> int:
    if args.train_iters:
        return int(args.train_iters)
    return int(args.train_samples) // int(args.global_batch_size)


def _validated_config(args: Any, warnings: Optional[List[str]] = None) -> FaultToleranceConfig:
    """The checked config of Megatron-LM's ``args``; warnings are appended to ``warnings``."""
    ft = FaultToleranceConfig.from_args(args)
    if not ft.enabled:
        given = mecefo_flags_given(args, add_arguments(argparse.ArgumentParser()))
        ft.validate(data_parallel_size=0, hidden_size=0, train_iters=0, mecefo_flags_given=given)
        return ft
    if getattr(args, "rampup_batch_size", None):
        raise MecefoConfigError(
            "--mecefo with --rampup-batch-size: the global batch must be fixed; drop one"
        )
    if getattr(args, "dataloader_type", "single") not in (None, "single"):
        raise MecefoConfigError(
            f"--mecefo reads a failed replica's samples in Megatron's 'single' sampler order; "
            f"--dataloader-type={args.dataloader_type} is not supported"
        )
    if ft.grad_error_interval:
        raise MecefoConfigError(
            f"--mecefo-grad-error-interval={ft.grad_error_interval} is only available in the "
            "plugin's example trainer (examples/pretrain_gpt); drop it here"
        )
    if getattr(args, "num_experts", None):
        raise MecefoConfigError("--mecefo does not support MoE models (--num-experts)")
    # core_v0.19 flags (absent before: getattr defaults).
    if getattr(args, "step_batch_size_schedule", None):
        raise MecefoConfigError(
            f"--mecefo with --step-batch-size-schedule={args.step_batch_size_schedule}: the "
            "global batch must be fixed, since the takeover plan splits it over the replicas; "
            "drop one"
        )
    if getattr(args, "hybrid_context_parallel", False):
        raise MecefoConfigError(
            "--mecefo with --hybrid-context-parallel: its data loader batches samples with an "
            "identity collate_fn, which absorbed micro-batches (read by index and collated "
            "with default_collate) cannot reproduce; drop one"
        )
    for flag, dest in (
        ("--tensor-parallel-num-weight-shards", "tensor_parallel_num_weight_shards"),
        ("--gtp-weight-remat-size", "gtp_weight_remat_size"),
    ):
        shards = getattr(args, dest, None)
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        limit = tp if dest == "tensor_parallel_num_weight_shards" else 1
        if ft.techniques.lowrank_ffn and shards is not None and int(shards) > limit:
            raise MecefoConfigError(
                f"--mecefo with {flag}={shards}: GTP weight re-materialisation shards the FFN "
                "weights beyond TP, and the low-rank FFN weight gradient needs each TP rank's "
                "whole weight shard; drop it, or pass --no-mecefo-lowrank-ffn"
            )
    found = ft.validate(
        data_parallel_size=args.data_parallel_size,
        hidden_size=args.hidden_size,
        train_iters=_train_iters(args),
        virtual_pipeline=getattr(args, "virtual_pipeline_model_parallel_size", None) is not None,
        calculate_per_token_loss=args.calculate_per_token_loss,
        full_recompute=getattr(args, "recompute_granularity", None) == "full",
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
        gated_linear_unit=bool(getattr(args, "swiglu", False)),
    )
    schedule = ft.build_schedule(args.data_parallel_size, _train_iters(args))
    for e in schedule.events:
        if len(schedule.failed_at(e.fail_iteration)) == args.data_parallel_size:
            raise MecefoConfigError(
                f"the failure schedule takes every replica down at iteration {e.fail_iteration}; "
                "Megatron-LM's train_step cannot skip an update, so keep one replica up"
            )
    if warnings is not None:
        warnings.extend(found)
    return ft
