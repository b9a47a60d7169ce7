"""Building a run from its flags: parallel state, transformer config, model, optimizer, data and
the MeCeFO controller (Megatron-LM's providers, in the example trainer's terms).

Torch and megatron-core are imported inside the functions: ``pretrain_gpt.py`` imports this
module before its flags are checked, and a bad flag must fail before torch is imported.
"""

from __future__ import annotations

import importlib.util
import math
import os
from datetime import timedelta
from typing import Any, Callable, Optional

from arguments import PROG

from megatron_mecefo.errors import fail


def select_device(args: Any) -> Any:
    """The ``torch.device`` of ``--device`` (``auto`` resolved), after the checks that need
    torch; a bad choice stops every rank with one line."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device=cuda: CUDA is not available on this machine; use --device cpu", PROG)
    # Checked here, by every rank alike: a rank that failed alone later would leave the others
    # waiting in a collective.
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        fail(
            f"--tensorboard-dir={args.tensorboard_dir}: the tensorboard package is not "
            "installed; pip install tensorboard, or drop the flag",
            PROG,
        )
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and args.transformer_impl == "transformer_engine":
        fail("--transformer-impl=transformer_engine needs --device cuda; use local on CPU", PROG)
    return torch.device(args.device)


def init_distributed(device: Any) -> int:
    """This process's threads and device, the default process group (gloo on CPU, nccl on
    GPU) and, on CPU, the plugin's CPU runtime; returns the process-group timeout (minutes)."""
    import torch
    import torch.distributed as dist

    if device.type == "cpu":
        from megatron_mecefo.runtime import quiet_cpu_warnings

        quiet_cpu_warnings()  # expected on CPU and printed once per rank
        # 2 cores shared by up to 8 ranks: more threads per rank is 10-20x slower.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    else:
        # Modulo the devices: ranks may share a GPU (the one-GPU recovery benchmark, over gloo).
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    from megatron_mecefo.runtime.timeout import pg_timeout_minutes

    try:
        timeout_min = pg_timeout_minutes()
    except ValueError as err:
        fail(str(err), PROG)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="gloo" if device.type == "cpu" else "nccl",
            timeout=timedelta(minutes=timeout_min),
        )
    if device.type == "cpu":
        from megatron_mecefo.runtime import enable_cpu_runtime

        enable_cpu_runtime()
    return timeout_min


def init_parallel_state(args: Any, recovery: Any, timeout_min: int) -> None:
    """megatron-core's model-parallel groups and the model-parallel RNG seeds."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        # Every DP/TP/PP/CP group gets the same timeout as the default group (megatron-core
        # would give them its own 30 minutes); under the supervisor, the recovery backstop.
        **(
            recovery.parallel_state_kwargs()
            if recovery
            else {"distributed_timeout_minutes": timeout_min}
        ),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def transformer_config(args: Any, device: Any, initialize: bool = True) -> Any:
    """The ``TransformerConfig`` of the flags (fused kernels off: they are CUDA-only);
    ``initialize`` False when a recovery overwrites every weight (the carry or a heal)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    a = args
    dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
    gloo = device.type == "cpu"
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
        perform_initialization=initialize,
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


def build_model(
    args: Any, config: Any, device: Any, vocab_size: int
) -> tuple[list[Any], list[Any], int]:
    """The GPT model chunks (one per virtual stage) with the MeCeFO / ABFT layer specs, and
    their DDP wrappers; returns ``(chunks, ddp_wrapped, parameters on this rank)``.

    Sets ``args.transformer_impl`` (``auto`` resolved) and ``args.padded_vocab_size``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from megatron_mecefo._optional import have_transformer_engine
    from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec
    from megatron_mecefo.gpt.layout_invariant_init import layout_invariant_init_

    a, cfg = args, config
    if a.transformer_impl == "auto":
        # --mecefo-abft needs the unfused local attention (TE's fused kernel hides its GEMMs).
        use_te = device.type == "cuda" and have_transformer_engine()
        use_te = use_te and a.abft_config is None
        a.transformer_impl = "transformer_engine" if use_te else "local"
    multiple = a.make_vocab_size_divisible_by * a.tensor_model_parallel_size
    a.padded_vocab_size = math.ceil(vocab_size / multiple) * multiple
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
        chunks.append(chunk.to(device))
    if a.layout_invariant_init and cfg.perform_initialization:
        layout_invariant_init_(chunks, cfg, a.seed)
    num_params = sum(p.numel() for c in chunks for p in c.parameters())
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
    return chunks, model, num_params


def build_optimizer(args: Any, config: Any, model: list[Any]) -> tuple[Any, Any]:
    """megatron-core's optimizer and LR scheduler; installs the grad hooks on ``config``."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    a, cfg = args, config
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
        model,
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
        one = len(model) == 1
        no_sync = [m.no_sync for m in model]
        grad_sync = [m.start_grad_sync for m in model]
        cfg.no_sync_func = no_sync[0] if one else no_sync
        cfg.grad_sync_func = grad_sync[0] if one else grad_sync
    return optimizer, scheduler


def build_datasets(args: Any, tokenizer: Any) -> tuple[Any, Any]:
    """The training and validation sets (``--data-path`` or ``--mock-data``)."""
    from megatron_mecefo.data import build_gpt_datasets

    a = args
    train_samples = a.train_iters * a.global_batch_size
    eval_samples = a.eval_iters * a.global_batch_size
    cache = a.data_cache_path or (
        os.path.join(os.path.dirname(os.path.abspath(a.data_path[-1])), "cache")
        if a.data_path
        else None
    )
    train_ds, valid_ds, _ = build_gpt_datasets(
        data_path=a.data_path,
        mock=a.mock_data,
        seq_length=a.seq_length,
        seed=a.seed,
        split=a.split,
        num_samples=(train_samples, eval_samples, 0),
        tokenizer=tokenizer,
        cache_dir=cache,
    )
    return train_ds, valid_ds


def replica_layout(args: Any, recovery: Any) -> tuple[int, int]:
    """``(data-parallel rank, size)`` whose share of each global batch this rank reads."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if recovery is not None:  # the original replica index and count, not the world's
        dp_rank, dp_size = recovery.replica_layout()
    if args.mecefo_virtual_replicas:  # one process runs every simulated replica
        dp_rank, dp_size = 0, args.mecefo_virtual_replicas
    return dp_rank, dp_size


def iterator_factory(args: Any, dp_rank: int, dp_size: int) -> Callable[[Any, int], Any]:
    """``iterators(dataset, consumed_samples)``: what the schedule reads from, from a sample on
    (one iterator, one per model chunk, or one per simulated replica)."""
    from megatron_mecefo.data import PretrainingSampler, build_data_iterator

    a = args
    virtual = a.mecefo_virtual_replicas

    def iterators(dataset: Any, consumed: int) -> Any:
        def one(rank: int = dp_rank) -> Any:
            sampler = PretrainingSampler(
                total_samples=len(dataset),
                consumed_samples=consumed,
                micro_batch_size=a.micro_batch_size,
                data_parallel_rank=rank,
                data_parallel_size=dp_size,
            )
            return build_data_iterator(dataset, sampler)

        if virtual:  # each simulated replica reads its own share, as its rank would
            return [one(r) for r in range(virtual)]
        # The interleaved schedule pulls from one iterator per model chunk, each of
        # which must see every micro-batch.
        vpp = a.virtual_pipeline_model_parallel_size
        return [one() for _ in range(vpp)] if vpp else one()

    return iterators


def build_controller(
    args: Any,
    model_chunks: list[Any],
    config: Any,
    replica: int,
    dp_size: int,
    recovery: Any,
    load_basis: Optional[Callable[[], None]],
    print_line: Callable[[str], None],
) -> Any:
    """The MeCeFO controller: schedule, policy, state and the re-weighting hooks.

    ``load_basis`` (a resume with ``--load``) restores the saved low-rank bases once the
    MeCeFO modules are in place. Wraps ``config.finalize_model_grads_func``.
    """
    from megatron_mecefo.techniques.apply import apply_mecefo
    from megatron_mecefo.techniques.state import MecefoState

    a, ft = args, args.mecefo_config
    state = MecefoState(ft.techniques)
    apply_mecefo(model_chunks, state)
    if load_basis is not None:  # V and its refresh step, as saved
        load_basis()
    schedule = ft.build_schedule(dp_size, a.train_iters)
    if recovery is not None:  # plus the real failures, from membership
        schedule = recovery.wrap_schedule(schedule)
    controller = ft.build_controller(a, state, model_chunks, replica, dp_size, schedule)
    config.finalize_model_grads_func = controller.wrap_finalize(config.finalize_model_grads_func)
    from megatron_mecefo.takeover.topology import ReplicaTopology

    # Checks megatron-core's layout against the failure units the schedule names.
    print_line(f"> MeCeFO failure units: {ReplicaTopology.from_parallel_state().describe()}")
    return controller


def forward_backward_func(
    controller: Any, virtual: Any, config: Any, fetch: Callable[[list[int]], Any], device: Any
) -> Any:
    """megatron-core's pipeline schedule; with ``--mecefo``, run through the takeover plan."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    func = get_forward_backward_func()
    if controller is None:
        return func
    import torch

    # A simulated replica that is down adds zeros; the sum over replicas is finalized once.
    finalize = (lambda *_a, **_k: None) if virtual else config.finalize_model_grads_func
    return controller.wrap_forward_backward(
        func,
        fetch=fetch,
        finalize=finalize,
        zero_report=lambda: {"lm loss": torch.zeros(2, device=device)},
        is_last_stage=lambda: ps.is_pipeline_last_stage(ignore_virtual=True),
    )
