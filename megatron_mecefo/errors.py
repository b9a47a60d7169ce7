"""One error path for the mistakes a user can make (docs/errors.md lists every line).

An expected error is one line, ``<program>: error: <what>; <how to fix it>``, printed once (by
rank 0 when ranks run), with exit code 2 for a usage error (a flag, a launch) and 1 for the
rest (a file made by something else, a port in use). No traceback: the line is the message.
Unexpected errors keep theirs. Torch-free, so the trainer's flag checks stay fast.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

USAGE = 2
"""Exit code of a usage error (as argparse's)."""

OTHER = 1
"""Exit code of every other expected error."""

ERROR_FILE_ENV = "MECEFO_ERROR_DIR"
"""Set by the recovery supervisor: a rank that stops with an expected error writes its line to
``<dir>/<slot>.err`` instead of printing it, so the supervisor can tell a start-up failure from
a death in training and print the line once, in its own."""


class UserError(Exception):
    """An expected error: ``str(err)`` is ``<what>; <how to fix it>``.

    Args:
        message: What is wrong (flag, value or file) and how to fix it.
        usage: True for a bad flag or launch (exit 2), False for the rest (exit 1).
    """

    def __init__(self, message: str, usage: bool = True) -> None:
        super().__init__(message)
        self.usage = usage

    @property
    def exit_code(self) -> int:
        return USAGE if self.usage else OTHER


def fail(message: object, prog: str, code: int = USAGE, wait_s: float = 2.0) -> NoReturn:
    """Print ``prog: error: message`` on rank 0 only and exit ``code`` on every rank.

    Every rank checks the same things, so all of them stop here and none waits in a
    collective. The other ranks wait ``wait_s`` first: when one rank exits, torchrun stops the
    rest, and rank 0 must have printed by then.
    """
    line = f"{prog}: error: {message}"
    rank = int(os.environ.get("RANK", "0"))
    # Under the recovery supervisor the line goes to it, and its own last line carries it:
    # printed here too, the user would read it twice.
    if not _leave_for_supervisor(line) and rank == 0:
        print(line, file=sys.stderr, flush=True)
    if rank != 0:
        time.sleep(wait_s)
    sys.stdout.flush()
    sys.exit(code)


def _leave_for_supervisor(line: str) -> bool:
    """Write ``line`` for the recovery supervisor (``ERROR_FILE_ENV``); whether it was."""
    directory = os.environ.get(ERROR_FILE_ENV)
    slot = os.environ.get("MECEFO_RECOVERY_SLOT", os.environ.get("RANK", "0"))
    if not directory:
        return False
    try:
        with open(os.path.join(directory, f"{slot}.err"), "w") as f:
            f.write(line + "\n")
    except OSError:
        return False  # printed by the rank instead
    return True


def check_writable_dir(flag: str, path: str, usage: bool = True) -> None:
    """Create ``path`` (a directory) if needed and write a file into it, as a save would.

    Raises:
        UserError: Naming the flag, the path, the OS error and the fix.
    """
    probe = os.path.join(path, f".mecefo_write_test.{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise UserError(
            f"{flag} {path}: cannot write there ({err.strerror or err}); pass a directory you "
            "can write to (it is tried at start-up so that no training is lost at the first save)",
            usage,
        ) from None


def check_writable_file(flag: str, path: str) -> None:
    """Check that ``path`` can be appended to (its directory is created if needed).

    Raises:
        UserError: Naming the flag, the file, the OS error and the fix.
    """
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(21, "is a directory")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as err:
        raise UserError(
            f"{flag} {path}: cannot write it ({err.strerror or err}); pass a file name you can "
            "write to (it is tried at start-up, before any training)"
        ) from None
