"""The trainer-side recovery flag, ``--mecefo-kill``, and its start-up check."""

from __future__ import annotations

import argparse
from typing import Any, Optional

from megatron_mecefo.recovery.fault_injection import PHASES, KillSpecError, parse_kills


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--mecefo-kill`` to ``parser``."""
    parser.add_argument(
        "--mecefo-kill",
        action="append",
        default=[],
        metavar="RANK:ITERATION:PHASE",
        help="Fault injection (real death): SIGKILL global rank RANK at PHASE of iteration "
        f"ITERATION; PHASE is one of {', '.join(PHASES)}; any field may be ? (drawn from "
        "--mecefo-seed). Needs the supervisor (python -m megatron_mecefo.recovery.supervisor). "
        "Repeatable.",
    )
    return parser


def validate(args: Any, world_size: int) -> Optional[str]:
    """The error message for a bad ``--mecefo-kill``/supervisor combination, or None."""
    from megatron_mecefo.recovery.config import RecoveryConfig

    kills = getattr(args, "mecefo_kill", [])
    supervised = RecoveryConfig.from_env() is not None
    if kills and not supervised:
        return (
            f"--mecefo-kill={kills[0]} kills a real process, which only the supervisor "
            "survives; launch with python -m megatron_mecefo.recovery.supervisor "
            "--nproc-per-node N -- examples/pretrain_gpt/pretrain_gpt.py ..."
        )
    if supervised and not args.mecefo:
        return (
            "the recovery supervisor trains through real failures with MeCeFO's takeover; "
            "add --mecefo (or launch with torchrun)"
        )
    if supervised and getattr(args, "mecefo_grad_error_interval", 0):
        return (
            f"--mecefo-grad-error-interval={args.mecefo_grad_error_interval} computes the "
            "failure-free gradient with every replica, which a real death removes; drop it "
            "under the recovery supervisor"
        )
    try:
        seed = args.mecefo_seed if args.mecefo_seed is not None else args.seed
        parse_kills(kills, world_size, args.train_iters, seed)
    except KillSpecError as err:
        return str(err)
    return None
