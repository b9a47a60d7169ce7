"""The ``--mecefo-fail-slow*`` flags, for any argparse parser. Torch-free.

Their ``dest`` names have no ``mecefo_`` prefix on purpose: detection is on by default and works
without ``--mecefo``, so a threshold set without ``--mecefo`` must not trip the "a --mecefo-*
flag was given without --mecefo" check (``megatron_mecefo.cli.mecefo_flags_given``);
``rebalance`` itself checks for ``--mecefo``.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_mecefo.failslow.config import MODES, FailSlowConfig


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the fail-slow flags to ``parser`` (returns it)."""
    d = FailSlowConfig()
    g = parser.add_argument_group("MeCeFO fail-slow (megatron_mecefo.failslow)")
    g.add_argument(
        "--mecefo-fail-slow",
        dest="fail_slow",
        choices=MODES,
        default=d.mode,
        help="Straggling replicas: off; detect (default: one log line when a replica turns "
        "slow or recovers, and its measurement in every metrics record); rebalance (the slow "
        "replica also hands part of its micro-batches to the others, exactly; needs --mecefo).",
    )
    g.add_argument(
        "--mecefo-fail-slow-threshold",
        dest="fail_slow_threshold",
        type=float,
        default=d.threshold,
        metavar="RATIO",
        help="A replica is slow when its compute time per micro-batch exceeds RATIO times the "
        f"group's median (default {d.threshold:g}) in at least 80%% of the window's steps; it "
        "recovers when the window's median ratio falls to half that margin.",
    )
    g.add_argument(
        "--mecefo-fail-slow-window",
        dest="fail_slow_window",
        type=int,
        default=d.window,
        metavar="STEPS",
        help="Steps the time per micro-batch is judged (80%% of them slow to mark a replica) "
        "and smoothed over (a median), and the least steps between two changes of the "
        f"rebalancing (default {d.window}).",
    )
    return parser


def config_from_args(args: Any) -> FailSlowConfig:
    """The :class:`FailSlowConfig` of parsed flags (not yet validated)."""
    return FailSlowConfig(
        mode=args.fail_slow, threshold=args.fail_slow_threshold, window=args.fail_slow_window
    )
