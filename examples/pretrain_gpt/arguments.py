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


class ConfigError(ValueError):
    """A bad flag (combination); the message names the flag, the value and the fix."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line from rank 0 (no usage dump, not once per rank)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        from megatron_mecefo.megatron_lm.arguments import exit_with_config_error

        exit_with_config_error(f"{message} (--help lists the flags)", prog=self.prog)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's parser. Defaults describe a small LLaMA-style GPT that trains on CPU."""
    p = _Parser(
        prog="pretrain_gpt.py",
        description="Compact Megatron-Core GPT pretraining (CPU/gloo or GPU/nccl).",
        allow_abbrev=False,
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Layers per virtual pipeline stage (interleaved 1F1B schedule).",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cpu: gloo + the plugin's CPU runtime; cuda: nccl; auto: cuda if available.",
    )

    g = p.add_argument_group("model (LLaMA-style by default)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="Default: 4*hidden, or Megatron's SwiGLU size int(8*hidden/3/64)*64.",
    )
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--normalization", choices=("RMSNorm", "LayerNorm"), default="RMSNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument(
        "--swiglu", action=argparse.BooleanOptionalAction, default=True, help="SwiGLU MLP."
    )
    g.add_argument("--add-bias-linear", dest="add_bias_linear", action="store_true")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.set_defaults(add_bias_linear=False)
    g.add_argument(
        "--position-embedding-type", choices=("rope", "learned_absolute"), default="rope"
    )
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        dest="untie_embeddings_and_output_weights",
        action="store_true",
    )
    g.add_argument(
        "--tie-embeddings-and-output-weights",
        dest="untie_embeddings_and_output_weights",
        action="store_false",
    )
    g.set_defaults(untie_embeddings_and_output_weights=True)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument(
        "--transformer-impl",
        choices=("auto", "local", "transformer_engine"),
        default="auto",
        help="auto: transformer_engine on GPU when it is installed, else local.",
    )
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument(
        "--layout-invariant-init",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Draw every weight from its global tensor, so every TP/PP layout starts equal.",
    )

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None, help="Default: micro-batch × DP.")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Megatron indexed dataset prefix(es), optionally weighted: [W1] P1 [W2] P2 ...",
    )
    g.add_argument("--mock-data", action="store_true", help="Megatron's MockGPTDataset.")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", choices=("ByteTokenizer",), default="ByteTokenizer")

    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--metrics-file", default=None, help="JSON lines: one per step and eval.")
    g.add_argument("--tensorboard-dir", default=None)
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
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="Stop after the iteration divisible by this (after saving), as Megatron-LM.",
    )
    from megatron_mecefo.megatron_lm.arguments import add_arguments

    add_arguments(p)  # --mecefo, --mecefo-*
    from megatron_mecefo.recovery.arguments import add_arguments as add_recovery_arguments

    add_recovery_arguments(p)  # --mecefo-kill (real deaths, under the recovery supervisor)
    from megatron_mecefo.snapshot.arguments import add_arguments as add_snapshot_arguments

    add_snapshot_arguments(p)  # --mecefo-snapshot-* (in-memory snapshots)
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
    )
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
    return args


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
        from megatron_mecefo.data.data_path import check_data_prefix, parse_data_path

        try:
            for prefix in parse_data_path(args.data_path)[0]:
                check_data_prefix(prefix)
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(f"--data-path {' '.join(args.data_path)}: {err}") from None


def _validate_mecefo(args: argparse.Namespace) -> None:
    from megatron_mecefo.megatron_lm.arguments import (
        FaultToleranceConfig,
        MecefoConfigError,
        mecefo_flags_given,
    )

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
    for line in warnings:
        warn(line)


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
            "from scratch"
        )
    ckpt_dir = os.path.join(load_dir, f"iter_{int(text):07d}")
    if not os.path.isdir(ckpt_dir):
        present = sorted(d for d in os.listdir(load_dir) if d.startswith("iter_"))
        raise ConfigError(
            f"--load {load_dir}: {tracker} names iteration {int(text)}, but {ckpt_dir} does not "
            f"exist (present: {', '.join(present) or 'none'}); point the tracker at one of "
            "them, or delete it to train from scratch"
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
    """Parse and validate; on a bad config print one line (rank 0 only) and exit 2."""
    from megatron_mecefo.megatron_lm.arguments import normalize_argv

    args = build_parser().parse_args(normalize_argv(list(sys.argv[1:] if argv is None else argv)))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return validate_args(args, world_size)
    except ConfigError as err:
        from megatron_mecefo.megatron_lm.arguments import exit_with_config_error

        exit_with_config_error(err)
