"""``--mecefo-abft`` and its flags, for the example trainer and Megatron-LM (torch-free).

``--mecefo-abft`` switches the checks on; ``--mecefo-abft-inject`` alone injects faults into
an unchecked model (the unprotected baseline of the tests and ``make demo-abft``). The flags'
``dest`` names start with ``abft`` (not ``mecefo_``), so they work without ``--mecefo``.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from megatron_mecefo.abft.config import MODES, AbftConfig, AbftConfigError


def add_abft_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the attention-ABFT flags to ``parser`` (returns it)."""
    g = parser.add_argument_group("attention ABFT (megatron_mecefo.abft)")
    g.add_argument(
        "--mecefo-abft",
        dest="abft",
        action="store_true",
        help="Checksum the attention GEMMs (QKV, Q·K^T, softmax·V, output projection) and "
        "correct INF/NaN/near-INF values in the forward pass (ATTNChecker-style).",
    )
    g.add_argument(
        "--mecefo-abft-inject",
        dest="abft_inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="Inject a fault (tests/demos), e.g. kind=inf,op=scores,layer=1,every=10; "
        "repeatable. Without --mecefo-abft the faults hit an unprotected model.",
    )
    g.add_argument(
        "--mecefo-abft-mode",
        dest="abft_mode",
        choices=MODES,
        default=None,
        help="correct (default): locate and repair from two checksums; detect: one checksum, "
        "recompute the GEMM on a mismatch.",
    )
    g.add_argument(
        "--mecefo-abft-policy",
        dest="abft_policy",
        default=None,
        metavar="SPEC",
        help="Which steps are checked: every (default), every:K, adaptive[:KMAX[:HOLD]].",
    )
    return parser


def abft_config_from_args(
    args: Any, transformer_impl: Optional[str] = None, on_uncorrectable: str = "skip"
) -> Optional[AbftConfig]:
    """The validated :class:`AbftConfig` of the flags, or None when ABFT is off.

    Raises:
        AbftConfigError: A malformed injection or policy spec, a mode/policy flag without
            ``--mecefo-abft``, or ``--transformer-impl transformer_engine`` (its fused
            attention cannot be checksummed).
    """
    enabled, inject = bool(getattr(args, "abft", False)), list(getattr(args, "abft_inject", []))
    mode, policy = getattr(args, "abft_mode", None), getattr(args, "abft_policy", None)
    if not enabled:
        for flag, value in (("--mecefo-abft-mode", mode), ("--mecefo-abft-policy", policy)):
            if value is not None:
                raise AbftConfigError(
                    f"{flag}={value} was given without --mecefo-abft, so it would be ignored; "
                    "add --mecefo-abft or drop it"
                )
        if not inject:
            return None
    if transformer_impl == "transformer_engine":
        raise AbftConfigError(
            "--mecefo-abft with --transformer-impl transformer_engine: Transformer Engine's "
            "fused attention computes Q·K^T, softmax and ·V in one kernel, so their outputs "
            "cannot be checksummed; use --transformer-impl local (or auto, which picks local "
            "with --mecefo-abft)"
        )
    config = AbftConfig(
        check=enabled,
        mode=mode or "correct",
        policy=policy or "every",
        inject=tuple(inject),
        on_uncorrectable=on_uncorrectable,
        seed=int(getattr(args, "seed", 1234)),
    )
    return config.validate()
