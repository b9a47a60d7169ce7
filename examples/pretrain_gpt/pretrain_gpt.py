"""Compact Megatron-Core GPT pretraining, on CPU (gloo) or GPU (nccl).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=8 examples/pretrain_gpt/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --data-path data/stdlib_text_document --train-iters 100

Real megatron-core throughout: GPTModel, DistributedDataParallel, get_megatron_optimizer, the
pipeline schedules, dist_checkpointing and the GPT datasets. On the CPU the plugin's CPU runtime
(megatron_mecefo.runtime) supplies the CUDA plumbing megatron-core expects.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from datetime import timedelta
from functools import partial
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import parse_args  # noqa: E402  (validated before torch is imported)

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
    device = _select_device(args)
    if os.environ.get("MECEFO_RECOVERY"):  # under megatron_mecefo.recovery.supervisor
        from megatron_mecefo.recovery.generations import run_recoverable

        trainer = run_recoverable(args, lambda session: Trainer(args, device, session))
    else:
        trainer = Trainer(args, device)
        trainer.train()
    trainer.finish(time.perf_counter() - t_start)


def _select_device(args: Any) -> "torch.device":  # noqa: F821
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        _fail("--device=cuda: CUDA is not available on this machine; use --device cpu")
    # Checked here, by every rank alike: a rank that failed alone later would leave the others
    # waiting in a collective.
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        _fail(
            f"--tensorboard-dir={args.tensorboard_dir}: the tensorboard package is not "
            "installed; pip install tensorboard, or drop the flag"
        )
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and args.transformer_impl == "transformer_engine":
        _fail("--transformer-impl=transformer_engine needs --device cuda; use local on CPU")
    return torch.device(args.device)


def _fail(message: str, code: int = 2) -> None:
    from megatron_mecefo.errors import fail

    fail(message, "pretrain_gpt.py", code)


class Trainer:
    """One training run: distributed setup, model, optimizer, data, loop, eval, checkpoints.

    Under the recovery supervisor it is a :class:`megatron_mecefo.recovery.trainer.
    RecoverableTrainer` (the state, :meth:`rewind_data`, :meth:`hook_phases`, :meth:`emit`,
    :meth:`snapshot_state`, the recovery checkpoint and :meth:`release`).
    """

    def __init__(self, args: Any, device: Any, recovery: Any = None) -> None:
        import torch
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
        if device.type == "cpu":
            from megatron_mecefo.runtime import quiet_cpu_warnings

            quiet_cpu_warnings()  # expected on CPU and printed once per rank
            # 2 cores shared by up to 8 ranks: more threads per rank is 10-20x slower.
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        else:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        from megatron_mecefo.runtime.timeout import pg_timeout_minutes

        try:
            self.timeout_min = pg_timeout_minutes()
        except ValueError as err:
            _fail(str(err))
        if not dist.is_initialized():
            dist.init_process_group(
                backend="gloo" if device.type == "cpu" else "nccl",
                timeout=timedelta(minutes=self.timeout_min),
            )
        self.rank = dist.get_rank()
        if device.type == "cpu":
            from megatron_mecefo.runtime import enable_cpu_runtime

            enable_cpu_runtime()
        self._init_parallel_state()
        self.config = self._transformer_config()
        from megatron_mecefo.data import ByteTokenizer

        self.tokenizer = ByteTokenizer()  # --tokenizer-type's only choice; sets the vocab
        self.model_chunks, self.model = self._build_model()
        self.optimizer, self.scheduler = self._build_optimizer()
        self.tokens_per_step = args.global_batch_size * args.seq_length
        self.iteration, self.consumed_samples = 0, 0
        self.snapshots = self._build_snapshots()
        self.recovery_path = None  # which path restored the state: "local" (holder) or "disk"
        first_world = recovery is None or recovery.generation == 0
        if self.snapshots is not None and args.snapshot_config.directory and first_world:
            self._restore_snapshot()
        self.saved_layouts: dict[int, str] = {}  # iteration -> this rank's position then
        # A later world under the recovery supervisor takes its state from the previous one
        # (or, as a fallback, from RecoverySession's own disk load), not from --load.
        if args.load and self.recovery_path is None and first_world:
            self._load()
        self._build_data()
        self._activation_peak = 0  # auto: decoder activation bytes, largest micro-batch
        self._calibration: list[float] = []  # auto: measured / predicted, failure-free steps
        self.virtual = None  # --mecefo-virtual-replicas: the single-process simulation
        self.controller = self._build_controller() if args.mecefo else None
        self.abft = None
        if args.abft_config is not None:  # --mecefo-abft / --mecefo-abft-inject
            from megatron_mecefo.abft import AbftState, apply_abft

            self.abft = AbftState(args.abft_config, self.rank, args.num_layers)
            apply_abft(self.model_chunks, self.abft)
        self.forward_backward = self._forward_backward_func()
        self.metrics_file = None
        if self.rank == 0 and args.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)
            resumed = args.load or self.recovery_path  # a restart appends to the run's log
            mode = "a" if resumed else recovery.metrics_mode() if recovery else "w"
            self.metrics_file = open(args.metrics_file, mode)
        self.tb = self._tensorboard()
        if getattr(self, "_restore_record", None):
            self._emit(self._restore_record)
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.saved: list[int] = []
        self.built = True
        if recovery is not None:  # restore or heal the state, hook the commit vote
            recovery.on_built(self)

    # ------------------------------------------------------------------ RecoverableTrainer
    def rewind_data(self, consumed_samples: int) -> None:
        """Read the training set from ``consumed_samples`` on (a redone iteration)."""
        self.train_iter = self._iterators(self.train_ds, consumed_samples)

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
        self._emit(record)

    def snapshot_state(self) -> Any:
        return self._snapshot_state()

    def release(self) -> None:
        """Drop every reference (model, optimizer, groups, iterators) of this world."""
        self.__dict__.clear()
        self.built = False

    # ------------------------------------------------------------------ setup
    def _init_parallel_state(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        a = self.args
        ps.initialize_model_parallel(
            tensor_model_parallel_size=a.tensor_model_parallel_size,
            pipeline_model_parallel_size=a.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size,
            # Every DP/TP/PP/CP group gets the same timeout as the default group (megatron-core
            # would give them its own 30 minutes); under the supervisor, the recovery backstop.
            **(
                self.recovery.parallel_state_kwargs()
                if self.recovery
                else {"distributed_timeout_minutes": self.timeout_min}
            ),
        )
        tensor_parallel.model_parallel_cuda_manual_seed(a.seed)

    def _transformer_config(self) -> Any:
        import torch
        import torch.nn.functional as F
        from megatron.core.transformer.transformer_config import TransformerConfig

        a = self.args
        dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
        gloo = self.device.type == "cpu"
        return TransformerConfig(
            num_layers=a.num_layers,
            hidden_size=a.hidden_size,
            ffn_hidden_size=a.ffn_hidden_size,
            num_attention_heads=a.num_attention_heads,
            num_query_groups=a.num_query_groups,
            kv_channels=a.kv_channels,
            tensor_model_parallel_size=a.tensor_model_parallel_size,
            pipeline_model_parallel_size=a.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size,
            sequence_parallel=a.sequence_parallel,
            normalization=a.normalization,
            layernorm_epsilon=a.norm_epsilon,
            gated_linear_unit=a.swiglu,
            activation_func=F.silu if a.swiglu else F.gelu,
            add_bias_linear=a.add_bias_linear,
            init_method_std=a.init_method_std,
            hidden_dropout=a.hidden_dropout,
            attention_dropout=a.attention_dropout,
            bf16=a.bf16,
            fp16=a.fp16,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            use_cpu_initialization=gloo,
            recompute_granularity=a.recompute_granularity,
            recompute_method=a.recompute_method,
            recompute_num_layers=a.recompute_num_layers,
            calculate_per_token_loss=a.calculate_per_token_loss,
            # Fused kernels are CUDA-only (or torch.compile on CPU, 17 s of first-step codegen).
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            # gloo swaps the tensors of batched isend/irecv pairs with one peer under the
            # interleaved schedule: silently wrong gradients. Unbatched p2p is correct.
            batch_p2p_comm=not (gloo and a.virtual_pipeline_model_parallel_size),
            overlap_p2p_comm=bool(gloo and a.virtual_pipeline_model_parallel_size),
        )

    def _build_model(self) -> tuple[list[Any], list[Any]]:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.module import Float16Module

        from megatron_mecefo._optional import have_transformer_engine
        from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec
        from megatron_mecefo.gpt.layout_invariant_init import layout_invariant_init_

        a, cfg = self.args, self.config
        if a.transformer_impl == "auto":
            # --mecefo-abft needs the unfused local attention (TE's fused kernel hides its GEMMs).
            use_te = self.device.type == "cuda" and have_transformer_engine()
            use_te = use_te and a.abft_config is None
            a.transformer_impl = "transformer_engine" if use_te else "local"
        multiple = a.make_vocab_size_divisible_by * a.tensor_model_parallel_size
        a.padded_vocab_size = math.ceil(self.tokenizer.vocab_size / multiple) * multiple
        vpp = a.virtual_pipeline_model_parallel_size
        chunks = []
        for vp_stage in range(vpp) if vpp else [None]:
            spec = gpt_decoder_spec(cfg, a.transformer_impl, vp_stage)
            if a.mecefo:
                from megatron_mecefo.techniques.specs import mecefo_spec

                spec = mecefo_spec(spec, lowrank=a.mecefo_config.techniques.lowrank_ffn)
            if a.abft_config is not None:
                from megatron_mecefo.abft import abft_spec

                spec = abft_spec(spec)
            chunk = GPTModel(
                config=cfg,
                transformer_layer_spec=spec,
                vocab_size=a.padded_vocab_size,
                max_sequence_length=a.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
                position_embedding_type=a.position_embedding_type,
                rotary_base=a.rotary_base,
                vp_stage=vp_stage,
            )
            chunks.append(chunk.to(self.device))
        if a.layout_invariant_init:
            layout_invariant_init_(chunks, cfg, a.seed)
        self.num_params = sum(p.numel() for c in chunks for p in c.parameters())
        wrapped = [Float16Module(cfg, c) for c in chunks] if (a.bf16 or a.fp16) else chunks
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=a.bf16 or a.fp16,
            overlap_grad_reduce=a.overlap_grad_reduce,
            use_distributed_optimizer=a.use_distributed_optimizer,
        )
        model = [
            # Bucketing only for the first chunk, as Megatron-LM does (the others overlap
            # their whole reduction with the first chunk's backward).
            DistributedDataParallel(cfg, ddp_config, m, disable_bucketing=i > 0)
            for i, m in enumerate(wrapped)
        ]
        return chunks, model

    def _build_optimizer(self) -> tuple[Any, Any]:
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        a, cfg = self.args, self.config
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=a.optimizer,
                lr=a.lr,
                min_lr=a.min_lr,
                weight_decay=a.weight_decay,
                adam_beta1=a.adam_beta1,
                adam_beta2=a.adam_beta2,
                adam_eps=a.adam_eps,
                clip_grad=a.clip_grad,
                bf16=a.bf16,
                fp16=a.fp16,
                params_dtype=cfg.params_dtype,
                use_distributed_optimizer=a.use_distributed_optimizer,
            ),
            self.model,
        )
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0 if a.lr_warmup_iters else a.lr,
            max_lr=a.lr,
            min_lr=a.min_lr,
            lr_warmup_steps=a.lr_warmup_iters,
            lr_decay_steps=a.lr_decay_iters,
            lr_decay_style=a.lr_decay_style,
            start_wd=a.weight_decay,
            end_wd=a.weight_decay,
            wd_incr_steps=a.train_iters,
            wd_incr_style="constant",
            # Megatron-LM's defaults: a resume whose LR flags differ from the checkpoint's
            # schedule is refused unless one of the two flags says which one wins.
            use_checkpoint_opt_param_scheduler=a.use_checkpoint_opt_param_scheduler,
            override_opt_param_scheduler=a.override_opt_param_scheduler,
        )
        # The hooks Megatron-LM's train() installs.
        cfg.finalize_model_grads_func = finalize_model_grads
        cfg.grad_scale_func = optimizer.scale_loss
        if a.overlap_grad_reduce:
            one = len(self.model) == 1
            no_sync = [m.no_sync for m in self.model]
            grad_sync = [m.start_grad_sync for m in self.model]
            cfg.no_sync_func = no_sync[0] if one else no_sync
            cfg.grad_sync_func = grad_sync[0] if one else grad_sync
        return optimizer, scheduler

    def _build_data(self) -> None:
        from megatron.core import parallel_state as ps

        from megatron_mecefo.data import PretrainingSampler, build_data_iterator, build_gpt_datasets

        a = self.args
        train_samples = a.train_iters * a.global_batch_size
        eval_samples = a.eval_iters * a.global_batch_size
        cache = a.data_cache_path or (
            os.path.join(os.path.dirname(os.path.abspath(a.data_path[-1])), "cache")
            if a.data_path
            else None
        )
        self.train_ds, self.valid_ds, _ = build_gpt_datasets(
            data_path=a.data_path,
            mock=a.mock_data,
            seq_length=a.seq_length,
            seed=a.seed,
            split=a.split,
            num_samples=(train_samples, eval_samples, 0),
            tokenizer=self.tokenizer,
            cache_dir=cache,
        )
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        if self.recovery is not None:  # the original replica index and count, not the world's
            self.dp_rank, self.dp_size = self.recovery.replica_layout()
        virtual = a.mecefo_virtual_replicas  # one process runs every simulated replica
        if virtual:
            self.dp_rank, self.dp_size = 0, virtual
        if a.log_rank_cpu_time:  # which replica each global rank's CPU time belongs to
            import torch.distributed as dist

            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, self.dp_rank)
            self._dp_ranks = [int(r) for r in every]

        def iterators(dataset: Any, consumed: int) -> Any:
            def one(dp_rank: int = self.dp_rank) -> Any:
                sampler = PretrainingSampler(
                    total_samples=len(dataset),
                    consumed_samples=consumed,
                    micro_batch_size=a.micro_batch_size,
                    data_parallel_rank=dp_rank,
                    data_parallel_size=self.dp_size,
                )
                return build_data_iterator(dataset, sampler)

            if virtual:  # each simulated replica reads its own share, as its rank would
                return [one(r) for r in range(virtual)]
            # The interleaved schedule pulls from one iterator per model chunk, each of
            # which must see every micro-batch.
            vpp = a.virtual_pipeline_model_parallel_size
            return [one() for _ in range(vpp)] if vpp else one()

        self._iterators = iterators
        self.train_iter = iterators(self.train_ds, self.consumed_samples)

    def _build_controller(self) -> Any:
        """The MeCeFO controller: schedule, policy, state and the re-weighting hooks."""
        import torch

        from megatron_mecefo.takeover.controller import MecefoController
        from megatron_mecefo.takeover.data_remap import GlobalBatchLayout
        from megatron_mecefo.techniques.apply import apply_mecefo, mha_group_parameters
        from megatron_mecefo.techniques.state import MecefoState

        a, ft = self.args, self.args.mecefo_config
        state = MecefoState(ft.techniques)
        apply_mecefo(self.model_chunks, state)
        if self.iteration and self.args.load:  # V and its refresh step, as saved
            self._load_mecefo_basis()
        schedule = ft.build_schedule(self.dp_size, a.train_iters)
        if self.recovery is not None:  # plus the real failures, from membership
            schedule = self.recovery.wrap_schedule(schedule)
        controller = MecefoController(
            schedule=schedule,
            policy=ft.build_policy(self.dp_size, state, self.model_chunks),
            state=state,
            replica=self.dp_rank,
            layout=GlobalBatchLayout(a.global_batch_size, a.micro_batch_size, self.dp_size),
            mha_parameters=mha_group_parameters(self.model_chunks),
            calculate_per_token_loss=a.calculate_per_token_loss,
            overlap_grad_reduce=a.overlap_grad_reduce,
        )
        self.config.finalize_model_grads_func = controller.wrap_finalize(
            self.config.finalize_model_grads_func
        )
        from megatron_mecefo.takeover.topology import ReplicaTopology

        # Checks megatron-core's layout against the failure units the schedule names.
        self._print(f"> MeCeFO failure units: {ReplicaTopology.from_parallel_state().describe()}")
        collate = torch.utils.data.default_collate
        self._fetch = lambda indices: collate([self.train_ds[i] for i in indices])
        if a.mecefo_virtual_replicas:
            from megatron_mecefo.takeover.virtual_replicas import VirtualReplicas

            self.virtual = VirtualReplicas(controller, self.model, self.model_chunks, self.config)
        return controller

    def _forward_backward_func(self) -> Any:
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        func = get_forward_backward_func()
        if self.controller is None:
            return func
        import torch

        # A simulated replica that is down adds zeros; the sum over replicas is finalized once.
        finalize = (
            (lambda *_a, **_k: None) if self.virtual else self.config.finalize_model_grads_func
        )
        return self.controller.wrap_forward_backward(
            func,
            fetch=lambda indices: self._fetch(indices),
            finalize=finalize,
            zero_report=lambda: {"lm loss": torch.zeros(2, device=self.device)},
            is_last_stage=lambda: ps.is_pipeline_last_stage(ignore_virtual=True),
        )

    def _tensorboard(self) -> Any:
        if self.rank != 0 or not self.args.tensorboard_dir:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=self.args.tensorboard_dir)

    # ------------------------------------------------------------------ steps
    def _forward_step(self, data_iterator: Any, model: Any) -> tuple[Any, Any]:
        if self.abft is not None:
            self.abft.begin_microbatch(model)
        batch = {k: v.to(self.device) for k, v in next(data_iterator).items()}
        if self._planner_active():  # auto: measure what the planner predicts (activations)
            from megatron_mecefo.techniques.activation_bytes import SavedActivationBytes

            inner = model
            while hasattr(inner, "module"):
                inner = inner.module
            with SavedActivationBytes(inner, scope=getattr(inner, "decoder", None)) as saved:
                output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            self._activation_peak = max(self._activation_peak, saved.nbytes)
            return output, partial(_loss_func, batch["loss_mask"])
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(_loss_func, batch["loss_mask"])

    def _planner_active(self) -> bool:
        """Whether ``--mecefo-policy auto`` runs (its decisions are logged with measurements)."""
        ctrl = getattr(self, "controller", None)
        return ctrl is not None and hasattr(ctrl.policy, "decisions")

    def _planner_measure(self, planner: dict[str, Any], cpu: tuple[float, float]) -> None:
        """Add the measured values next to the decision's predictions (``mecefo.planner``):
        the slowest rank's CPU ms of forward-backward plus optimizer (the critical path) and
        the largest decoder activation bytes one micro-batch saved, both the max over ranks.

        During the first ``--mecefo-planner-calibrate-steps`` failure-free steps (after the
        first) it also collects the critical path; then the profile is rescaled by the median
        measured / predicted ratio, identically on every rank (the values are all-reduced).
        """
        import statistics

        import torch
        import torch.distributed as dist

        both = torch.tensor(
            [float(self._activation_peak), 1e3 * (cpu[0] + cpu[1])],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        self._activation_peak = 0
        planner["measured_peak_activation_bytes"] = int(both[0].item())
        planner["measured_step_ms"] = float(both[1].item())
        policy = self.controller.policy
        steps = self.args.mecefo_config.planner_calibrate_steps
        it = self.iteration + 1
        if steps and it >= 2 and not policy.rescaled:
            if planner["policy"] == "none" and not self.controller.plan.failed:
                self._calibration.append(planner["measured_step_ms"] / planner["predicted_step_ms"])
            if len(self._calibration) >= steps or self.controller.plan.failed:
                if self._calibration:
                    factor = statistics.median(self._calibration)
                    policy.rescale(factor)
                    self._print(
                        f"> MeCeFO planner: calibrated on {len(self._calibration)} failure-free "
                        f"steps: measured critical path / profile = {factor:.3f}; predictions "
                        "are rescaled by it from the next decision on"
                    )

    def _run_schedule(self, data_iterator: Any, forward_only: bool) -> float:
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
        # Sum over every rank: each TP rank of each last stage adds its (equal) share, so
        # loss-sum / token-count is still the mean over the global batch.
        dist.all_reduce(total)
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
                grad_error = self._failure_free_grads()
        t0 = time.perf_counter()
        if ctrl is not None:
            ctrl.begin_iteration(self.iteration + 1, self.consumed_samples)
            mecefo = ctrl.record()
            for line in ctrl.announcements():
                self._print(line)
        self._activation_peak = 0  # not the gradient-error probe's exact micro-batches
        self._zero_grads()
        if self.abft is not None:
            self.abft.start_step(self.iteration + 1)
        cpu0 = time.process_time()
        loss = self._run_schedule(self.train_iter, forward_only=False)
        cpu1 = time.process_time()
        # All ranks agree whether a GEMM stayed bad after its recompute: then no update.
        abft = self.abft.end_step() if self.abft is not None else None
        if grad_error is not None:
            # Before the optimizer step: clipping scales the gradient buffers in place, which
            # would count as error on every iteration whose norm exceeds --clip-grad.
            mecefo["grad_rel_error"] = self._grad_rel_error(grad_error)
        cpu2 = time.process_time()
        no_update = bool(mecefo.get("no_update"))
        if no_update or (abft is not None and abft["skip"]):
            ok, grad_norm = False, None  # every replica down, or ABFT: no update, skipped
        else:
            if self.snapshots is not None:  # the snapshot copy reads what the step writes
                self.snapshots.before_optimizer_step()
            ok, grad_norm, _ = self.optimizer.step()
        cpu = (cpu1 - cpu0, time.process_time() - cpu2)
        if self.virtual is not None:  # the critical path: the slowest simulated replica
            cpu = (max(self.virtual.replica_cpu_s), cpu[1])
        if "planner" in mecefo:  # measured next to the decision's prediction
            self._planner_measure(mecefo["planner"], cpu)
        if ok:  # as Megatron-LM: a skipped iteration does not advance the LR schedule
            self.scheduler.step(increment=1)
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rank_cpu = self._gather_rank_cpu(cpu) if a.log_rank_cpu_time else None
        self.iteration += 1
        self.consumed_samples += a.global_batch_size
        tokens = self.tokens_per_step
        if ctrl is not None:
            tokens = mecefo["samples_processed"] * a.seq_length
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
            **({"abft": abft} if abft is not None else {}),
            **({"rank_cpu_s": rank_cpu} if rank_cpu is not None else {}),
        }

    def _gather_rank_cpu(self, cpu: tuple[float, float]) -> dict[str, list[float]]:
        """Every rank's CPU seconds of (forward-backward, optimizer step), by global rank.

        Process CPU time counts a rank's own work only: a rank blocked in a gloo collective
        does not spin, and ranks sharing a core each count just their share.
        """
        import torch
        import torch.distributed as dist

        mine = torch.tensor(cpu, dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return {
            "fwd_bwd": [float(t[0]) for t in every],
            "optimizer": [float(t[1]) for t in every],
            "dp_rank": self._dp_ranks,
        }

    def _zero_grads(self) -> None:
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _grad_buffers(self) -> list[Any]:
        return [b.grad_data for m in self.model for b in m.buffers]

    def _failure_free_grads(self) -> list[Any]:
        """The synced gradient of this iteration's batch with no replica down.

        Every micro-batch is read by index, so the data iterators do not move, and the RNG
        states are restored afterwards, so the real step runs as if this had not happened.
        """
        import torch
        from megatron.core import tensor_parallel

        rng = (torch.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states())
        self.controller.begin_iteration(
            self.iteration + 1, self.consumed_samples, failure_free=True
        )
        self._zero_grads()
        vpp = self.args.virtual_pipeline_model_parallel_size
        self._run_schedule([None] * vpp if vpp else None, forward_only=False)
        grads = [g.clone() for g in self._grad_buffers()]
        torch.set_rng_state(rng[0])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng[1])
        return grads

    def _grad_rel_error(self, reference: list[Any]) -> float:
        """||g_hat - g|| / ||g|| over the whole model (reduced over the model-parallel ranks)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for g_hat, g in zip(self._grad_buffers(), reference, strict=True):
            sums[0] += (g_hat.double() - g.double()).square().sum()
            sums[1] += g.double().square().sum()
        dist.all_reduce(sums, group=ps.get_model_parallel_group())
        return float(sums[0].sqrt() / sums[1].sqrt())

    def evaluate(self) -> dict[str, Any]:
        """Validation loss and perplexity on the first ``--eval-iters`` global batches."""
        for m in self.model:
            m.eval()
        import torch

        with torch.no_grad():
            it = self._iterators(self.valid_ds, 0)
            losses = [
                self._run_schedule(it, forward_only=True) for _ in range(self.args.eval_iters)
            ]
        for m in self.model:
            m.train()
        loss = sum(losses) / len(losses)
        return {
            "type": "eval",
            "split": "valid",
            "iteration": self.iteration,
            "loss": loss,
            "ppl": math.exp(min(loss, 50.0)),
        }

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        a = self.args
        self._log_start()
        window: list[dict[str, Any]] = []
        while self.iteration < a.train_iters:
            record = self.train_step()
            if self.snapshots is not None:
                self.snapshots.after_step(self._snapshot_state(), self.iteration)
                # Cumulative seconds the training thread spent in snapshot code.
                record["snapshot_s"] = self.snapshots.main_thread_s
                record["snapshot_commit_wait_s"] = self.snapshots.commit_wait_s
                record["snapshot_copy_wait_s"] = self.snapshots.copy_wait_s
                record["snapshot_parity_s"] = self.snapshots.parity_s
            self.history.append(record)
            window.append(record)
            self._emit(record)
            if self.recovery is not None:  # boundary snapshot of RNG and counters
                self.recovery.committed(self)
            if self.iteration % a.log_interval == 0 or self.iteration == a.train_iters:
                self._log_window(window)
                window = []
            check = a.check_weight_hash_across_dp_replicas_interval
            if check and (self.iteration % check == 0 or self.iteration == a.train_iters):
                self._check_dp_replicas()
            if a.eval_iters > 0 and self.iteration % a.eval_interval == 0:
                self._log_eval(self.evaluate())
            if a.save and self.iteration % a.save_interval == 0:
                self._save()
            if a.exit_interval and self.iteration % a.exit_interval == 0:
                break
            self.stop_reason = self._exit_requested()
            if self.stop_reason:
                self._print(
                    f"> exiting at iteration {self.iteration}: {self.stop_reason}"
                    + ("; saving a checkpoint" if a.save else "; no --save, nothing saved")
                )
                break
            if self.recovery is not None:  # snapshot; a planned regroup switches here
                self.recovery.at_boundary(self)
        last_eval = self.evals[-1]["iteration"] if self.evals else None
        if a.eval_iters > 0 and not self.stop_reason and last_eval != self.iteration:
            self._log_eval(self.evaluate())
        if a.save and self.saved[-1:] != [self.iteration]:
            self._save()
        if self.snapshots is not None:
            self.snapshots.flush()

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

    def _check_dp_replicas(self) -> None:
        """Megatron-LM's weight-hash check: every DP replica must hold the same bits."""
        import hashlib

        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        digest = hashlib.sha256()
        for chunk in self.model_chunks:
            for _, param in sorted(chunk.named_parameters()):
                digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy())
        mine = torch.tensor(list(digest.digest()), dtype=torch.uint8, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(ps.get_data_parallel_world_size())]
        dist.all_gather(gathered, mine, group=ps.get_data_parallel_group())
        identical = all(torch.equal(g, gathered[0]) for g in gathered)
        flags = torch.tensor([0.0 if identical else 1.0], device=self.device)
        dist.all_reduce(flags)  # one verdict for the whole job
        record = {
            "type": "dp_weight_check",
            "iteration": self.iteration,
            "identical": bool(flags.item() == 0),
        }
        self._emit(record)
        if not record["identical"]:
            raise RuntimeError(f"iteration {self.iteration}: DP replicas hold different weights")

    def _save(self) -> None:
        from arguments import run_record
        from checkpointing import layout_name, save_checkpoint

        a = self.args
        path = save_checkpoint(
            a.save,
            self.iteration,
            self.model_chunks,
            self.optimizer,
            self.scheduler,
            self.consumed_samples,
            save_optimizer=not a.no_save_optim,
            dist_optimizer=a.use_distributed_optimizer,
            run_record=run_record(a),
        )
        self.saved.append(self.iteration)
        self.saved_layouts[self.iteration] = layout_name()
        self._print(f"saved checkpoint at iteration {self.iteration} to {path}")

    def recovery_checkpoint(self, before: int) -> Optional[tuple[str, int]]:
        """The newest checkpoint of ``--save``, else of ``--load``, at or before iteration
        ``before``, as ``(directory, iteration)``; None without one. Where a run under the
        recovery supervisor falls back to when its in-memory snapshots cannot serve."""
        from arguments import ConfigError
        from checkpointing import latest_iteration

        for directory in (self.args.save, self.args.load):
            if not directory:
                continue
            try:
                iteration = latest_iteration(directory)
            except ConfigError:
                continue
            if iteration is not None and 0 < iteration <= before:
                return directory, iteration
        return None

    def load_recovery_checkpoint(self, directory: str, basis_layout: Optional[str]) -> float:
        """Collective: load the newest checkpoint of ``directory`` into this world's model and
        optimizer (the distributed optimizer re-sharded over this world's data-parallel size),
        and the low-rank bases this rank saved (``basis_layout``: its position when it saved);
        sets the iteration and consumed samples. Returns the seconds it took."""
        from checkpointing import load_checkpoint, load_mecefo_basis

        a = self.args
        t0 = time.perf_counter()
        self.iteration, self.consumed_samples = load_checkpoint(
            directory,
            self.model_chunks,
            self.optimizer,
            self.scheduler,
            load_optimizer=not a.no_load_optim,
            dist_optimizer=a.use_distributed_optimizer,
        )
        ckpt_dir = os.path.join(directory, f"iter_{self.iteration:07d}")
        load_mecefo_basis(ckpt_dir, self.model_chunks, basis_layout)
        return time.perf_counter() - t0

    def _build_snapshots(self) -> Any:
        config = self.args.snapshot_config
        if config is None:
            return None
        if self.recovery is not None:
            return self.recovery.snapshot_manager(config)
        from megatron_mecefo.snapshot.manager import megatron_snapshot_manager

        manager = megatron_snapshot_manager(config, self.rank, self._print)
        manager.prepare()  # the parity group, built collectively by every rank (redundancy)
        return manager

    def _snapshot_state(self) -> Any:
        from megatron_mecefo.snapshot.contents import TrainingState

        extra = {}
        ctrl = getattr(self, "controller", None)
        if ctrl is not None:  # the takeover rolls back to the snapshot: these too
            extra["controller"] = {k: getattr(ctrl, k) for k in CONTROLLER_COUNTERS}
        return TrainingState(
            self.model_chunks,
            self.optimizer,
            self.scheduler,
            {"iteration": self.iteration, "consumed_samples": self.consumed_samples},
            extra,
        )

    def _restore_snapshot(self) -> None:
        """Resume from the holder's newest snapshot every rank holds intact, if any."""
        from megatron_mecefo.snapshot.contents import SnapshotMismatch

        state = self._snapshot_state()
        try:
            served = self.snapshots.restore(state)
        except SnapshotMismatch as err:  # every rank holds snapshots of the same run
            _fail(
                f"--mecefo-snapshot-dir {self.args.snapshot_config.directory}: {err}; pass the "
                "flags of the run that took it, or start a new holder (another directory)",
                1,
            )
        if served is not None:
            self.iteration = int(state.counters["iteration"])
            self.consumed_samples = int(state.counters["consumed_samples"])
            self.recovery_path = "local"
            self._restore_record = {"type": "snapshot_restore", **served}

    def _load(self) -> None:
        from arguments import ConfigError
        from checkpointing import load_checkpoint

        a = self.args
        t0 = time.perf_counter()
        try:
            loaded = load_checkpoint(
                a.load,
                self.model_chunks,
                self.optimizer,
                self.scheduler,
                load_optimizer=not a.no_load_optim,
                dist_optimizer=a.use_distributed_optimizer,
            )
        except ConfigError as err:  # every rank checks the same files: all stop here
            _fail(str(err), err.exit_code)
        self.iteration, self.consumed_samples = loaded
        if self.iteration:
            self.recovery_path = "disk"
            self._print(
                f"loaded checkpoint from {a.load} at iteration {self.iteration} "
                f"(consumed samples {self.consumed_samples}); recovery path disk "
                f"(dist_checkpointing), {time.perf_counter() - t0:.3f} s"
            )

    def _load_mecefo_basis(self) -> None:
        from checkpointing import load_mecefo_basis

        ckpt_dir = os.path.join(self.args.load, f"iter_{self.iteration:07d}")
        restored = load_mecefo_basis(ckpt_dir, self.model_chunks)
        if restored is None:
            self._print(
                "WARNING: the checkpoint holds no MeCeFO low-rank basis for this layout; V is "
                "recomputed at the first takeover, so the run may differ from an uninterrupted one"
            )
        elif restored:
            self._print(f"> MeCeFO: restored {restored} low-rank bases from the checkpoint")

    # ------------------------------------------------------------------ output
    def _print(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def _emit(self, record: dict[str, Any]) -> None:
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        if self.tb is not None and "loss" in record:
            prefix = "train" if record["type"] == "train" else record["split"]
            for key in ("loss", "grad_norm", "lr", "tokens_per_s", "ppl"):
                if key in record:
                    self.tb.add_scalar(f"{prefix}/{key}", record[key], record["iteration"])

    def _log_start(self) -> None:
        a = self.args
        vpp = a.virtual_pipeline_model_parallel_size
        backend = "gloo" if self.device.type == "cpu" else "nccl"
        self._print(
            f"> training GPT: TP{a.tensor_model_parallel_size} x "
            f"PP{a.pipeline_model_parallel_size} x DP{a.data_parallel_size}"
            f"{f' x VPP{vpp}' if vpp else ''}"
            f" on {a.world_size} {self.device.type} ranks ({backend}), "
            f"{'every replica simulated in this process, ' if a.mecefo_virtual_replicas else ''}"
            f"{a.num_layers} layers, hidden {a.hidden_size}, ffn {a.ffn_hidden_size}, "
            f"{a.num_attention_heads} heads, seq {a.seq_length}, vocab {a.padded_vocab_size}, "
            f"{self.num_params:,} params on rank 0, spec {a.transformer_impl}; "
            f"global batch {a.global_batch_size} = {a.num_microbatches} micro-batches x "
            f"{a.micro_batch_size} x DP{a.data_parallel_size}"
        )

    def _log_window(self, window: list[dict[str, Any]]) -> None:
        a = self.args
        last = window[-1]

        def mean(key: str) -> Optional[float]:
            # Iterations without an update (every replica down) have no loss: leave them out.
            values = [r[key] for r in window if r[key] is not None and not math.isnan(r[key])]
            return sum(values) / len(values) if values else None

        loss, grad_norm = mean("loss"), mean("grad_norm")
        # As Megatron-LM: a window of skipped iterations only shows the skipped count.
        loss_text = "" if loss is None else f" lm loss: {loss:.6E} |"
        norm_text = "" if grad_norm is None else f" grad norm: {grad_norm:.3f} |"

        tokens_per_s = sum(r["tokens"] for r in window) / sum(r["step_time_s"] for r in window)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._print(
            f" [{stamp}] iteration {last['iteration']:>8d}/{a.train_iters:>8d} |"
            f" consumed samples: {last['consumed_samples']:>10d} |"
            f" elapsed time per iteration (ms): {1000 * mean('step_time_s'):.1f} |"
            f" learning rate: {last['lr']:.6E} |"
            f" global batch size: {a.global_batch_size:>5d} |"
            f"{loss_text}{norm_text}"
            f" tokens/s: {tokens_per_s:.0f} |"
            f" number of skipped iterations: {sum(r['skipped'] for r in window):>3d} |"
            + self._mecefo_window(window)
        )

    @staticmethod
    def _mecefo_window(window: list[dict[str, Any]]) -> str:
        """The MeCeFO part of a log line: the window's degraded iterations and the last plan."""
        if "mecefo" not in window[-1]:
            return ""
        m = window[-1]["mecefo"]
        degraded = sum(r["mecefo"]["degraded"] for r in window)
        text = f" mecefo degraded iterations: {degraded:>3d} |"
        if m["degraded"]:
            text += (
                f" failed replicas: {m['failed_replicas']} | takeover micro-batches:"
                f" {m['takeover_microbatches']} | MHA exact fraction:"
                f" {m['mha_exact_fraction']:.2f} |"
            )
        errors = [r["mecefo"]["grad_rel_error"] for r in window if "grad_rel_error" in r["mecefo"]]
        if errors:
            text += f" grad rel error: {errors[-1]:.3f} |"
        return text

    def _log_eval(self, record: dict[str, Any]) -> None:
        self.evals.append(record)
        self._emit(record)
        line = (
            f" validation loss at iteration {record['iteration']} | lm loss value: "
            f"{record['loss']:.6E} | lm loss PPL: {record['ppl']:.6E} |"
        )
        self._print("-" * len(line) + "\n" + line + "\n" + "-" * len(line))

    def _mecefo_summary_rows(self) -> list[tuple[str, str]]:
        ctrl = self.controller
        recs = [r["mecefo"] for r in self.history]
        degraded = [r for r in self.history if r["mecefo"]["degraded"]]
        healthy = [r for r in self.history[1:] if not r["mecefo"]["degraded"]]
        mean = lambda rs: sum(r["step_time_s"] for r in rs) / len(rs)  # noqa: E731
        rows = [
            ("mecefo policy", f"{ctrl.policy.name} ({ctrl.schedule.description})"),
            (
                "degraded iterations",
                f"{len(degraded)} of {len(self.history)}"
                f" ({sum(bool(r['fallback']) for r in recs)} with a fallback,"
                f" {sum(r['no_update'] for r in recs)} without an update)",
            ),
            (
                "samples processed / skipped",
                f"{sum(r['samples_processed'] for r in recs)}"
                f" / {sum(r['samples_skipped'] for r in recs)}",
            ),
            ("takeover micro-batches", f"{sum(r['takeover_microbatches'] for r in recs)}"),
        ]
        if degraded and healthy:
            rows.append(
                (
                    "step time healthy/degraded",
                    f"{mean(healthy):.3f} s / {mean(degraded):.3f} s"
                    f" (x{mean(degraded) / mean(healthy):.2f}; ranks share the CPU cores,"
                    " so this is total work, not the critical path)",
                )
            )
        errors = [r["grad_rel_error"] for r in recs if "grad_rel_error" in r]
        if errors:
            rows.append(
                (
                    "grad rel error",
                    f"mean {sum(errors) / len(errors):.3f}, max {max(errors):.3f}"
                    f" ({len(errors)} measurements)",
                )
            )
        return rows

    def finish(self, wall_s: float) -> None:
        """Print the summary table and shut the process group down."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        a = self.args
        if self.rank == 0 and self.history:
            steady = self.history[1:] or self.history  # the first step pays one-off costs
            step_s = sum(r["step_time_s"] for r in steady) / len(steady)
            throughput = sum(r["tokens"] for r in steady) / sum(r["step_time_s"] for r in steady)
            rows = [
                (
                    "layout",
                    f"TP{a.tensor_model_parallel_size} x PP{a.pipeline_model_parallel_size}"
                    f" x DP{a.data_parallel_size} ({a.world_size} ranks, {self.device.type})",
                ),
                (
                    "iterations",
                    f"{self.history[0]['iteration']} -> {self.history[-1]['iteration']}"
                    f" ({self.consumed_samples} samples consumed)",
                ),
                ("lm loss first -> last", _first_last_loss(self.history)),
                ("mean step time", f"{step_s:.3f} s (iterations after the first)"),
                ("throughput", f"{throughput:,.0f} tokens/s (processed tokens)"),
            ]
            if self.evals:
                ev = self.evals[-1]
                rows.append(
                    (
                        "validation loss / ppl",
                        f"{ev['loss']:.4f} / {ev['ppl']:.2f}" f" (iteration {ev['iteration']})",
                    )
                )
            if self.controller is not None:
                rows += self._mecefo_summary_rows()
            if self.abft is not None:
                rows += self.abft.counters.rows()
            if self.saved:
                rows.append(("checkpoints", f"iterations {self.saved} in {a.save}"))
            if self.recovery is not None:
                rows += self.recovery.summary_rows()
            rows.append(("wall time", f"{wall_s:.1f} s"))
            width = max(len(k) for k, _ in rows)
            print("=" * 30 + " training summary " + "=" * 30)
            for key, value in rows:
                print(f" {key:<{width}}  {value}")
            print("=" * 78, flush=True)
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.tb is not None:
            self.tb.close()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


CONTROLLER_COUNTERS = (
    "degraded_iterations",
    "fallback_iterations",
    "samples_processed",
    "samples_skipped",
)
"""The MeCeFO controller's running counts, kept in snapshots."""


def _first_last_loss(history: list[dict[str, Any]]) -> str:
    """First and last loss of the iterations that computed one (not the skipped ones)."""
    losses = [r["loss"] for r in history if r["loss"] is not None]
    return f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "none (no iteration updated)"


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
