"""``--mecefo`` and the ``--mecefo-*`` flags of the takeover (and, through their own modules,
the planner's and the attention checksums'), for any argparse parser: Megatron-LM's
``extra_args_provider`` or the example trainer's. Torch-free."""

from __future__ import annotations

import argparse

from megatron_mecefo.takeover.config import POLICY_NAMES, SCHEDULES, auto_policy
from megatron_mecefo.techniques.config import BASIS_METHODS


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the MeCeFO flags to ``parser`` (returns it, as Megatron's extra-args providers do)."""
    g = parser.add_argument_group("MeCeFO fault tolerance (megatron_mecefo)")
    g.add_argument(
        "--mecefo",
        action="store_true",
        help="Train through data-parallel replica failures with MeCeFO (arXiv 2510.16415).",
    )
    g.add_argument(
        "--mecefo-policy",
        choices=POLICY_NAMES,
        default="neighbor",
        help="Who takes over a failed replica's micro-batches: neighbor (the paper: the next "
        "alive replica, all its work in takeover mode), spread (dealt over all alive "
        "replicas, only absorbed ones in takeover mode), exact (neighbour runs both exactly), "
        "drop (skip the failed replica's samples), auto (the recovery planner picks one per "
        "failure event within the budgets below).",
    )
    # --mecefo-policy auto's (the planner's, registered with the config), listed after it.
    auto_policy("add_arguments")(g)
    g.add_argument("--mecefo-rank", type=int, default=128, help="r of the low-rank FFN wgrad.")
    g.add_argument(
        "--mecefo-basis-interval",
        type=int,
        default=200,
        help="tau: iterations between refreshes of the low-rank basis V.",
    )
    g.add_argument(
        "--mecefo-basis-method",
        choices=BASIS_METHODS,
        default="eigh",
        help="How V is computed: eigh (exact eigendecomposition of the Gram matrix) or "
        "randomized (seeded subspace iteration, cheaper for large hidden sizes).",
    )
    for name, what in (
        ("skip-attention", "no backward through attention in takeover mode"),
        ("recompute-ffn", "store only the FFN input in takeover mode"),
        ("lowrank-ffn", "low-rank FFN weight gradients in takeover mode"),
    ):
        g.add_argument(
            f"--mecefo-{name}",
            action=argparse.BooleanOptionalAction,
            default=True,
            help=f"Technique: {what} (default on).",
        )
    g.add_argument(
        "--mecefo-failure-schedule",
        choices=SCHEDULES,
        default=None,
        help="Simulated failures: scripted (--mecefo-fail), the paper's low/mid/high "
        "scenarios, poisson (--mecefo-mtbf-hours/--mecefo-mttr-hours), replay "
        "(--mecefo-failure-trace). Default: scripted if --mecefo-fail is given, else none.",
    )
    g.add_argument(
        "--mecefo-fail",
        action="append",
        default=[],
        metavar="REPLICA:FAIL[:RECOVER]",
        help="Replica REPLICA (data-parallel index) is down from iteration FAIL until "
        "RECOVER (exclusive; omitted: until the end). Repeatable.",
    )
    g.add_argument(
        "--mecefo-nominal-step-time",
        type=float,
        default=None,
        metavar="SECONDS",
        help="Failure-free seconds per iteration, to map the time-based schedules "
        "(low/mid/high, poisson, traces in seconds) to iterations.",
    )
    g.add_argument(
        "--mecefo-mtbf-hours",
        type=float,
        default=None,
        help="Poisson schedule: mean time between failures of one replica, in hours.",
    )
    g.add_argument(
        "--mecefo-mttr-hours",
        type=float,
        default=None,
        help="Poisson schedule: mean time to repair a failed replica, in hours.",
    )
    g.add_argument(
        "--mecefo-failure-trace",
        default=None,
        metavar="JSON",
        help="Replay schedule: JSON list of events, each with replica and fail_iteration / "
        "recover_iteration (or fail_time_s / recover_time_s, with --mecefo-nominal-step-time).",
    )
    g.add_argument(
        "--mecefo-seed",
        type=int,
        default=None,
        help="Seed of the failure schedule and the basis (default: --seed).",
    )
    g.add_argument(
        "--mecefo-grad-error-interval",
        type=int,
        default=0,
        metavar="K",
        help="Every K degraded iterations, also compute the failure-free gradient of the same "
        "batch and log ||g_hat - g|| / ||g||. Costs one extra forward-backward. 0: off.",
    )
    from megatron_mecefo.abft.arguments import add_abft_arguments

    add_abft_arguments(parser)  # --mecefo-abft*: attention checksums, independent of --mecefo
    return parser
