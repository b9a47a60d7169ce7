"""The supervisor's rank processes: starting them (tied to the supervisor's life), waiting for
their exits without polling, and killing them with whatever they started.

What the processes are for (which slot, which incarnation, a standby) is the supervisor's
business (:mod:`.supervisor`); this module only starts, watches and kills.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List

_QUIET_CPP_LOG = False
"""Whether :func:`quiet_cpp_log` set ``TORCH_CPP_LOG_LEVEL`` for this process (not for its
ranks)."""


@dataclass
class Child:
    """One rank process of this node."""

    slot: int
    inc: int
    proc: subprocess.Popen
    started: float


class ExitWatch:
    """Sleeps until a child process exits or a timeout passes, on Linux pidfds (no polling:
    the supervisor wakes a few times a second instead of a hundred, and its CPU is taken from
    the ranks on a shared node). Without pidfds (an old kernel) it sleeps in short steps."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self.selector = selectors.DefaultSelector()
        self.fds: Dict[int, int] = {}

    def add(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return  # polled instead
        self.fds[pid] = fd
        self.selector.register(fd, selectors.EVENT_READ, pid)

    def discard(self, pid: int) -> None:
        fd = self.fds.pop(pid, None)
        if fd is not None:
            self.selector.unregister(fd)
            os.close(fd)

    def wait(self, timeout_s: float, pids: List[int]) -> None:
        """Return when one of ``pids`` has exited (readable pidfd) or after ``timeout_s``."""
        if any(pid not in self.fds for pid in pids):
            timeout_s = min(timeout_s, self.poll_s)
        self.selector.select(max(timeout_s, 0.0))


def quiet_cpp_log() -> None:
    """Silence c10's log in the supervisor alone, unless the user set its level.

    The supervisor uses torch for the store alone. Its coordinator waits in the store between
    heartbeat checks, and c10 logs two warnings at each wait that times out (twice a second).
    Its ranks keep the user's setting (:func:`rank_environment`).
    """
    global _QUIET_CPP_LOG
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        _QUIET_CPP_LOG = True


def rank_environment() -> Dict[str, str]:
    """This process's environment for a rank, less what :func:`quiet_cpp_log` added."""
    env = dict(os.environ)
    if _QUIET_CPP_LOG:
        del env["TORCH_CPP_LOG_LEVEL"]
    return env


def start_process(command: List[str], env: Dict[str, str]) -> subprocess.Popen:
    """``python command...`` in a session of its own that dies with the supervisor."""
    return subprocess.Popen([sys.executable, *command], env=env, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """Child pre-exec: a new session (kill by process group) that dies with the supervisor
    (PR_SET_PDEATHSIG), so killing a node's supervisor takes its ranks with it."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def kill(pid: int) -> None:
    """SIGKILL a rank and its process group (it leads its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)  # the child leads its own session
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_group(pid: int) -> None:
    """SIGKILL what an exited rank left in its process group (e.g. the multiprocessing helpers
    of a checkpoint save: a supervised rank ends with os._exit, before their finalizers), which
    would hold the launcher's stdout open: Slurm's srun step would never end."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
