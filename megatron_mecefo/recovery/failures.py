"""Which failure of a rank is its generation's, and the checkpoint a stopped job names.

Inside a generation, a rank leaves the world and waits for the next one when its world failed
under it: a peer died, or the coordinator announced a failure generation and the watchdog
aborted the world. Megatron-LM and a user's code do not always let the collective's error
through as it was raised: Megatron-Core's dataset builder, for one, catches the barrier's
``RuntimeError`` and raises a plain ``Exception("MockGPTDataset failed to build as a mock
data generator")`` from it. :func:`generation_failure` therefore looks at the whole chain of
causes and contexts, and at whether the world was aborted, not at the raised type alone; a
rank that exited instead was counted as a death, and the survivors of a replica were lost
with it.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional, Tuple

COLLECTIVE_MESSAGES = (
    "gloo/transport",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "NCCL error",
    "NCCL communicator",
    "Connection closed by peer",
    "Connection reset by peer",
    "Application timeout caused pair closure",
    "Socket Timeout",
)
"""Parts of the messages of gloo's and NCCL's errors, which torch raises as a plain
``RuntimeError`` (measured with torch 2.13: a gloo barrier whose peer exited raises
``RuntimeError: [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer ...``)."""


def causes(err: BaseException) -> Iterator[BaseException]:
    """``err`` and every exception in its ``__cause__`` and ``__context__`` chains, once each.

    ``__context__`` is followed even under ``raise ... from None``: the suppressed error is
    still where the failure came from.
    """
    seen = set()
    todo = [err]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend(e for e in (current.__context__, current.__cause__) if e is not None)


def collective_error(err: BaseException) -> bool:
    """Whether ``err`` itself is an error of a collective, of the world's store or of an
    aborted world (not one of the exceptions wrapped around it)."""
    import torch.distributed as dist

    from megatron_mecefo.recovery.abortable_waits import WorldAborted
    from megatron_mecefo.recovery.world_store import WorldBuildAborted

    if isinstance(err, (dist.DistError, WorldAborted, WorldBuildAborted, ConnectionError)):
        return True
    if isinstance(err, (RuntimeError, OSError)):
        text = str(err)
        return any(marker in text for marker in COLLECTIVE_MESSAGES)
    return False


def generation_failure(err: BaseException, world_aborted: bool) -> bool:
    """Whether ``err``, raised inside a generation, ends that generation only (the rank
    leaves the world and waits for the next one) rather than the process.

    Args:
        err: What the trainer raised.
        world_aborted: Whether this rank's world was ended from outside (its watchdog fired,
            or a failure generation superseded it): then whatever the trainer raised is that
            abort's consequence.

    Returns:
        True when the world was aborted, when ``err`` is a ``RuntimeError`` or an
        ``OSError`` (what gloo raises; the generation loop has always taken these as the
        world's), or when a collective's error (:func:`collective_error`) is in its chain of
        causes, whatever type was wrapped around it.
    """
    if world_aborted or isinstance(err, (RuntimeError, OSError)):
        return True
    return any(collective_error(e) for e in causes(err))


def root_collective_error(err: BaseException) -> Optional[BaseException]:
    """The first collective error in ``err``'s chain (for the rank's one-line report)."""
    return next((e for e in causes(err) if e is not err and collective_error(e)), None)


def last_checkpoint(args: Any) -> Optional[Tuple[str, str]]:
    """``(directory, iteration)`` of the checkpoint ``--save`` (else ``--load``) names in its
    tracker file (``latest_checkpointed_iteration.txt``); None where neither has one.

    ``args.checkpoint_dirs``, where present, are the directories (Megatron-LM's job flags
    hide ``save`` and ``load`` from the session, which does not load its checkpoints)."""
    dirs = getattr(args, "checkpoint_dirs", None)
    if dirs is None:
        dirs = (getattr(args, "save", None), getattr(args, "load", None))
    for directory in dirs:
        iteration = tracked_iteration(directory)
        if iteration is not None:
            return directory, iteration
    return None


def tracked_iteration(directory: Optional[str]) -> Optional[str]:
    """What Megatron's tracker file (``latest_checkpointed_iteration.txt``) in ``directory``
    says, or None where there is none."""
    if not directory:
        return None
    try:
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as f:
            return f.read().strip()
    except OSError:
        return None


def checkpoint_line(args: Any) -> str:
    """What a job that cannot continue in memory says about the disk: the last checkpoint and
    the flag that resumes from it, or that there is none."""
    found = last_checkpoint(args)
    if found is None:
        return (
            "last checkpoint: none (no checkpoint in --save or --load); the run must start "
            "again (save checkpoints with --save DIR --save-interval N)"
        )
    directory, iteration = found
    what = "iteration " + iteration if iteration.isdigit() else iteration
    return f"last checkpoint: {what} in {directory}; resume with --load {directory}"
