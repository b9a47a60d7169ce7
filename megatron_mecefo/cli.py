"""Command-line helpers shared by the trainers' flag handling (the example trainer's
``arguments.py`` and the Megatron-LM adapter): ``--mecefo-fail -1:5:10`` read as a value, the
first ``--mecefo-*`` flag a user set, and the one-line exit on a bad flag.

Torch-free: the flag checks run before torch is imported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, List, NoReturn, Optional

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
    """Print ``prog: error: message`` on rank 0 only and exit 2 on every rank.

    Every rank checks the same flags, so all of them stop here and none waits in a
    collective. The other ranks wait a moment first: when one rank exits, torchrun stops the
    rest, and rank 0 must have printed by then.
    """
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(2.0)
    sys.exit(2)
