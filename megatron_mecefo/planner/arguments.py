"""The flags of ``--mecefo-policy auto`` (the recovery planner): budgets, rank bounds, the cost
profile and its calibration. Torch-free."""

from __future__ import annotations

from typing import Any

from megatron_mecefo.planner.config import DEFAULT_GRAD_ERROR_BUDGET


def add_planner_arguments(group: Any) -> None:
    """Add the planner's ``--mecefo-*`` flags to ``group`` (the MeCeFO argument group, so they
    are listed with ``--mecefo-policy``)."""
    g = group
    g.add_argument(
        "--mecefo-sample-loss-budget",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="auto: share of a step's samples that may be skipped (drop). Default 0: the "
        "global batch is always kept.",
    )
    g.add_argument(
        "--mecefo-approx-budget",
        type=float,
        default=1.0,
        metavar="SHARE",
        help="auto: most takeover (approximate) micro-batches per step, as a share of the "
        "global batch; bounds the gradient error. Default 1 (no bound); 0: exact choices only.",
    )
    g.add_argument(
        "--mecefo-rank-min",
        type=int,
        default=None,
        help="auto: smallest low-rank r the planner may pick (default: --mecefo-rank).",
    )
    g.add_argument(
        "--mecefo-rank-max",
        type=int,
        default=None,
        help="auto: largest low-rank r the planner may pick (default: --mecefo-rank).",
    )
    g.add_argument(
        "--mecefo-memory-headroom-mb",
        type=float,
        default=0.0,
        help="auto: activation memory (MiB) a replica may use above the failure-free peak "
        "before takeover micro-batches recompute the FFN.",
    )
    g.add_argument(
        "--mecefo-planner-profile",
        default=None,
        metavar="JSON",
        help="auto: the calibrated cost profile, written by python -m "
        "megatron_mecefo.planner.calibration (default: the one shipped in the package, measured "
        "on a CPU with the example trainer's demo model).",
    )
    g.add_argument(
        "--mecefo-planner-calibrate-steps",
        type=int,
        default=3,
        metavar="N",
        help="auto, example trainer: rescale the profile to this machine by the measured / "
        "predicted critical path of the first N failure-free steps after the first (0: off).",
    )
    g.add_argument(
        "--mecefo-grad-error-budget",
        type=float,
        default=DEFAULT_GRAD_ERROR_BUDGET,
        metavar="ERROR",
        help="auto: largest predicted gradient relative error |g~ - g| / |g| of a choice; the "
        "fastest choice within it is taken (none within it: the least error). Default "
        f"{DEFAULT_GRAD_ERROR_BUDGET}; inf: no bound, 0: exact choices only.",
    )
    g.add_argument(
        "--mecefo-allow-shrink",
        action="store_true",
        help="auto: shrinking data parallelism to the survivors (charged the measured regroup "
        "and rejoin) is a choice.",
    )
