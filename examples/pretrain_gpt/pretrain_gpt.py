"""Compact Megatron-Core GPT pretraining, on CPU (gloo) or GPU (nccl).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=8 examples/pretrain_gpt/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --data-path data/stdlib_text_document --train-iters 100

Real megatron-core throughout: GPTModel, DistributedDataParallel, get_megatron_optimizer, the
pipeline schedules, dist_checkpointing and the GPT datasets. On the CPU the plugin's CPU runtime
(megatron_mecefo.runtime) supplies the CUDA plumbing megatron-core expects.

This file is the loop (:class:`Trainer`); the modules beside it hold the rest, as torchtitan's
trainer delegates to its components: ``arguments.py`` (flags), ``building.py`` (model,
optimizer, data, MeCeFO controller), ``evaluation.py``, ``training_state.py`` (checkpoints,
snapshots, the recovery checkpoint; file formats in ``checkpointing.py``), ``probes.py``
(planner and gradient-error measurements, weight-hash check) and ``reporting.py`` (log lines,
metrics, summary).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from functools import partial
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# None of these imports torch at module level: a bad flag fails first (arguments.py).
import building  # noqa: E402
import probes  # noqa: E402
import reporting  # noqa: E402
import training_state  # noqa: E402
from arguments import parse_args  # noqa: E402
from evaluation import evaluate  # noqa: E402
from reporting import TrainingLog  # noqa: E402

_START = time.time()  # --exit-duration-in-mins counts from here, as Megatron-LM's start time


def main(argv: Optional[list[str]] = None) -> None:
    try:
        _main(argv)
    except KeyboardInterrupt:
        # One line, not a traceback from every rank; the last checkpoint is what is kept.
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                "pretrain_gpt.py: error: interrupted (Ctrl-C); nothing was saved since the last "
                "checkpoint; pass --exit-signal-handler --save DIR and stop with SIGTERM to "
                "save first",
                file=sys.stderr,
                flush=True,
            )
        os._exit(130)  # no interpreter shutdown: gloo threads may still be in a collective


def _main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = building.select_device(args)
    if os.environ.get("MECEFO_RECOVERY"):  # under megatron_mecefo.recovery.supervisor
        from megatron_mecefo.recovery.generations import run_recoverable

        trainer = run_recoverable(args, lambda session: Trainer(args, device, session))
    else:
        trainer = Trainer(args, device)
        trainer.train()
    trainer.finish(time.perf_counter() - t_start)


class Trainer:
    """One training run: the loop, the step and the exit checks.

    The run is built by ``building.py``; validation is ``evaluation.py``; checkpoints,
    snapshots and the recovery checkpoint are ``training_state.py``; the planner's and the
    gradient-error probes are ``probes.py``; the log lines, metrics and summary are
    ``reporting.py``. Under the recovery supervisor it is a
    :class:`megatron_mecefo.recovery.trainer.RecoverableTrainer` (the state,
    :meth:`rewind_data`, :meth:`hook_phases`, :meth:`emit`, :meth:`snapshot_state`, the recovery
    checkpoint and :meth:`release`).
    """

    def __init__(self, args: Any, device: Any, recovery: Any = None) -> None:
        import torch.distributed as dist

        self.built = False  # the recovery session's: the model and optimizer exist
        self.args = args
        self.device = device
        self.recovery = recovery  # a megatron_mecefo.recovery RecoverySession, or None
        self.stop_reason: Optional[str] = None  # why training stopped before --train-iters
        self._signal: Optional[int] = None
        if args.exit_signal_handler:  # Megatron-LM's: SIGTERM saves at the next boundary
            import signal

            signal.signal(signal.SIGTERM, lambda signum, _frame: setattr(self, "_signal", signum))
        self.timeout_min = building.init_distributed(device)
        self.rank = dist.get_rank()
        self.log = TrainingLog(self.rank)
        building.init_parallel_state(args, recovery, self.timeout_min)
        # A recovery that overwrites every weight (carry, heal) skips their initialisation.
        initialize = recovery is None or recovery.initializes_model()
        self.config = building.transformer_config(args, device, initialize)
        from megatron_mecefo.data import ByteTokenizer

        self.tokenizer = ByteTokenizer()  # --tokenizer-type's only choice; sets the vocab
        # A survivor's new DDP wrappers take the last world's gradient buffers (no fresh pages).
        reuse = getattr(recovery, "building_model", None)
        with reuse() if reuse is not None else nullcontext():
            self.model_chunks, self.model, self.num_params = building.build_model(
                args, self.config, device, self.tokenizer.vocab_size
            )
        self.optimizer, self.scheduler = building.build_optimizer(args, self.config, self.model)
        self.tokens_per_step = args.global_batch_size * args.seq_length
        self.iteration, self.consumed_samples = 0, 0
        self.snapshots = training_state.build_snapshots(
            args.snapshot_config, recovery, self.rank, self.log.print
        )
        self.recovery_path = None  # which path restored the state: "local" (holder) or "disk"
        restore_record = None
        first_world = recovery is None or recovery.generation == 0
        if self.snapshots is not None and args.snapshot_config.directory and first_world:
            restore_record = training_state.restore_snapshot(self)
        self.saved_layouts: dict[int, str] = {}  # iteration -> this rank's position then
        # A later world under the recovery supervisor takes its state from the previous one
        # (or, as a fallback, from RecoverySession's own disk load), not from --load.
        if args.load and self.recovery_path is None and first_world:
            training_state.load(self)
        self.train_ds, self.valid_ds = building.build_datasets(args, self.tokenizer)
        self.dp_rank, self.dp_size = building.replica_layout(args, recovery)
        if args.log_rank_cpu_time:  # which replica each global rank's CPU time belongs to
            self._dp_ranks = probes.gather_dp_ranks(self.dp_rank)
        self.iterators = building.iterator_factory(args, self.dp_rank, self.dp_size)
        self.train_iter = self.iterators(self.train_ds, self.consumed_samples)
        self.planner_probe = probes.PlannerProbe()
        self.virtual = None  # --mecefo-virtual-replicas: the single-process simulation
        self.controller = self._build_controller() if args.mecefo else None
        self.abft = None
        if args.abft_config is not None:  # --mecefo-abft / --mecefo-abft-inject
            from megatron_mecefo.abft import AbftState, apply_abft

            self.abft = AbftState(args.abft_config, self.rank, args.num_layers)
            apply_abft(self.model_chunks, self.abft)
        self.forward_backward = self._forward_backward_func()
        self.fail_slow = self._fail_slow_monitor()
        if args.device_clock:  # emulated GPU phase times (CPU benchmarks: goodput)
            from megatron_mecefo.planner import device_clock

            device_clock.install(self, args.device_clock, self.rank)
        resumed = args.load or self.recovery_path  # a restart appends to the run's log
        self.log.open(args, "a" if resumed else recovery.metrics_mode() if recovery else "w")
        if restore_record:
            self.log.emit(restore_record)
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.saved: list[int] = []
        self.built = True
        if recovery is not None:  # restore or heal the state, hook the commit vote
            recovery.on_built(self)

    def _build_controller(self) -> Any:
        """The MeCeFO controller, plus what the step reads through it (fetch, simulation)."""
        import torch

        a = self.args
        controller = building.build_controller(
            a,
            self.model_chunks,
            self.config,
            self.dp_rank,
            self.dp_size,
            self.recovery,
            load_basis=(
                (lambda: training_state.load_basis(self)) if self.iteration and a.load else None
            ),
            print_line=self.log.print,
        )
        collate = torch.utils.data.default_collate
        self._fetch = lambda indices: collate([self.train_ds[i] for i in indices])
        if a.mecefo_virtual_replicas:
            from megatron_mecefo.takeover.virtual_replicas import VirtualReplicas

            self.virtual = VirtualReplicas(controller, self.model, self.model_chunks, self.config)
        return controller

    def _fail_slow_monitor(self) -> Any:
        """--mecefo-fail-slow: times the forward-backward, wraps the policy (rebalance)."""

        from megatron_mecefo.failslow.monitor import build_monitor

        a = self.args
        monitor = build_monitor(
            a.fail_slow_config, self.dp_rank, self.dp_size,
            a.tensor_model_parallel_size * a.pipeline_model_parallel_size, a.num_microbatches,
            self.controller, self.virtual is not None, self.log.print,
        )  # fmt: skip
        if monitor is not None:
            self.forward_backward = monitor.wrap(self.forward_backward, self.config)
        return monitor

    def _forward_backward_func(self) -> Any:
        return building.forward_backward_func(
            self.controller,
            self.virtual,
            self.config,
            lambda indices: self._fetch(indices),
            self.device,
        )

    # ------------------------------------------------------------------ RecoverableTrainer
    def rewind_data(self, consumed_samples: int) -> None:
        """Read the training set from ``consumed_samples`` on (a redone iteration)."""
        self.train_iter = self.iterators(self.train_ds, consumed_samples)

    def apply_prepared_step(self, step: Any) -> None:
        """Finish an iteration whose commit vote was in doubt and was resolved committed
        (``megatron_mecefo/recovery/prepared.py``): the optimizer's update from the kept
        gradients, then what :meth:`train_step` advances after it. Its record is the one
        :meth:`train_step` had before the update (``step.extra["record"]``: loss, samples, the
        time up to the vote), with no grad norm (computed in the update the vote cut off)."""
        from megatron_mecefo.recovery.state.carry import restore_boundary

        ok = False
        if not step.extra.get("skipped"):
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            ok = bool(step.apply(params, self.optimizer.step_with_ready_grads))
        if ok:
            self.scheduler.step(increment=1)
        self.iteration += 1
        self.consumed_samples += self.args.global_batch_size
        restore_boundary(self, step.extra["boundary"])
        self.rewind_data(self.consumed_samples)
        kept = dict(step.extra.get("record") or {})
        dt = float(kept.pop("step_time_s", 0.0)) or 1e-9
        tokens = kept.pop("tokens", self.tokens_per_step)
        self.history.append(
            {
                "type": "train", "iteration": self.iteration,
                "consumed_samples": self.consumed_samples, "loss": kept.pop("loss", None),
                "grad_norm": None, "skipped": not ok, "step_time_s": dt, "tokens": tokens,
                "tokens_per_s": tokens / dt, "lr": self.optimizer.param_groups[0]["lr"],
                "in_doubt": True, **kept,
            }
        )  # fmt: skip

    def extra_state(self) -> dict[str, Any]:
        return {}  # everything this trainer carries is in the common state

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def hook_phases(self, phase: Any) -> None:
        """Fire the kill-injection phases forward, backward and grad-sync."""
        import functools

        from megatron_mecefo.recovery.step_hooks import phase_forward_step

        fwd_bwd = self.forward_backward

        @functools.wraps(fwd_bwd)
        def forward_backward(*, forward_step_func: Any, **kw: Any) -> Any:
            if not kw.get("forward_only", False):
                forward_step_func = phase_forward_step(forward_step_func, phase, self.iteration + 1)
            return fwd_bwd(forward_step_func=forward_step_func, **kw)

        self.forward_backward = forward_backward
        finalize = self.config.finalize_model_grads_func

        @functools.wraps(finalize)
        def finalize_model_grads(*a: Any, **k: Any) -> Any:
            phase("grad-sync", self.iteration + 1)
            return finalize(*a, **k)

        self.config.finalize_model_grads_func = finalize_model_grads

    def emit(self, record: dict[str, Any]) -> None:
        self.log.emit(record)

    def snapshot_state(self) -> Any:
        return training_state.snapshot_state(self)

    def recovery_checkpoint(self, before: int) -> Optional[tuple[str, int]]:
        """The newest checkpoint of ``--save``, else of ``--load``, at or before iteration
        ``before``, as ``(directory, iteration)``; None without one. Where a run under the
        recovery supervisor falls back to when its in-memory snapshots cannot serve."""
        return training_state.recovery_checkpoint(self.args, before)

    def load_recovery_checkpoint(self, directory: str, basis_layout: Optional[str]) -> float:
        """Collective: load ``directory``'s newest checkpoint and this rank's low-rank bases
        (``training_state.load_recovery_checkpoint``); returns the seconds it took."""
        return training_state.load_recovery_checkpoint(self, directory, basis_layout)

    def release(self) -> None:
        """Drop every reference (model, optimizer, groups, iterators) of this world."""
        self.__dict__.clear()
        self.built = False

    # ------------------------------------------------------------------ steps
    def _forward_step(self, data_iterator: Any, model: Any) -> tuple[Any, Any]:
        if self.abft is not None:
            self.abft.begin_microbatch(model)
        batch = {k: v.to(self.device) for k, v in next(data_iterator).items()}
        if probes.planner_active(getattr(self, "controller", None)):
            # auto: measure what the planner predicts (activations)
            output = self.planner_probe.forward(model, batch)
        else:
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(_loss_func, batch["loss_mask"])

    def run_schedule(self, data_iterator: Any, forward_only: bool) -> float:
        """One global batch through the pipeline schedule; returns the mean lm loss."""
        import torch.distributed as dist

        if self.virtual is not None:  # every simulated replica in turn, each its own share
            its = data_iterator if data_iterator is not None else [None] * self.dp_size
            totals = self.virtual.run(
                lambda r: self._loss_total(its[r], forward_only), forward_only
            )
            total = sum(totals[1:], totals[0])
        else:
            total = self._loss_total(data_iterator, forward_only)
        fail_slow = None if forward_only else self.fail_slow
        if fail_slow is not None:  # each replica's time per micro-batch rides along
            total = fail_slow.piggyback(total)
        # Sum over every rank: each TP rank of each last stage adds its (equal) share, so
        # loss-sum / token-count is still the mean over the global batch.
        dist.all_reduce(total)
        if fail_slow is not None:
            total = fail_slow.observe(total, self.iteration + 1)
        return (total[0] / total[1]).item()

    def _loss_total(self, data_iterator: Any, forward_only: bool) -> Any:
        """This rank's (lm loss sum, token count) of one pass through the pipeline schedule."""
        import torch
        from megatron.core import parallel_state as ps

        a = self.args
        losses = self.forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=data_iterator,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=a.num_microbatches,
            seq_length=a.seq_length,
            micro_batch_size=a.micro_batch_size,
            forward_only=forward_only,
        )
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            for item in losses:
                total += item["lm loss"].to(total)
        return total

    def train_step(self) -> dict[str, Any]:
        """One optimizer step on one global batch (through the MeCeFO plan with --mecefo)."""
        a = self.args
        ctrl = self.controller
        mecefo: dict[str, Any] = {}
        grad_error = None
        if ctrl is not None:
            k = a.mecefo_config.grad_error_interval
            degraded = bool(ctrl.schedule.failed_at(self.iteration + 1))
            if k and degraded and ctrl.degraded_iterations % k == 0:
                grad_error = probes.failure_free_grads(self)
        t0 = time.perf_counter()
        if ctrl is not None:
            ctrl.begin_iteration(self.iteration + 1, self.consumed_samples)
            mecefo = ctrl.record()
            for line in ctrl.announcements():
                self.log.print(line)
        self.planner_probe.activation_peak = 0  # not the gradient-error probe's micro-batches
        self.zero_grads()
        if self.abft is not None:
            self.abft.start_step(self.iteration + 1)
        cpu0 = time.process_time()
        loss = self.run_schedule(self.train_iter, forward_only=False)
        cpu1 = time.process_time()
        # What each replica read, by sample index (the exactly-once check of the tests): a
        # collective, so only when a metrics file records it (the same on every rank).
        samples = None
        if ctrl is not None and self.args.metrics_file:
            samples = probes.gather_samples(ctrl.samples_consumed())
        # All ranks agree whether a GEMM stayed bad after its recompute: then no update.
        abft = self.abft.end_step() if self.abft is not None else None
        if grad_error is not None:
            # Before the optimizer step: clipping scales the gradient buffers in place, which
            # would count as error on every iteration whose norm exceeds --clip-grad.
            mecefo["grad_rel_error"] = probes.grad_rel_error(self.model, grad_error, self.device)
        cpu2 = time.process_time()
        tokens = self.tokens_per_step
        if ctrl is not None:
            tokens = mecefo["samples_processed"] * a.seq_length
        no_update = bool(mecefo.get("no_update"))
        if no_update or (abft is not None and abft["skip"]):
            ok, grad_norm = False, None  # every replica down, or ABFT: no update, skipped
        else:
            if self.snapshots is not None:  # the snapshot copy reads what the step writes
                self.snapshots.before_optimizer_step()
            # The iteration's record so far: kept with the step if its commit vote ends in
            # doubt, for apply_prepared_step's record (the samples, for the exactly-once check).
            self.pending_record = {
                "loss": loss, "step_time_s": time.perf_counter() - t0, "tokens": tokens,
                **({"mecefo": mecefo} if ctrl is not None else {}),
                **({"samples": samples} if samples is not None else {}),
            }  # fmt: skip
            ok, grad_norm, _ = self.optimizer.step()
        cpu = (cpu1 - cpu0, time.process_time() - cpu2)
        if self.virtual is not None:  # the critical path: the slowest simulated replica
            cpu = (max(self.virtual.replica_cpu_s), cpu[1])
        if "planner" in mecefo:  # measured next to the decision's prediction
            self.planner_probe.measure(
                mecefo["planner"],
                cpu,
                ctrl,
                a.mecefo_config.planner.calibrate_steps,
                self.iteration + 1,
                self.device,
                self.log.print,
            )
        if ok:  # as Megatron-LM: a skipped iteration does not advance the LR schedule
            self.scheduler.step(increment=1)
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rank_cpu = probes.gather_rank_cpu(cpu, self._dp_ranks) if a.log_rank_cpu_time else None
        fail_slow: dict[str, Any] = {}
        if self.fail_slow is not None:
            fail_slow, lines = self.fail_slow.step_fields(dt)
            for line in lines:
                self.log.print(line)
        self.iteration += 1
        self.consumed_samples += a.global_batch_size
        return {
            "type": "train",
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            # No update (every replica down): nothing was computed, so no loss (null).
            "loss": None if no_update else loss,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "skipped": not ok,
            "step_time_s": dt,
            "tokens": tokens,
            "tokens_per_s": tokens / dt,
            "lr": self.optimizer.param_groups[0]["lr"],
            **({"mecefo": mecefo} if ctrl is not None else {}),
            **({"samples": samples} if samples is not None else {}),
            **({"abft": abft} if abft is not None else {}),
            **({"rank_cpu_s": rank_cpu} if rank_cpu is not None else {}),
            **fail_slow,
        }

    def _log_unlogged(self) -> None:
        """Under the supervisor, in a new world: the committed iterations whose line and
        record the logging rank did not write before it died (it died after the commit)."""
        if self.recovery is None or self.log.rank != 0:
            return
        late = self.recovery.unlogged(self.history)
        # A logging rank can write a record and then fail to note it in the store (cut off
        # from etcd between the two, its note refused): the record is in the file already.
        written = self.log.train_iterations_from(late[0]["iteration"]) if late else set()
        for record in late:
            if record["iteration"] not in written:
                self.log.emit(record)
            it = record["iteration"]
            if it % self.args.log_interval == 0 or it == self.args.train_iters:
                self.log.window(self.args, [record])
        if late:
            self.recovery.logged(late[-1]["iteration"])

    def zero_grads(self) -> None:
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        a = self.args
        self.log.start(a, self.device.type, self.num_params)
        self._log_unlogged()
        window: list[dict[str, Any]] = []
        while self.iteration < a.train_iters:
            record = self.train_step()
            if self.snapshots is not None:
                self.snapshots.after_step(self.snapshot_state(), self.iteration)
                # Cumulative seconds the training thread spent in snapshot code.
                record["snapshot_s"] = self.snapshots.main_thread_s
                record["snapshot_commit_wait_s"] = self.snapshots.commit_wait_s
                record["snapshot_copy_wait_s"] = self.snapshots.copy_wait_s
                record["snapshot_parity_s"] = self.snapshots.parity_s
            self.history.append(record)
            window.append(record)
            self.log.emit(record)
            if self.recovery is not None and self.log.rank == 0:
                self.recovery.logged(self.iteration)
            if self.recovery is not None:  # boundary snapshot of RNG and counters
                self.recovery.committed(self)
            if self.iteration % a.log_interval == 0 or self.iteration == a.train_iters:
                self.log.window(a, window)
                window = []
            check = a.check_weight_hash_across_dp_replicas_interval
            if check and (self.iteration % check == 0 or self.iteration == a.train_iters):
                probes.check_dp_replicas(
                    self.model_chunks, self.device, self.iteration, self.log.emit
                )
            if a.eval_iters > 0 and self.iteration % a.eval_interval == 0:
                self._evaluate()
            if a.save and self.iteration % a.save_interval == 0:
                training_state.save(self)
            if a.exit_interval and self.iteration % a.exit_interval == 0:
                break
            self.stop_reason = self._exit_requested()
            if self.stop_reason:
                self.log.print(
                    f"> exiting at iteration {self.iteration}: {self.stop_reason}"
                    + ("; saving a checkpoint" if a.save else "; no --save, nothing saved")
                )
                break
            if self.recovery is not None:  # snapshot; a planned regroup switches here
                self.recovery.at_boundary(self)
        last_eval = self.evals[-1]["iteration"] if self.evals else None
        if a.eval_iters > 0 and not self.stop_reason and last_eval != self.iteration:
            self._evaluate()
        if a.save and self.saved[-1:] != [self.iteration]:
            training_state.save(self)
        if self.snapshots is not None:
            self.snapshots.flush()

    def _evaluate(self) -> None:
        record = evaluate(self)
        self.evals.append(record)
        self.log.eval(record)

    def _exit_requested(self) -> Optional[str]:
        """Whether every rank stops here: a SIGTERM reached any rank (--exit-signal-handler)
        or --exit-duration-in-mins has passed on any; one all-reduce, so all stop together."""
        a = self.args
        if not (a.exit_signal_handler or a.exit_duration_in_mins):
            return None
        import torch
        import torch.distributed as dist

        minutes = (time.time() - _START) / 60
        late = bool(a.exit_duration_in_mins) and minutes >= a.exit_duration_in_mins
        flags = torch.tensor([float(self._signal or 0), float(late)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            import signal

            return f"{signal.Signals(int(flags[0])).name} received (--exit-signal-handler)"
        if flags[1] > 0:
            return f"--exit-duration-in-mins={a.exit_duration_in_mins:g} has passed"
        return None

    def finish(self, wall_s: float) -> None:
        """Print the summary table and shut the process group down."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        a = self.args
        if self.rank == 0 and self.history:
            rows = reporting.run_rows(
                a, self.device.type, self.history, self.consumed_samples, self.evals
            )
            if self.controller is not None:
                rows += reporting.mecefo_rows(self.controller, self.history)
            if self.abft is not None:
                rows += self.abft.counters.rows()
            if self.fail_slow is not None:
                rows += self.fail_slow.summary_rows()
            if self.saved:
                rows.append(("checkpoints", f"iterations {self.saved} in {a.save}"))
            if self.recovery is not None:
                rows += self.recovery.summary_rows()
            rows.append(("wall time", f"{wall_s:.1f} s"))
            self.log.summary(rows)
        self.log.close()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _loss_func(loss_mask: Any, output_tensor: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Megatron-LM's GPT loss: (sum of token losses, token count, report [sum, count])."""
    import torch

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


if __name__ == "__main__":  # required: dist_checkpointing's writer spawns processes
    main()
