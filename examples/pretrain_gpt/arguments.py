"""Command-line flags of the example trainer: Megatron-LM's names, meanings and checks.

Everything here runs before torch is imported, so a bad flag combination fails in well under a
second, with one line that names the flag, the value and the fix, instead of deep inside a
collective after eight processes have loaded megatron-core.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from megatron_mecefo.errors import UserError, check_writable_dir, check_writable_file, fail

PROG = "pretrain_gpt.py"


class ConfigError(UserError, ValueError):
    """A bad flag (combination) or input file; the message names the flag, the value and the
    fix. ``usage=False`` for a file made by something else (exit 1 instead of 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line from rank 0 (no usage dump, not once per rank)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(f"{message} (--help lists the flags)", prog=self.prog)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's parser. Defaults describe a small LLaMA-style GPT that trains on CPU."""
    p = _Parser(
        prog=PROG,
        description="Compact Megatron-Core GPT pretraining (CPU/gloo or GPU/nccl).",
        allow_abbrev=False,
    )
    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Degree of tensor model parallelism (ranks that split each layer).",
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Degree of pipeline model parallelism (stages the layers are split into).",
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Layers per virtual pipeline stage (interleaved 1F1B schedule).",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Split norm/dropout activations along the sequence over the TP ranks (needs TP > 1).",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard the optimizer state over the data-parallel ranks (ZeRO-1; Adam only).",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="Overlap the data-parallel gradient reduction with the backward pass.",
    )
    g.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cpu: gloo + the plugin's CPU runtime; cuda: nccl; auto: cuda if available.",
    )

    g = p.add_argument_group("model (LLaMA-style by default)")
    g.add_argument("--num-layers", type=int, default=4, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, default=128, help="Transformer hidden size.")
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="Default: 4*hidden, or Megatron's SwiGLU size int(8*hidden/3/64)*64.",
    )
    g.add_argument(
        "--num-attention-heads",
        type=int,
        default=4,
        help="Number of attention heads (must divide --hidden-size).",
    )
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Use grouped-query attention with --num-query-groups key/value groups.",
    )
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=1,
        help="Key/value head groups with --group-query-attention (otherwise one per head).",
    )
    g.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="Projection size of each attention head. Default: hidden size / attention heads.",
    )
    g.add_argument(
        "--seq-length",
        type=int,
        default=128,
        help="Maximum sequence length to process, in tokens (each training sample's length).",
    )
    g.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Largest position the position embedding covers. Default: --seq-length.",
    )
    g.add_argument(
        "--normalization",
        choices=("RMSNorm", "LayerNorm"),
        default="RMSNorm",
        help="Normalization layer used in the transformer layers and the final norm.",
    )
    g.add_argument(
        "--norm-epsilon", type=float, default=1e-5, help="Epsilon for LayerNorm and RMSNorm."
    )
    g.add_argument(
        "--swiglu", action=argparse.BooleanOptionalAction, default=True, help="SwiGLU MLP."
    )
    g.add_argument(
        "--add-bias-linear",
        dest="add_bias_linear",
        action="store_true",
        help="Add a bias to every linear layer (attention and MLP).",
    )
    g.add_argument(
        "--disable-bias-linear",
        dest="add_bias_linear",
        action="store_false",
        help="No bias in the linear layers (the default).",
    )
    g.set_defaults(add_bias_linear=False)
    g.add_argument(
        "--position-embedding-type",
        choices=("rope", "learned_absolute"),
        default="rope",
        help="Position embedding: rotary (rope) or learned absolute.",
    )
    g.add_argument(
        "--rotary-base",
        type=int,
        default=10000,
        help="Base of the rotary position embedding's frequencies.",
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        dest="untie_embeddings_and_output_weights",
        action="store_true",
        help="Separate weights for the input embedding and the output layer (the default).",
    )
    g.add_argument(
        "--tie-embeddings-and-output-weights",
        dest="untie_embeddings_and_output_weights",
        action="store_false",
        help="Share one weight between the input embedding and the output layer.",
    )
    g.set_defaults(untie_embeddings_and_output_weights=True)
    g.add_argument(
        "--init-method-std",
        type=float,
        default=0.02,
        help="Standard deviation of the zero-mean normal weight initialization.",
    )
    g.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.0,
        help="Dropout probability on the transformer's hidden state.",
    )
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=0.0,
        help="Dropout probability on the attention probabilities.",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this times --tensor-model-parallel-size.",
    )
    g.add_argument(
        "--transformer-impl",
        choices=("auto", "local", "transformer_engine"),
        default="auto",
        help="auto: transformer_engine on GPU when it is installed, else local.",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="Activation recomputation: full layers, or only the attention core (selective).",
    )
    g.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        default=None,
        help="Full recompute: uniform (N-layer chunks) or block (first N layers per stage).",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="N of --recompute-method: layers per chunk (uniform) or per stage (block); default 1.",
    )
    g.add_argument(
        "--bf16",
        action="store_true",
        help="Train in bfloat16 mixed precision (fp32 main weights and gradient reduction).",
    )
    g.add_argument(
        "--fp16",
        action="store_true",
        help="Train in float16 mixed precision with dynamic loss scaling.",
    )
    g.add_argument(
        "--layout-invariant-init",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Draw every weight from its global tensor, so every TP/PP layout starts equal.",
    )

    g = p.add_argument_group("training")
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=2,
        help="Samples per micro-batch on each data-parallel replica.",
    )
    g.add_argument("--global-batch-size", type=int, default=None, help="Default: micro-batch × DP.")
    g.add_argument(
        "--train-iters",
        type=int,
        default=100,
        help="Total iterations (global batches) to train for.",
    )
    g.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help="Peak learning rate (after --lr-warmup-iters), then decayed by --lr-decay-style.",
    )
    g.add_argument(
        "--min-lr",
        type=float,
        default=0.0,
        help="Learning rate the decay ends at (a floor for it).",
    )
    g.add_argument(
        "--lr-warmup-iters",
        type=int,
        default=0,
        help="Iterations of linear learning-rate warmup from 0 to --lr.",
    )
    g.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Iterations to decay the learning rate over. Default: --train-iters.",
    )
    g.add_argument(
        "--lr-decay-style",
        choices=("constant", "linear", "cosine"),
        default="cosine",
        help="Learning-rate decay from --lr to --min-lr after the warmup.",
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=0.01,
        help="Weight-decay coefficient for L2 regularization (constant over the run).",
    )
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's first-moment coefficient.")
    g.add_argument(
        "--adam-beta2", type=float, default=0.999, help="Adam's second-moment coefficient."
    )
    g.add_argument(
        "--adam-eps",
        type=float,
        default=1e-8,
        help="Term added to Adam's denominator for numerical stability.",
    )
    g.add_argument(
        "--clip-grad",
        type=float,
        default=1.0,
        help="Clip gradients to this global L2 norm; 0 turns clipping off.",
    )
    g.add_argument(
        "--optimizer",
        choices=("adam", "sgd"),
        default="adam",
        help="Optimizer (megatron-core's Adam, i.e. AdamW, or SGD).",
    )
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Average the loss over all tokens of the global batch, not per micro-batch.",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="Random seed for init, dropout and data shuffling (also --mecefo-seed's default).",
    )

    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Megatron indexed dataset prefix(es), optionally weighted: [W1] P1 [W2] P2 ...",
    )
    g.add_argument("--mock-data", action="store_true", help="Megatron's MockGPTDataset.")
    g.add_argument(
        "--split",
        default="969,30,1",
        help="Comma-separated weights of the train, validation and test splits, e.g. 969,30,1.",
    )
    g.add_argument(
        "--data-cache-path",
        default=None,
        help="Dataset index cache directory. Default: cache/ beside the last --data-path prefix.",
    )
    g.add_argument(
        "--tokenizer-type",
        choices=("ByteTokenizer",),
        default="ByteTokenizer",
        help="Tokenizer the dataset was built with; it sets the vocabulary size.",
    )

    g = p.add_argument_group("evaluation and logging")
    g.add_argument(
        "--log-interval",
        type=int,
        default=10,
        help="Print a training log line (means over the window) every N iterations.",
    )
    g.add_argument(
        "--eval-interval",
        type=int,
        default=1000,
        help="Evaluate on the validation split every N iterations (and after the last).",
    )
    g.add_argument(
        "--eval-iters",
        type=int,
        default=10,
        help="Global batches per evaluation; 0 turns evaluation off.",
    )
    g.add_argument("--metrics-file", default=None, help="JSON lines: one per step and eval.")
    g.add_argument(
        "--tensorboard-dir",
        default=None,
        help="Write loss, grad norm, LR, tokens/s and perplexity here for TensorBoard (rank 0).",
    )
    g.add_argument(
        "--log-rank-cpu-time",
        action="store_true",
        help="Record every rank's process CPU seconds of forward-backward and of the optimizer "
        "step in the metrics file (one extra all-gather per iteration). Ranks that share "
        "cores still report their own work, which is how benchmarks/degraded_throughput.py "
        "reads the critical path on a small machine.",
    )
    g.add_argument(
        "--check-weight-hash-across-dp-replicas-interval",
        type=int,
        default=None,
        help="Every N iterations assert that all DP replicas hold bit-identical weights.",
    )

    g = p.add_argument_group("checkpointing")
    g.add_argument(
        "--save",
        default=None,
        help="Directory to save checkpoints to (Megatron-Core dist_checkpointing, iter_NNNNNNN/).",
    )
    g.add_argument(
        "--load",
        default=None,
        help="Directory to resume from (the iteration latest_checkpointed_iteration.txt names).",
    )
    g.add_argument(
        "--save-interval",
        type=int,
        default=None,
        help="Save a checkpoint every N iterations (needs --save). Default: at the end only.",
    )
    g.add_argument(
        "--no-save-optim",
        action="store_true",
        help="Do not save the optimizer state into checkpoints.",
    )
    g.add_argument(
        "--no-load-optim",
        action="store_true",
        help="Do not load the optimizer state on --load (fresh optimizer moments).",
    )
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="Stop after the iteration divisible by this (after saving), as Megatron-LM.",
    )
    g.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="Save (with --save) and exit 0 at the first iteration boundary after this many "
        "minutes of training, as Megatron-LM.",
    )
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On SIGTERM (Slurm's --signal, the recovery supervisor's stop), save (with --save) "
        "at the next iteration boundary and exit 0, as Megatron-LM.",
    )
    g.add_argument(
        "--override-opt-param-scheduler",
        action="store_true",
        help="On --load, take the LR schedule from these flags, not from the checkpoint.",
    )
    g.add_argument(
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        help="On --load, keep the checkpoint's LR schedule and ignore the LR flags.",
    )
    from megatron_mecefo.takeover.arguments import add_arguments

    add_arguments(p)  # --mecefo, --mecefo-*
    from megatron_mecefo.recovery.arguments import add_arguments as add_recovery_arguments

    add_recovery_arguments(p)  # --mecefo-kill (real deaths, under the recovery supervisor)
    from megatron_mecefo.snapshot.arguments import add_arguments as add_snapshot_arguments

    add_snapshot_arguments(p)  # --mecefo-snapshot-* (in-memory snapshots)
    from megatron_mecefo.failslow.arguments import add_arguments as add_fail_slow_arguments

    add_fail_slow_arguments(p)  # --mecefo-fail-slow* (straggling replicas)
    from megatron_mecefo.planner.device_clock import add_arguments as add_clock_arguments

    add_clock_arguments(p)  # --device-clock (emulated GPU phase times)
    p.add_argument_group("MeCeFO simulation (example trainer)").add_argument(
        "--mecefo-virtual-replicas",
        type=int,
        default=None,
        metavar="N",
        help="Simulate N data-parallel replicas in one process: every replica's micro-batches "
        "run in turn under the same takeover plan and re-weighting as a real DP-N run "
        "(megatron_mecefo/takeover/virtual_replicas.py). Launch one process.",
    )
    return p


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag}={value}: must be a positive integer")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check flag combinations and fill derived values; raises :class:`ConfigError`.

    Args:
        args: Parsed flags.
        world_size: Number of ranks (``WORLD_SIZE`` from torchrun).
    """
    _positive(
        args,
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "global_batch_size",
        "train_iters",
        "log_interval",
        "eval_interval",
        "save_interval",
        "num_layers_per_virtual_pipeline_stage",
        "exit_interval",
        "check_weight_hash_across_dp_replicas_interval",
        "make_vocab_size_divisible_by",
        "ffn_hidden_size",
        "kv_channels",
        "max_position_embeddings",
        "num_query_groups",
        "rotary_base",
        "lr_decay_iters",
        "recompute_num_layers",
    )
    _validate_ranges(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp) != 0:
        raise ConfigError(
            f"--tensor-model-parallel-size={tp} x --pipeline-model-parallel-size={pp} = "
            f"{tp * pp} does not divide the world size {world_size}; launch a multiple of "
            f"{tp * pp} ranks or change the sizes"
        )
    args.world_size = world_size
    args.data_parallel_size = dp = world_size // (tp * pp)
    if args.mecefo_virtual_replicas is not None:  # one process stands for N replicas
        _validate_virtual_replicas(args, world_size)
        args.data_parallel_size = dp = args.mecefo_virtual_replicas
    if args.use_distributed_optimizer and args.optimizer != "adam":
        # megatron-core asserts it when it builds the optimizer, after the model.
        raise ConfigError(
            f"--optimizer={args.optimizer} with --use-distributed-optimizer: megatron-core's "
            "distributed optimizer supports Adam only; use --optimizer adam or drop "
            "--use-distributed-optimizer"
        )
    if args.num_layers % pp != 0:
        raise ConfigError(
            f"--num-layers={args.num_layers} is not divisible by "
            f"--pipeline-model-parallel-size={pp}"
        )
    if args.hidden_size % args.num_attention_heads != 0:
        raise ConfigError(
            f"--hidden-size={args.hidden_size} is not divisible by "
            f"--num-attention-heads={args.num_attention_heads}"
        )
    if args.num_attention_heads % tp != 0:
        raise ConfigError(
            f"--num-attention-heads={args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size={tp}"
        )
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_query_groups % tp != 0 or args.num_attention_heads % args.num_query_groups:
        raise ConfigError(
            f"--num-query-groups={args.num_query_groups} must divide --num-attention-heads="
            f"{args.num_attention_heads} and be divisible by --tensor-model-parallel-size={tp}"
        )
    if args.ffn_hidden_size is None:
        if args.swiglu:  # Megatron-LM's rule, keeps FLOPs equal to the 4h GELU MLP
            args.ffn_hidden_size = max(64, int((4 * args.hidden_size * 2 / 3) / 64) * 64)
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.ffn_hidden_size % tp != 0:
        raise ConfigError(
            f"--ffn-hidden-size={args.ffn_hidden_size} is not divisible by "
            f"--tensor-model-parallel-size={tp}"
        )
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(
            f"--seq-length={args.seq_length} exceeds --max-position-embeddings="
            f"{args.max_position_embeddings}"
        )

    mbs = args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    if args.global_batch_size % (mbs * dp) != 0:
        raise ConfigError(
            f"--global-batch-size={args.global_batch_size} is not divisible by "
            f"--micro-batch-size={mbs} x data-parallel size {dp} = {mbs * dp}; use a multiple "
            f"of {mbs * dp}"
        )
    args.num_microbatches = args.global_batch_size // (mbs * dp)

    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        if pp < 2 or per_stage % args.num_layers_per_virtual_pipeline_stage != 0:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage="
                f"{args.num_layers_per_virtual_pipeline_stage} needs "
                f"--pipeline-model-parallel-size > 1 and must divide the {per_stage} layers "
                f"of each pipeline stage"
            )
        args.virtual_pipeline_model_parallel_size = (
            per_stage // args.num_layers_per_virtual_pipeline_stage
        )
        if args.num_microbatches % pp != 0:
            raise ConfigError(
                f"the interleaved schedule needs the number of micro-batches per replica "
                f"({args.num_microbatches}) to be divisible by "
                f"--pipeline-model-parallel-size={pp}; raise --global-batch-size"
            )

    if args.sequence_parallel and tp == 1:
        # Megatron-LM drops SP at TP=1 too; say so rather than ignore the flag silently.
        warn("--sequence-parallel has no effect with --tensor-model-parallel-size=1")
        args.sequence_parallel = False
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive; pick one")
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise ConfigError("--recompute-granularity=full needs --recompute-method uniform|block")
    if args.recompute_method is not None and args.recompute_num_layers is None:
        args.recompute_num_layers = 1

    _validate_data(args)
    _validate_checkpointing(args)
    _validate_mecefo(args)
    _validate_abft(args)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters and args.lr_warmup_iters > 0:
        raise ConfigError(
            f"--lr-warmup-iters={args.lr_warmup_iters} must be below --lr-decay-iters="
            f"{args.lr_decay_iters}"
        )
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr={args.min_lr} exceeds --lr={args.lr}")
    _validate_targets(args)
    _validate_outputs(args)
    _validate_exit(args)
    if args.load:
        _validate_resume(args)
    return args


# The ranges Megatron-LM checks (or relies on without a check); each: (dest, low, high, what
# the bounds mean). None leaves a side open; low is inclusive unless the flag says "> low".
_RANGES = (
    ("lr", 0.0, None, ">= 0"),
    ("min_lr", 0.0, None, ">= 0"),
    ("lr_warmup_iters", 0, None, ">= 0"),
    ("eval_iters", 0, None, ">= 0 (0 turns evaluation off)"),
    ("weight_decay", 0.0, None, ">= 0"),
    ("clip_grad", 0.0, None, ">= 0 (0 turns clipping off)"),
    ("hidden_dropout", 0.0, 1.0, "in [0, 1)"),
    ("attention_dropout", 0.0, 1.0, "in [0, 1)"),
    ("adam_beta1", 0.0, 1.0, "in [0, 1)"),
    ("adam_beta2", 0.0, 1.0, "in [0, 1)"),
    ("seed", 0, None, ">= 0"),
)


def _validate_ranges(args: argparse.Namespace) -> None:
    for dest, low, high, bounds in _RANGES:
        value = getattr(args, dest)
        if value is None:
            continue
        bad = value != value or (low is not None and value < low)  # NaN too
        bad = bad or (high is not None and value >= high)
        if bad:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag}={value}: must be {bounds}; pass a value in that range")
    for dest in ("adam_eps", "norm_epsilon", "init_method_std"):
        value = getattr(args, dest)
        if not value > 0:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag}={value}: must be > 0; pass a positive value")


def _validate_targets(args: argparse.Namespace) -> None:
    """ABFT injections that can never fire (a target beyond the model or the run used to end
    with "0 injected" and no word)."""
    if args.abft_config is not None:
        from megatron_mecefo.abft.inject import parse_rule

        for spec in args.abft_config.inject:
            rule = parse_rule(spec)
            where = f"--mecefo-abft-inject {spec!r}"
            if rule.layer is not None and not 1 <= rule.layer <= args.num_layers:
                raise ConfigError(
                    f"{where}: layer {rule.layer} does not exist (layers 1..{args.num_layers}, "
                    "numbered from 1 as Megatron's layer_number); it would never fire"
                )
            if not 0 <= rule.rank < args.world_size:
                raise ConfigError(
                    f"{where}: rank {rule.rank} does not exist (world size {args.world_size}); "
                    "it would never fire"
                )
            first = rule.iteration if rule.iteration is not None else rule.start or rule.every
            if first is not None and first > args.train_iters:
                raise ConfigError(
                    f"{where}: iteration {first} is after the last one (--train-iters="
                    f"{args.train_iters}); it would never fire"
                )
            if rule.microbatch >= args.num_microbatches:
                raise ConfigError(
                    f"{where}: micro-batch {rule.microbatch} does not exist "
                    f"({args.num_microbatches} per replica per iteration, numbered from 0); it "
                    "would never fire"
                )


def _validate_outputs(args: argparse.Namespace) -> None:
    """Every output is tried with a real write now: an unwritable --save used to be found at
    the first save, after the training it was meant to keep."""
    if args.save:
        check_writable_dir("--save", args.save)
    if args.metrics_file:
        check_writable_file("--metrics-file", args.metrics_file)
    if args.tensorboard_dir:
        check_writable_dir("--tensorboard-dir", args.tensorboard_dir)
    if args.data_cache_path:
        check_writable_dir("--data-cache-path", args.data_cache_path)


def _validate_exit(args: argparse.Namespace) -> None:
    minutes = args.exit_duration_in_mins
    if minutes is not None and not minutes > 0:
        raise ConfigError(f"--exit-duration-in-mins={minutes}: must be > 0 (minutes of training)")
    if (args.exit_signal_handler or minutes is not None) and not args.save:
        which = "--exit-signal-handler" if args.exit_signal_handler else "--exit-duration-in-mins"
        warn(f"{which} without --save: the run stops early and saves nothing")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are "
            "mutually exclusive (take the LR schedule from the flags, or from the checkpoint); "
            "pick one"
        )


def _validate_virtual_replicas(args: argparse.Namespace, world_size: int) -> None:
    from megatron_mecefo.takeover.virtual_replicas import check_virtual_replicas

    given = {
        f"--hidden-dropout={args.hidden_dropout}": args.hidden_dropout > 0,
        f"--attention-dropout={args.attention_dropout}": args.attention_dropout > 0,
        "--overlap-grad-reduce": args.overlap_grad_reduce,
        "--use-distributed-optimizer": args.use_distributed_optimizer,
        "--calculate-per-token-loss": args.calculate_per_token_loss,
        "--save": bool(args.save),
        "--load": bool(args.load),
        "--log-rank-cpu-time": args.log_rank_cpu_time,
        "--mecefo-abft": args.abft or bool(args.abft_inject),
        "--mecefo-snapshot-interval": args.snapshot_interval > 0,
        "--mecefo-kill": bool(args.mecefo_kill),
        "the recovery supervisor (MECEFO_RECOVERY)": bool(os.environ.get("MECEFO_RECOVERY")),
    }
    problem = check_virtual_replicas(
        args.mecefo_virtual_replicas, world_size, [flag for flag, on in given.items() if on]
    )
    if problem:
        raise ConfigError(problem)


def _validate_data(args: argparse.Namespace) -> None:
    if args.mock_data and args.data_path:
        raise ConfigError("--mock-data and --data-path are mutually exclusive; pick one")
    if not args.mock_data and not args.data_path:
        raise ConfigError(
            "no training data: pass --data-path PREFIX (e.g. data/stdlib_text_document, "
            "built by examples/pretrain_gpt/prepare_data.py) or --mock-data"
        )
    try:
        split = [float(x) for x in args.split.split(",")]
    except ValueError:
        split = []
    if not 1 <= len(split) <= 3 or any(x < 0 for x in split) or sum(split) <= 0:
        raise ConfigError(f"--split={args.split}: expected up to three weights, e.g. 969,30,1")
    split += [0.0] * (3 - len(split))
    if args.eval_iters > 0 and split[1] == 0:
        raise ConfigError(
            f"--split={args.split} has no validation part but --eval-iters={args.eval_iters}; "
            "give the second weight a value or pass --eval-iters 0"
        )
    if args.data_path:
        from megatron_mecefo.data.data_path import (
            DatasetFileError,
            check_data_prefix,
            parse_data_path,
        )

        try:
            prefixes = parse_data_path(args.data_path)[0]
            for prefix in prefixes:
                check_data_prefix(prefix)
        except DatasetFileError as err:  # a damaged file, not a bad flag: exit 1
            raise ConfigError(f"--data-path {' '.join(args.data_path)}: {err}", False) from None
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(f"--data-path {' '.join(args.data_path)}: {err}") from None
        for prefix in prefixes:
            _check_tokens(args, prefix)


TOKENIZER_VOCAB = {"ByteTokenizer": 258}
"""Each --tokenizer-type's vocabulary size (megatron_mecefo.data.ByteTokenizer: 256 bytes,
<eod>, <pad>), here so that the data check needs neither torch nor the tokenizer."""


def _check_tokens(args: argparse.Namespace, prefix: str) -> None:
    """The dataset's largest token id must be an id of the tokenizer; it must hold a sample.

    A dataset tokenized with another tokenizer used to fail deep in the embedding
    (``IndexError: index out of range in self``) on every rank.
    """
    from megatron_mecefo.data.data_path import scan_token_ids

    vocab = TOKENIZER_VOCAB[args.tokenizer_type]
    largest, read, total, documents = scan_token_ids(prefix)
    if total == 0:
        raise ConfigError(
            f"--data-path {prefix}: the dataset is empty ({documents} documents, 0 tokens); "
            "build it from a non-empty corpus (examples/pretrain_gpt/prepare_data.py)",
            usage=False,
        )
    if total < args.seq_length + 1:
        raise ConfigError(
            f"--data-path {prefix}: the dataset holds {total} tokens, fewer than one sample of "
            f"--seq-length={args.seq_length} + 1; use more data or a shorter --seq-length",
            usage=False,
        )
    how = "all" if read == total else f"a sample of {read:,}"
    if largest >= vocab:
        raise ConfigError(
            f"--data-path {prefix}: token id {largest} (read {how} of {total:,} tokens) is "
            f"beyond the --tokenizer-type={args.tokenizer_type} vocabulary ({vocab} ids): the "
            "dataset was tokenized with another tokenizer; rebuild it with "
            "examples/pretrain_gpt/prepare_data.py or pass the tokenizer that made it",
            usage=False,
        )
    if int(os.environ.get("RANK", "0")) == 0:  # says how much the check read (a sample?)
        print(
            f"> checked --data-path {prefix}: token ids <= {largest} < vocabulary {vocab}, "
            f"read {how} of {total:,} tokens",
            flush=True,
        )


def _validate_mecefo(args: argparse.Namespace) -> None:
    from megatron_mecefo.cli import mecefo_flags_given
    from megatron_mecefo.takeover.config import FaultToleranceConfig, MecefoConfigError

    try:
        args.mecefo_config = ft = FaultToleranceConfig.from_args(args)
        warnings = ft.validate(
            data_parallel_size=args.data_parallel_size,
            hidden_size=args.hidden_size,
            train_iters=args.train_iters,
            virtual_pipeline=args.virtual_pipeline_model_parallel_size is not None,
            calculate_per_token_loss=args.calculate_per_token_loss,
            full_recompute=args.recompute_granularity == "full",
            distributed_optimizer=args.use_distributed_optimizer,
            mecefo_flags_given=mecefo_flags_given(args, build_parser()),
            ffn_hidden_size=args.ffn_hidden_size,
            gated_linear_unit=args.swiglu,
        )
    except MecefoConfigError as err:
        raise ConfigError(str(err)) from None
    from megatron_mecefo.recovery.arguments import validate as validate_recovery

    problem = validate_recovery(args, args.world_size)
    if problem:  # before the warnings: a run that stops prints only its error
        raise ConfigError(problem)
    _validate_failures(args)
    from megatron_mecefo.failslow.arguments import config_from_args

    args.fail_slow_config = fs = config_from_args(args)
    dp, mbs, gbs = args.data_parallel_size, args.micro_batch_size, args.global_batch_size
    try:
        fs_warning = fs.validate(
            data_parallel_size=dp,
            mecefo=args.mecefo,
            virtual_replicas=args.mecefo_virtual_replicas is not None,
            virtual_pipeline=args.virtual_pipeline_model_parallel_size is not None,
            microbatches=gbs // (mbs * dp),
            train_iters=args.train_iters,
            batch_flags=f"--global-batch-size={gbs} / (--micro-batch-size={mbs} x {dp} replicas)",
        )
    except MecefoConfigError as err:
        raise ConfigError(str(err)) from None
    for line in warnings + ([fs_warning] if fs_warning else []):
        warn(line)


def ft_kind(args: argparse.Namespace) -> str:
    """The failure schedule's kind (--mecefo-fail alone means scripted)."""
    return args.mecefo_config.failure_schedule


def _validate_failures(args: argparse.Namespace) -> None:
    """Scripted failures and kills that can never fire, or a kill aimed at a replica the
    simulated schedule has already taken down (it never happened, and nothing said so)."""
    if args.mecefo_kill and not (args.exit_signal_handler or args.exit_duration_in_mins):
        # A kill inside a save needs a save at its iteration (a signal or the time limit can
        # save at any iteration: then any may).
        from megatron_mecefo.recovery.fault_injection import (
            parse_kills,
            save_iterations,
            unreachable_save_kill,
        )

        seed = args.mecefo_seed if args.mecefo_seed is not None else args.seed
        saves = None
        if args.save:
            saves = save_iterations(args.train_iters, args.save_interval, args.exit_interval)
        flags = f"--save-interval={args.save_interval} with --train-iters={args.train_iters}"
        if args.exit_interval:
            flags += f" and --exit-interval={args.exit_interval}"
        kills = parse_kills(args.mecefo_kill, args.world_size, args.train_iters, seed)
        problem = unreachable_save_kill(kills, saves, flags)
        if problem:
            raise ConfigError(problem)
    tp = args.tensor_model_parallel_size
    schedule = None
    if args.mecefo and ft_kind(args) == "scripted":
        schedule = args.mecefo_config.build_schedule(args.data_parallel_size, args.train_iters)
        for e in schedule.events:
            if e.fail_iteration > args.train_iters:
                raise ConfigError(
                    f"--mecefo-fail: replica {e.replica} fails at iteration {e.fail_iteration}, "
                    f"after the last one (--train-iters={args.train_iters}), so it never fires; "
                    f"use an iteration in 1..{args.train_iters} or raise --train-iters"
                )
    if args.mecefo_kill and schedule is not None:
        from megatron_mecefo.recovery.fault_injection import RECOVERY_PHASES, parse_kills

        seed = args.mecefo_seed if args.mecefo_seed is not None else args.seed
        for kill in parse_kills(args.mecefo_kill, args.world_size, args.train_iters, seed):
            # Megatron-core's rank order tp-cp-ep-dp-pp: TP fastest, then DP, then PP.
            replica = (kill.rank // tp) % args.data_parallel_size
            if kill.phase not in RECOVERY_PHASES and replica in schedule.failed_at(kill.iteration):
                raise ConfigError(
                    f"--mecefo-kill={kill.key}: rank {kill.rank} sits in replica {replica}, which "
                    f"the simulated schedule (--mecefo-fail) has already taken down at iteration "
                    f"{kill.iteration}, so the kill never happens; kill a rank of a live replica "
                    "or at another iteration"
                )


def warn(message: str) -> None:
    """Print ``WARNING: message`` once, from rank 0 (every rank validates the same flags)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"WARNING: {message}", flush=True)


TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_to_load(load_dir: str) -> Optional[str]:
    """The ``iter_*`` folder ``<load_dir>/latest_checkpointed_iteration.txt`` names, checked
    for existence; None when there is no tracker (training starts from scratch).

    Raises:
        ConfigError: On a tracker that is not an iteration number, or that names a folder
            that does not exist; the message names the file and the fix.
    """
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, errors="replace") as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ConfigError(
            f"--load {load_dir}: {tracker} holds {text[:40]!r}, not an iteration number; write "
            "the iteration of an existing iter_NNNNNNN folder into it, or delete it to train "
            "from scratch",
            usage=False,
        )
    ckpt_dir = os.path.join(load_dir, f"iter_{int(text):07d}")
    if not os.path.isdir(ckpt_dir):
        present = sorted(d for d in os.listdir(load_dir) if d.startswith("iter_"))
        raise ConfigError(
            f"--load {load_dir}: {tracker} names iteration {int(text)}, but {ckpt_dir} does not "
            f"exist (present: {', '.join(present) or 'none'}); point the tracker at one of "
            "them, or delete it to train from scratch",
            usage=False,
        )
    return ckpt_dir


def _validate_abft(args: argparse.Namespace) -> None:
    from megatron_mecefo.abft.arguments import abft_config_from_args
    from megatron_mecefo.abft.config import AbftConfigError

    try:
        args.abft_config = abft_config_from_args(args, args.transformer_impl)
    except AbftConfigError as err:
        raise ConfigError(str(err)) from None


def _validate_checkpointing(args: argparse.Namespace) -> None:
    if args.load:
        checkpoint_to_load(args.load)
    if args.save_interval is not None and not args.save:
        raise ConfigError(
            f"--save-interval={args.save_interval} needs --save DIR to say where to save"
        )
    if args.save and args.save_interval is None:
        args.save_interval = args.train_iters  # save once, at the end
    from megatron_mecefo.snapshot.arguments import SnapshotFlagError
    from megatron_mecefo.snapshot.arguments import validate as validate_snapshots

    try:
        args.snapshot_config = validate_snapshots(args, args.data_parallel_size)
    except SnapshotFlagError as err:
        raise ConfigError(str(err)) from None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate; on a bad config print one line (rank 0 only) and exit 2 (1 for a
    file made by something else)."""
    from megatron_mecefo.cli import normalize_argv

    args = build_parser().parse_args(normalize_argv(list(sys.argv[1:] if argv is None else argv)))
    launched = "WORLD_SIZE" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate_args(args, world_size)
        _launch_env(world_size)
    except UserError as err:
        message = str(err)
        if not launched and "world size" in message:
            message += f" ({LAUNCH_HINT})"
        fail(message, PROG, err.exit_code)
    return args


LAUNCH_HINT = (
    "started without a launcher, so as one process; launch N ranks with torchrun "
    "--nproc_per_node=N examples/pretrain_gpt/pretrain_gpt.py ... or python -m "
    "megatron_mecefo.recovery.supervisor --nproc-per-node N -- examples/pretrain_gpt/"
    "pretrain_gpt.py ..."
)


def _launch_env(world_size: int) -> None:
    """Plain ``python pretrain_gpt.py`` runs as one process (the rendezvous env filled in);
    ranks without a rendezvous address say how to launch instead of a ValueError from
    ``init_process_group``."""
    env = os.environ
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return
    if world_size == 1:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        env["MASTER_PORT"] = str(port)
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    raise ConfigError(
        f"WORLD_SIZE={world_size} is set but {' and '.join(missing)} not: this process was not "
        f"started by a launcher; {LAUNCH_HINT.split('; ', 1)[1]}"
    )


RUN_RECORD = "mecefo_run.json"
"""Written into each ``iter_*`` folder: the flags a resume is checked against."""

RUN_RECORD_FORMAT = 1

_MODEL_KEYS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "swiglu", "normalization", "add_bias_linear", "position_embedding_type",
    "untie_embeddings_and_output_weights", "tokenizer_type",
)  # fmt: skip
"""A change builds another model: its weights cannot load."""

_SCHEDULE_KEYS = (
    "lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "weight_decay",
    "train_iters",
)  # fmt: skip
"""What the checkpoint's scheduler holds (Megatron-LM's check of them; --train-iters is its
weight-decay horizon)."""

_CHANGE_KEYS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
    "micro_batch_size", "global_batch_size", "seq_length",
    "use_distributed_optimizer", "mecefo", "mecefo_policy", "mecefo_rank", "mecefo_fail",
    "mecefo_failure_schedule", "padded_vocab_size",
)  # fmt: skip
"""Changes that work (resharded, re-batched, a new failure plan), said at start-up. The padded
vocabulary follows TP (--make-vocab-size-divisible-by x TP): dist_checkpointing loads the rows
the model has, and the rows beyond the tokenizer's are padding."""


def padded_vocab_size(args: argparse.Namespace) -> int:
    """Megatron-LM's padded vocabulary: the tokenizer's, rounded up to a multiple of
    --make-vocab-size-divisible-by x TP (the trainer builds the embedding with this size)."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-TOKENIZER_VOCAB[args.tokenizer_type] // multiple) * multiple


def run_record(args: argparse.Namespace) -> dict:
    """What a checkpoint records of the run that saved it (:data:`RUN_RECORD`)."""
    record = {"format": RUN_RECORD_FORMAT, "padded_vocab_size": padded_vocab_size(args)}
    for key in _MODEL_KEYS + _SCHEDULE_KEYS + _CHANGE_KEYS:
        if key != "padded_vocab_size":
            record[key] = getattr(args, key, None)
    return record


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-") if key != "padded_vocab_size" else "padded vocabulary"


def _validate_resume(args: argparse.Namespace) -> None:
    """Resuming with changed flags: refuse what cannot work, say what changed (the checkpoint's
    :data:`RUN_RECORD`; checkpoints without one are checked tensor by tensor at the load)."""
    import json

    ckpt_dir = checkpoint_to_load(args.load)
    path = os.path.join(ckpt_dir, RUN_RECORD) if ckpt_dir else None
    if path is None or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            saved = json.load(f)
        version = int(saved.get("format", 0))
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(
            f"--load {args.load}: {path} cannot be read ({err}); the checkpoint is damaged: "
            "load an earlier iter_ folder or train from scratch",
            usage=False,
        ) from None
    if version > RUN_RECORD_FORMAT:
        raise ConfigError(
            f"--load {args.load}: {path} is format {version}, this trainer reads up to "
            f"{RUN_RECORD_FORMAT}: the checkpoint was written by a newer megatron-mecefo; "
            "resume with that version",
            usage=False,
        )
    now = run_record(args)

    def diff(keys: Sequence[str]) -> list[str]:
        return [
            f"{_flag(k)}: checkpoint {saved[k]}, now {now[k]}"
            for k in keys
            if k in saved and saved[k] != now[k]
        ]

    model = diff(_MODEL_KEYS)
    if model:
        raise ConfigError(
            f"--load {args.load}: the checkpoint is of another model ({'; '.join(model)}); pass "
            "the model flags it was trained with, or another --load",
            usage=False,
        )
    schedule = diff(_SCHEDULE_KEYS)
    if schedule and not (
        args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler
    ):
        raise ConfigError(
            f"--load {args.load}: the LR schedule differs from the checkpoint's "
            f"({'; '.join(schedule)}); pass --override-opt-param-scheduler to follow the new "
            "flags, or --use-checkpoint-opt-param-scheduler to keep the checkpoint's schedule "
            "(as Megatron-LM)"
        )
    changed = diff(_CHANGE_KEYS)
    per_rank_optim = os.path.isdir(os.path.join(ckpt_dir, "optim"))
    layout = [c for c in changed if c.startswith(("--tensor-", "--pipeline-"))]
    if per_rank_optim and layout and not args.no_load_optim:
        raise ConfigError(
            f"--load {args.load}: the distributed-optimizer state was saved per rank (optim/, "
            f"megatron-core without Apex/TE) and loads on its TP/PP layout only "
            f"({'; '.join(layout)}); resume with the checkpoint's sizes, or pass --no-load-optim",
            usage=False,
        )
    basis = os.path.isdir(os.path.join(ckpt_dir, "mecefo_basis"))
    if basis and args.mecefo and saved.get("mecefo_rank") != args.mecefo_rank:
        raise ConfigError(
            f"--load {args.load}: --mecefo-rank: checkpoint {saved.get('mecefo_rank')}, now "
            f"{args.mecefo_rank}: the saved low-rank bases have the checkpoint's rank; resume "
            f"with --mecefo-rank {saved.get('mecefo_rank')}",
            usage=False,
        )
    for line in changed:
        warn(f"resuming with a changed flag: {line}")
