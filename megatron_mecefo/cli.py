"""Command-line helpers shared by the trainers' flag handling (the example trainer's
``arguments.py`` and the Megatron-LM adapter): ``--mecefo-fail -1:5:10`` read as a value, the
first ``--mecefo-*`` flag a user set, and the one-line exit on a bad flag.

Torch-free: the flag checks run before torch is imported.
"""

from __future__ import annotations

import argparse
from typing import Any, List, NoReturn, Optional

from megatron_mecefo.errors import fail

VALUE_FLAGS = ("--mecefo-fail",)
"""Flags whose value may start with ``-`` (``--mecefo-fail -1:5:10``), which argparse would
otherwise read as an option (and fail with "expected one argument")."""


def normalize_argv(argv: List[str]) -> List[str]:
    """``argv`` with ``--mecefo-fail -1:5:10`` joined into ``--mecefo-fail=-1:5:10``, so a
    negative replica reaches the schedule check, which names it, instead of argparse."""
    out: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if arg in VALUE_FLAGS and nxt is not None and nxt[:1] == "-" and nxt[1:2].isdigit():
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def mecefo_flags_given(args: Any, parser: argparse.ArgumentParser) -> Optional[str]:
    """The first ``--mecefo-*`` flag (with its value) that differs from its default."""
    for action in parser._actions:  # noqa: SLF001 (argparse has no public action list)
        dest = action.dest
        value = getattr(args, dest, None)
        if dest.startswith("mecefo_") and value != action.default:
            return f"{action.option_strings[0]}={value}"
    return None


def exit_with_config_error(message: object, prog: str = "pretrain_gpt.py") -> NoReturn:
    """Print ``prog: error: message`` once and exit 2 on every rank (:func:`errors.fail`:
    under the recovery supervisor the line goes to it, which says it once)."""
    fail(message, prog)
