"""MeCeFO in Megatron-LM's training loop: the takeover plan per iteration, and the loader.

:class:`TrainingLoopHooks` is the part of
:class:`~megatron_mecefo.megatron_lm.integration.MegatronLMIntegration` that wraps five names of
``megatron.training.training``, only with ``--mecefo``:

* ``get_forward_backward_func``: the replica runs its planned micro-batches (its own, plus a
  failed replica's, read from the training dataset by sample index) through the
  :class:`~megatron_mecefo.takeover.controller.MecefoController`, built at the first step;
* ``finalize_model_grads``: the MHA-group re-weighting after the data-parallel sync (``train()``
  installs it as ``config.finalize_model_grads_func``; a hook a core_v0.19 builder set is
  wrapped in place, :meth:`TrainingLoopHooks.finalize_hook`);
* ``build_pretraining_data_loader``: keeps the training dataset (and, under the recovery
  supervisor, gives each replica its original share);
* ``save_checkpoint`` and ``load_checkpoint``: each rank's low-rank basis V
  (:mod:`.basis_checkpoint`).

With ``--mecefo-fail-slow`` (``detect`` by default), every training forward-backward is
timed up to the gradient sync and one all-reduce of ``n`` floats (``n`` the data-parallel size)
over every rank follows it: each replica's time per micro-batch, the same numbers on every
rank, so every rank reaches the same decision (:mod:`megatron_mecefo.failslow.monitor`). With
``rebalance`` the takeover policy is wrapped and the next iteration's plan moves whole
micro-batches of a slow replica to the others, read by sample index as a failed replica's are.

Rank 0 prints the plan's announcements, fail-slow's lines and, at exit, the summary.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

from megatron_mecefo.megatron_lm.flags import train_iters as _train_iters

__all__ = ["TrainingLoopHooks"]

_TRAINING = "megatron.training.training"


@contextlib.contextmanager
def save_phases(phase: Callable[[str], None]) -> Iterator[None]:
    """Within a save: fire ``save-write`` as the training thread starts its write (its first
    ``torch.save``) or, a rank that writes nothing, waits for the writers (its first
    ``torch.distributed.barrier``), and ``save-finalize`` once that first barrier returned
    (every rank wrote; Megatron-LM's rank 0 writes the tracker file next). Kill injection
    only (``--mecefo-kill R:I:save-write``); other threads' and forked writer processes' calls
    pass through."""
    import threading

    import torch

    dist = torch.distributed
    save, barrier = torch.save, dist.barrier
    fired: List[str] = []
    # A torch_dist save forks its writer processes, which inherit these wrappers and call
    # torch.save on their (forked) main thread: a kill fired there would end the writer, not
    # the rank, and leave the rank waiting for it forever (its peers then time out in the
    # save's barrier after 30 s). Only the rank's own process fires.
    owner = os.getpid()

    def once(name: str) -> None:
        if (
            name not in fired
            and os.getpid() == owner
            and threading.current_thread() is threading.main_thread()
        ):
            fired.append(name)
            phase(name)

    @functools.wraps(save)
    def phased_save(*a: Any, **kw: Any) -> Any:
        once("save-write")
        return save(*a, **kw)

    @functools.wraps(barrier)
    def phased_barrier(*a: Any, **kw: Any) -> Any:
        once("save-write")
        result = barrier(*a, **kw)
        once("save-finalize")
        return result

    torch.save, dist.barrier = phased_save, phased_barrier
    try:
        yield
    finally:
        torch.save, dist.barrier = save, barrier


class TrainingLoopHooks:
    """The training-loop hooks; the state is the integration's (``config``, ``state``,
    ``chunks``, ``controller``, ``train_dataset``, ``loader_offset`` and ``recovery``)."""

    config: Any
    state: Any
    chunks: List[Any]
    controller: Any
    train_dataset: Any
    loader_offset: int
    recovery: Any
    fail_slow_config: Any
    fail_slow: Any
    _fail_slow_for: Any
    _fail_slow_timed: Callable
    _hooks_installed: bool
    _summary_registered: bool

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

        save = basis_checkpoint.wrap_save(training.save_checkpoint)

        @functools.wraps(save)
        def save_checkpoint(iteration: int, *a: Any, **kw: Any) -> Any:
            # Kill injection (--mecefo-kill R:I:save, save-write, save-finalize, saved): as the
            # save of iteration I starts (the others then wait in its collectives for this
            # rank), in its write, in its finalize, and once it ended.
            if self.recovery is None:
                return save(iteration, *a, **kw)
            self.recovery.phase("save", iteration)
            with save_phases(lambda name: self.recovery.phase(name, iteration)):
                result = save(iteration, *a, **kw)
            self.recovery.phase("saved", iteration)
            return result

        training.save_checkpoint = save_checkpoint
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
            config = get_model_config(model[0] if isinstance(model, list) else model)
            finalize = self.finalize_hook(config)
            # The sampler's offset, not the run's: they differ after a phase transition.
            consumed = args.consumed_train_samples - self.loader_offset
            ctrl.begin_iteration(args.curr_iteration + 1, consumed)
            self._log(ctrl)
            if self.recovery is not None:  # kill injection at forward and backward
                from megatron_mecefo.recovery.step_hooks import phase_forward_step

                kw["forward_step_func"] = phase_forward_step(
                    kw["forward_step_func"], self.recovery.phase, args.curr_iteration + 1
                )
            monitor = self._fail_slow_monitor(ctrl, config, args)
            if monitor is not None:  # the timed finalize (the end of the replica's compute)
                finalize = config.finalize_model_grads_func
            wrapped = ctrl.wrap_forward_backward(
                inner,
                fetch=self._fetch,
                finalize=finalize,
                zero_report=lambda: {"lm loss": torch.zeros(2, device=self._device)},
                is_last_stage=lambda: ps.is_pipeline_last_stage(ignore_virtual=True),
            )
            if monitor is None:
                return wrapped(**kw)
            t0 = time.perf_counter()
            out = self._fail_slow_timed(wrapped, **kw)
            self._fail_slow_step(monitor, args.curr_iteration + 1, time.perf_counter() - t0)
            return out

        return run

    # ------------------------------------------------------------------ fail-slow
    def _fail_slow_monitor(self, ctrl: Any, config: Any, args: Any) -> Any:
        """The fail-slow monitor of ``ctrl``, built at its first step (once per entry into
        ``pretrain()``): it times the forward-backward up to ``config``'s finalize, and with
        ``rebalance`` wraps ``ctrl``'s policy. None when off."""
        if self._fail_slow_for is ctrl:
            return self.fail_slow
        self._fail_slow_for = ctrl
        self.fail_slow = None
        if self.fail_slow_config is None:
            return None
        import torch

        from megatron_mecefo.failslow.monitor import build_monitor

        ranks = (
            int(args.tensor_model_parallel_size)
            * int(args.pipeline_model_parallel_size)
            * int(getattr(args, "context_parallel_size", 1) or 1)
        )
        first = torch.distributed.get_rank() == 0

        def print_line(line: str) -> None:
            if first:
                print(line, flush=True)

        monitor = build_monitor(
            self.fail_slow_config, ctrl.replica, ctrl.layout.num_replicas, ranks,
            ctrl.layout.microbatches, ctrl, False, print_line,
        )  # fmt: skip
        if monitor is not None:
            # The schedule calls config.finalize_model_grads_func at the start of the gradient
            # sync; the timed version stamps the end of this replica's compute there.
            self._fail_slow_timed = monitor.wrap(lambda fbf, **kw: fbf(**kw), config)
        self.fail_slow = monitor
        return monitor

    def _fail_slow_step(self, monitor: Any, iteration: int, step_s: float) -> None:
        """Exchange each replica's time per micro-batch (one all-reduce of ``n`` floats over
        every rank, right after the gradient sync every rank has just joined), update the
        detection and the plan of the next iteration, print and record."""
        import torch

        slots = monitor.piggyback(torch.zeros(0, dtype=torch.float32, device=self._device))
        torch.distributed.all_reduce(slots)
        monitor.observe(slots, iteration)
        fields, lines = monitor.step_fields(step_s)
        for line in lines:
            monitor.print_line(line)
        self._fail_slow_record(iteration, fields["fail_slow"])

    def _fail_slow_record(self, iteration: int, fields: Dict[str, Any]) -> None:
        """The step's ``fail_slow`` metrics in Megatron-LM's TensorBoard and W&B writers, where
        the run has them (``--tensorboard-dir``, ``--wandb-project``): per replica its smoothed
        ratio to the median and the micro-batches it ran, and the number of slow replicas."""
        from megatron.training import global_vars

        writers = [
            w
            for w in (
                getattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", None),
                getattr(global_vars, "_GLOBAL_WANDB_WRITER", None),
            )
            if w is not None
        ]
        if not writers:
            return
        plan = self.controller.plan if self.controller is not None else None
        scalars: Dict[str, float] = {"mecefo/fail-slow/slow-replicas": float(len(fields["slow"]))}
        for r, ratio in enumerate(fields["ratio"]):
            if ratio is not None:
                scalars[f"mecefo/fail-slow/ratio/replica{r}"] = float(ratio)
            if plan is not None:
                scalars[f"mecefo/fail-slow/microbatches/replica{r}"] = float(len(plan.work[r]))
        for w in writers:
            if hasattr(w, "add_scalar"):  # TensorBoard
                for key, value in scalars.items():
                    w.add_scalar(key, value, iteration)
            else:  # wandb
                w.log(scalars, iteration)

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
        if self.fail_slow is not None:
            for key, value in self.fail_slow.summary_rows():
                print(f"> MeCeFO summary: {key}: {value}", flush=True)
        if self.recovery is not None:
            for key, value in self.recovery.summary_rows():
                print(f"> MeCeFO recovery summary: {key}: {value}", flush=True)
