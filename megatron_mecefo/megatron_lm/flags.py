"""The ``--mecefo*`` flags in Megatron-LM's parser, and the plugin's start-up checks.

:func:`extra_args_provider` adds the flags (the takeover's, the planner's, the attention
checksums', ``--mecefo-kill`` and ``--mecefo-snapshot-*``) and hooks :func:`check_parsed_args`
into the parser, so that a bad flag stops every rank within seconds, before Megatron-LM's own
``validate_args`` and before any process group exists. :func:`validated_config` is the checked
:class:`~megatron_mecefo.takeover.config.FaultToleranceConfig` of Megatron-LM's ``args``;
:func:`fail_slow_config` checks ``--mecefo-fail-slow*``; :func:`check_recovery_args` and
:func:`job_args` are the recovery supervisor's side;
:func:`check_token_ids` reads the training data's token ids once the tokenizer is built.

Every error is one line, ``pretrain_gpt.py: error: <what>; <how to fix it>`` (exit 2; exit 1
for data made by something else), as in ``docs/errors.md``. Importing this module does not
import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, List, Optional

from megatron_mecefo.cli import exit_with_config_error, mecefo_flags_given, normalize_argv
from megatron_mecefo.takeover.arguments import add_arguments
from megatron_mecefo.takeover.config import FaultToleranceConfig, MecefoConfigError

__all__ = [
    "check_parsed_args",
    "check_recovery_args",
    "check_token_ids",
    "data_prefixes",
    "extra_args_provider",
    "fail_slow_config",
    "job_args",
    "train_iters",
    "validated_config",
]


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
        from megatron_mecefo.failslow.arguments import add_arguments as add_fail_slow_arguments

        add_fail_slow_arguments(parser)  # --mecefo-fail-slow* (straggling replicas)
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
        abft = abft_config_from_args(args, getattr(args, "transformer_impl", None), "raise")
        if abft is not None:
            _check_abft_targets(args, abft.inject)
    except (AbftConfigError, MecefoConfigError) as err:
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
        check_recovery_args(args)
    ns = _with_derived_sizes(args)
    if ns is not None and hasattr(ns, "fail_slow"):
        try:
            fail_slow_config(ns)
        except MecefoConfigError as err:
            exit_with_config_error(err)
    if not getattr(args, "mecefo", False):
        given = mecefo_flags_given(args, add_arguments(argparse.ArgumentParser()))
        if given:
            exit_with_config_error(
                f"{given} was given without --mecefo, so it would be ignored; add --mecefo "
                "or drop it"
            )
        return
    if ns is None or not (getattr(ns, "train_iters", None) or getattr(ns, "train_samples", None)):
        return
    try:
        validated_config(ns)
    except MecefoConfigError as err:
        exit_with_config_error(err)


def _with_derived_sizes(args: Any) -> Optional[argparse.Namespace]:
    """A copy of ``args`` with ``data_parallel_size`` and the default ``global_batch_size`` as
    ``validate_args`` will set them; None where they cannot be derived (Megatron-LM then
    refuses the layout itself, or this is not its parser)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = 1
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        model *= int(getattr(args, name, None) or 1)
    if world % model:
        return None  # Megatron-LM's validate_args says so
    ns = argparse.Namespace(**vars(args))
    ns.data_parallel_size = world // model
    if getattr(ns, "global_batch_size", None) is None:
        if getattr(ns, "micro_batch_size", None) is None:
            return None  # not Megatron-LM's parser: nothing to derive from
        ns.global_batch_size = ns.micro_batch_size * ns.data_parallel_size
    if getattr(ns, "num_layers_per_virtual_pipeline_stage", None):
        ns.virtual_pipeline_model_parallel_size = ns.num_layers_per_virtual_pipeline_stage
    return ns


def _check_abft_targets(args: Any, specs: List[str]) -> None:
    """An ABFT fault injection whose layer, rank, iteration or micro-batch does not exist
    would never fire (the run used to end with "0 injected"): the example trainer's check,
    on Megatron-LM's flags. Raises :class:`MecefoConfigError`."""
    from megatron_mecefo.abft.inject import parse_rule

    world = int(os.environ.get("WORLD_SIZE", "1"))
    layers = getattr(args, "num_layers", None)
    ns = _with_derived_sizes(args)
    iters = None
    microbatches = None
    if ns is not None:
        if getattr(ns, "train_iters", None) or getattr(ns, "train_samples", None):
            iters = train_iters(ns)
        mbs = getattr(ns, "micro_batch_size", None)
        if mbs:
            microbatches = int(ns.global_batch_size) // (int(mbs) * ns.data_parallel_size)
    for spec in specs:
        rule = parse_rule(spec)
        where = f"--mecefo-abft-inject {spec!r}"
        if layers and rule.layer is not None and not 1 <= rule.layer <= int(layers):
            raise MecefoConfigError(
                f"{where}: layer {rule.layer} does not exist (layers 1..{layers} of "
                f"--num-layers={layers}, numbered from 1 as Megatron's layer_number); it would "
                "never fire: pick a layer in that range"
            )
        if not 0 <= rule.rank < world:
            raise MecefoConfigError(
                f"{where}: rank {rule.rank} does not exist (world size {world}, ranks "
                f"0..{world - 1}); it would never fire: pick a rank in that range"
            )
        first = rule.iteration if rule.iteration is not None else rule.start or rule.every
        if iters is not None and first is not None and first > iters:
            raise MecefoConfigError(
                f"{where}: iteration {first} is after the last one ({iters}); it would never "
                "fire: pick an iteration of the run"
            )
        if microbatches and rule.microbatch >= microbatches:
            raise MecefoConfigError(
                f"{where}: micro-batch {rule.microbatch} does not exist ({microbatches} per "
                "replica per iteration, numbered from 0); it would never fire: pick one in "
                f"0..{microbatches - 1}"
            )


def train_iters(args: Any) -> int:
    """The run's iterations: ``--train-iters``, or ``--train-samples`` / global batch."""
    if args.train_iters:
        return int(args.train_iters)
    return int(args.train_samples) // int(args.global_batch_size)


def validated_config(args: Any, warnings: Optional[List[str]] = None) -> FaultToleranceConfig:
    """The checked config of Megatron-LM's ``args``; warnings are appended to ``warnings``.

    Raises:
        MecefoConfigError: The first problem, naming the flag, the value and the fix.
    """
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
    skip = getattr(args, "iterations_to_skip", None)
    if skip:
        raise MecefoConfigError(_skip_message(skip, "--mecefo"))
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
        train_iters=train_iters(args),
        virtual_pipeline=getattr(args, "virtual_pipeline_model_parallel_size", None) is not None,
        calculate_per_token_loss=args.calculate_per_token_loss,
        full_recompute=getattr(args, "recompute_granularity", None) == "full",
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
        gated_linear_unit=bool(getattr(args, "swiglu", False)),
    )
    schedule = ft.build_schedule(args.data_parallel_size, train_iters(args))
    for e in schedule.events:
        if len(schedule.failed_at(e.fail_iteration)) == args.data_parallel_size:
            raise MecefoConfigError(
                f"the failure schedule takes every replica down at iteration {e.fail_iteration}; "
                "Megatron-LM's train_step cannot skip an update, so keep one replica up"
            )
    if warnings is not None:
        warnings.extend(found)
    return ft


def fail_slow_config(args: Any, warnings: Optional[List[str]] = None) -> Any:
    """The checked :class:`~megatron_mecefo.failslow.config.FailSlowConfig` of Megatron-LM's
    ``args`` (with ``data_parallel_size``); a warning is appended to ``warnings``.

    In Megatron-LM fail-slow runs inside the ``--mecefo`` training hooks (without ``--mecefo``
    nothing of Megatron-LM is wrapped), so a ``--mecefo-fail-slow*`` flag given without
    ``--mecefo`` would be ignored: that is an error, as for every other ``--mecefo-*`` flag
    (``--mecefo-fail-slow off`` excepted).

    Raises:
        MecefoConfigError: The first problem, naming the flag, the value and the fix.
    """
    from megatron_mecefo.failslow.config import FailSlowConfig

    d = FailSlowConfig()  # args built without these flags (a caller's own parser) get defaults
    config = FailSlowConfig(
        mode=getattr(args, "fail_slow", d.mode),
        threshold=getattr(args, "fail_slow_threshold", d.threshold),
        window=getattr(args, "fail_slow_window", d.window),
    )
    mecefo = bool(getattr(args, "mecefo", False))
    given = next((a.split("=")[0] for a in sys.argv if a.startswith("--mecefo-fail-slow")), None)
    if not mecefo and given and config.mode in ("detect", "rebalance"):
        raise MecefoConfigError(
            f"{given} was given without --mecefo: in Megatron-LM's pretrain_gpt.py fail-slow "
            "detection and rebalancing run in the --mecefo training hooks, so it would be "
            "ignored; add --mecefo or drop it"
        )
    dp = int(args.data_parallel_size)
    mbs, gbs = getattr(args, "micro_batch_size", None), getattr(args, "global_batch_size", None)
    iters = None
    if getattr(args, "train_iters", None) or (gbs and getattr(args, "train_samples", None)):
        iters = train_iters(args)
    warning = config.validate(
        data_parallel_size=dp,
        mecefo=mecefo,
        virtual_pipeline=getattr(args, "virtual_pipeline_model_parallel_size", None) is not None,
        microbatches=int(gbs) // (int(mbs) * dp) if mbs and gbs else None,
        train_iters=iters,
        batch_flags=f"--global-batch-size={gbs} / (--micro-batch-size={mbs} x {dp} replicas)",
    )
    if warning and warnings is not None:
        warnings.append(warning)
    return config


def _skip_message(skip: Any, what: str) -> str:
    values = " ".join(str(i) for i in skip)
    return (
        f"{what} with --iterations-to-skip {values}: Megatron-LM skips those iterations "
        "without an optimizer step, which MeCeFO's takeover plan and recovery count as trained; "
        "drop --iterations-to-skip (and those iterations from --result-rejected-tracker-filename"
        ", which adds to it)"
    )


# ---------------------------------------------------------------------- the recovery supervisor
def check_recovery_args(args: Any) -> None:
    """Start-up checks of Megatron-LM's parsed flags for ``--mecefo-kill`` and the supervisor
    (the parser hook, :func:`check_parsed_args`, calls it); under the supervisor it also hands
    the collective timeout to ``--distributed-timeout-minutes``."""
    from megatron_mecefo.recovery.arguments import validate
    from megatron_mecefo.recovery.config import RecoveryConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        job = job_args(args, world)
    except MecefoConfigError as err:  # a bad --mecefo-* value, found before its own check
        exit_with_config_error(err)
    message = validate(job, world)
    if message:
        exit_with_config_error(
            message.replace("examples/pretrain_gpt/pretrain_gpt.py", "pretrain_gpt.py")
        )
    message = _save_kill_problem(args, job)
    if message:
        exit_with_config_error(message)
    config = RecoveryConfig.from_env()
    if config is None:
        return
    if getattr(args, "inprocess_restart", False):
        exit_with_config_error(
            "--inprocess-restart cannot run under the MeCeFO recovery supervisor (it re-enters "
            "pretrain() itself); drop --inprocess-restart"
        )
    skip = getattr(args, "iterations_to_skip", None)
    if skip:  # the adapter books each iteration at its optimizer step
        exit_with_config_error(_skip_message(skip, "the MeCeFO recovery supervisor"))
    for flag, value, ok in (
        ("--context-parallel-size", getattr(args, "context_parallel_size", 1) or 1, 1),
        ("--use-tp-pp-dp-mapping", bool(getattr(args, "use_tp_pp_dp_mapping", False)), False),
        ("--num-experts", getattr(args, "num_experts", None), None),
    ):
        if value != ok:
            exit_with_config_error(
                f"{flag}={value} under the MeCeFO recovery supervisor: its membership assumes "
                "TP x PP x DP ranks in Megatron's default order (tp-cp-ep-dp-pp) with no "
                f"context or expert parallelism; drop {flag}"
            )
    from megatron_mecefo.snapshot.arguments import SnapshotFlagError
    from megatron_mecefo.snapshot.arguments import validate as validate_snapshots

    try:
        snapshots = validate_snapshots(args, job.data_parallel_size)
    except SnapshotFlagError as err:
        exit_with_config_error(err)
    if getattr(args, "use_distributed_optimizer", False) and not (
        snapshots is not None and snapshots.redundancy
    ):
        # A dead rank's optimizer shard dies with it; Megatron-LM's checkpoints are not a
        # fallback here (the example trainer's disk fallback is not wired into its loop).
        exit_with_config_error(
            "--use-distributed-optimizer under the MeCeFO recovery supervisor: a dead rank's "
            "optimizer shard must be rebuilt from its peers' in-memory snapshots and parity; "
            "add --mecefo-snapshot-interval 1 --mecefo-snapshot-redundancy 1, or drop "
            "--use-distributed-optimizer"
        )
    # Every group Megatron-LM creates waits at most the supervisor's backstop.
    args.distributed_timeout_minutes = config.collective_timeout_s / 60.0


def _save_kill_problem(args: Any, job: argparse.Namespace) -> Optional[str]:
    """A ``--mecefo-kill`` inside a save (``save``, ``save-write``, ...) at an iteration where
    Megatron-LM saves no checkpoint: it would never fire. Megatron-LM saves at every
    ``--save-interval`` and ``--non-persistent-save-interval``, at ``--exit-interval`` and at
    the end; a signal or ``--exit-duration-in-mins`` can save at any iteration (not checked)."""
    if not job.mecefo_kill or getattr(args, "exit_signal_handler", False):
        return None
    if getattr(args, "exit_duration_in_mins", None):
        return None
    from megatron_mecefo.recovery.fault_injection import (
        parse_kills,
        save_iterations,
        unreachable_save_kill,
    )

    seed = job.mecefo_seed if job.mecefo_seed is not None else job.seed
    kills = parse_kills(job.mecefo_kill, job.world_size, job.train_iters, seed)
    interval = getattr(args, "save_interval", None)
    extra = getattr(args, "non_persistent_save_interval", None)
    exit_interval = getattr(args, "exit_interval", None)
    saves = None
    if getattr(args, "save", None):
        saves = save_iterations(job.train_iters, interval, exit_interval, (extra,))
    flags = f"--save-interval={interval} with --train-iters={job.train_iters}"
    if extra:
        flags += f", --non-persistent-save-interval={extra}"
    if exit_interval:
        flags += f" and --exit-interval={exit_interval}"
    return unreachable_save_kill(kills, saves, flags)


def job_args(args: Any, world_size: int) -> argparse.Namespace:
    """What the recovery session reads of the job, from Megatron-LM's parsed flags."""
    tp = int(args.tensor_model_parallel_size)
    pp = int(args.pipeline_model_parallel_size)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    dp = max(world_size // (tp * pp * cp), 1)
    gbs = args.global_batch_size or args.micro_batch_size * dp
    iters = args.train_iters or (args.train_samples or 0) // gbs
    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # the flag checks run before torch is needed
        device = "cpu"
    return argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        world_size=world_size,
        global_batch_size=gbs,
        train_iters=iters,
        mecefo=bool(getattr(args, "mecefo", False)),
        mecefo_kill=list(getattr(args, "mecefo_kill", None) or []),
        mecefo_seed=getattr(args, "mecefo_seed", None),
        seed=args.seed,
        mecefo_grad_error_interval=getattr(args, "mecefo_grad_error_interval", 0),
        mecefo_config=FaultToleranceConfig.from_args(args),
        device=device,
        use_distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        # Megatron-LM's checkpoints are not the recovery's disk fallback (that path is the
        # example trainer's): the session must not count on them.
        save=None,
        load=None,
        # Only named in the line of a job that cannot continue in memory (failures.py).
        checkpoint_dirs=(getattr(args, "save", None), getattr(args, "load", None)),
    )


# ---------------------------------------------------------------------- the training data
def data_prefixes(args: Any) -> List[str]:
    """The dataset prefixes Megatron-LM will read: ``--data-path``, ``--train-data-path``,
    ``--valid-data-path``, ``--test-data-path`` (weights dropped), and the files named by
    ``--data-args-path`` and ``--per-split-data-args-path``. Empty with ``--mock-data``."""
    from megatron_mecefo.data.data_path import parse_data_path

    if getattr(args, "mock_data", False):
        return []
    lists: List[Any] = []
    for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        value = getattr(args, dest, None)
        if value:
            lists.append(value)
    path = getattr(args, "data_args_path", None)
    if path:
        with open(path) as f:
            lists.append(f.read())
    path = getattr(args, "per_split_data_args_path", None)
    if path:
        with open(path) as f:
            lists.extend(v for v in json.load(f).values() if v)
    prefixes: List[str] = []
    for value in lists:
        for prefix in parse_data_path(value)[0]:
            if prefix not in prefixes:
                prefixes.append(prefix)
    return prefixes


def check_token_ids(args: Any, vocab_size: int) -> None:
    """Every dataset's largest token id must be an id of the tokenizer (``vocab_size`` ids):
    a dataset tokenized with another tokenizer used to end in ``IndexError: index out of
    range in self`` in the embedding, on every rank. Reads all of a dataset up to 64 MiB of
    tokens, evenly spaced windows of a larger one (the example trainer's check); rank 0 says
    what it read. Exits 1 with one line when an id is beyond the vocabulary."""
    from megatron_mecefo.data.data_path import scan_token_ids
    from megatron_mecefo.errors import fail

    tokenizer = getattr(args, "tokenizer_type", None)
    for prefix in data_prefixes(args):
        try:
            largest, read, total, _ = scan_token_ids(prefix)
        except (OSError, ValueError, KeyError):
            continue  # a missing or damaged file is Megatron-LM's own error, said as it reads
        how = "all" if read == total else f"a sample of {read:,}"
        if largest >= vocab_size:
            fail(
                f"--data-path {prefix}: token id {largest} (read {how} of {total:,} tokens) is "
                f"beyond the --tokenizer-type={tokenizer} vocabulary ({vocab_size} ids): the "
                "dataset was tokenized with another tokenizer (or a larger --vocab-size); pass "
                "the tokenizer that made it, or tokenize the data again with this one",
                "pretrain_gpt.py",
                code=1,
            )
        if int(os.environ.get("RANK", "0")) == 0 and total:
            print(
                f"> MeCeFO: checked --data-path {prefix}: token ids <= {largest} < vocabulary "
                f"{vocab_size}, read {how} of {total:,} tokens",
                flush=True,
            )
