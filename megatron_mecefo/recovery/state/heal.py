"""Healing joiners: the trainer's state copied from an up-to-date data-parallel peer.

After a new world is built, its members all-gather ``(slot, holds valid state, iteration)``.
In each data-parallel group, the members at the newest iteration are the sources and the
others are healed (:func:`heal_plan`); each receiver is assigned one source (round robin), and
a source streams its state to its receivers only (:mod:`.tensor_stream`): members that hold the
state move no bytes. The structure travels pickled; the tensors land in the receiver's own
model and optimizer buffers.

Every member of the world then waits in the membership store until every receiver has said it
is done (:func:`wait_for_heals`): the next collective (the replica check, a pipeline send)
would otherwise wait on a heal of any length under the collective timeout. That wait has no
deadline from the size: it fails only when no source has made progress for the timeout.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_mecefo.recovery.state.carry import import_state
from megatron_mecefo.recovery.state.tensor_stream import (
    ChecksumMismatch,
    StreamConfig,
    StreamStats,
    destinations,
    fill_tree,
    recv_tensors,
    send_tensors,
    split_tree,
)


class ShardLost(Exception):
    """No member of a data-parallel group holds the newest committed state: the model shard
    of those TP/PP coordinates is lost (e.g. every replica's rank of it died). Its ranks
    cannot heal from an older iteration (their shard would not match the others'), so the
    job stops with this message."""


class NoTrainedState(Exception):
    """No member of a world holds trained state: every rank that trained has died, and the
    members are joiners (replacements, spares) whose state is stale or was never set. Nothing
    can heal them, nor the joiners of any later generation, so the job stops with this
    message (and the last checkpoint) instead of forming generation after generation."""


def heal_target(infos: Sequence[Tuple[int, bool, int]]) -> int:
    """The newest committed iteration a member of the world holds: what every member is
    healed to.

    Args:
        infos: Per global rank, ``(slot, holds valid state, its iteration or -1)``.

    Raises:
        NoTrainedState: No member holds trained state (a one-line message).
    """
    target = max(it if ok else -1 for _, ok, it in infos)
    if target < 0:
        slots = ", ".join(str(slot) for slot, _, _ in infos)
        which = f"slot {slots}" if len(infos) == 1 else f"slots {slots}"
        raise NoTrainedState(
            "no member holds trained state: every rank that trained has died, and the members "
            f"left ({which}) are joiners with nothing to heal from, so training cannot continue "
            "in memory"
        )
    return target


def heal_source(
    infos: Sequence[Tuple[int, bool, int]], group: Sequence[int], target: int
) -> Optional[int]:
    """The first rank that can heal the data-parallel ``group`` (global ranks) to ``target``.

    Args:
        infos: Per global rank, ``(slot, holds valid state, its iteration or -1)``.
        group: The global ranks of one data-parallel group.
        target: The newest iteration any member of the world holds.

    Returns:
        The first rank of ``group`` at ``target`` if some member is not; ``None`` if every
        member is at ``target`` (nothing to heal).

    Raises:
        ShardLost: No member of ``group`` is at ``target`` (a one-line message).
    """
    current = [infos[r][1] and infos[r][2] == target for r in group]
    if all(current):
        return None
    if any(current):
        return group[current.index(True)]
    held = ", ".join(
        f"slot {infos[r][0]}: " + (f"iteration {infos[r][2]}" if infos[r][1] else "none")
        for r in group
    )
    raise ShardLost(
        f"no member of data-parallel group {list(group)} holds the state of iteration "
        f"{target}, which the other groups hold ({held}): that model shard is lost; resume "
        "from the last checkpoint (--load)"
    )


def heal_plan(
    infos: Sequence[Tuple[int, bool, int]], group: Sequence[int], target: int
) -> Dict[int, List[int]]:
    """Source rank -> the ranks it heals, in the data-parallel ``group``: receivers are dealt
    round robin over the up-to-date members; empty when nothing is to heal.

    Raises:
        ShardLost: As :func:`heal_source`.
    """
    if heal_source(infos, group, target) is None:
        return {}
    current = [r for r in group if infos[r][1] and infos[r][2] == target]
    behind = [r for r in group if r not in current]
    plan: Dict[int, List[int]] = {}
    for i, r in enumerate(behind):
        plan.setdefault(current[i % len(current)], []).append(r)
    return plan


def send_state(
    state: Dict[str, Any],
    dsts: Sequence[int],
    group: Any,
    config: StreamConfig,
    on_progress: Optional[Callable[[int, int], None]] = None,
    more_groups: Sequence[Any] = (),
) -> StreamStats:
    """Send ``state`` (:func:`.carry.export_state`) to the global ranks ``dsts``; the tensors'
    messages are dealt over ``group`` and ``more_groups`` (:func:`stream_groups`)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    skeleton, tensors = split_tree(state, config.inline_bytes)
    for dst in dsts:
        dist.send_object_list([skeleton], dst=dst, group=group)
    structure_s = time.perf_counter() - t0
    stats = send_tensors(tensors, dsts, group, config, on_progress, more_groups)
    stats.structure_s = structure_s
    return stats


def receive_state(
    trainer: Any, src: int, group: Any, config: StreamConfig, more_groups: Sequence[Any] = ()
) -> StreamStats:
    """Receive the state from global rank ``src`` into ``trainer`` and import it (over the
    sender's ``group`` and ``more_groups``).

    Raises:
        ChecksumMismatch: A message arrived changed (the message names it).
    """
    import torch.distributed as dist

    t0 = time.perf_counter()
    # The receiver's own state is where the bytes land (its parameters, its optimizer's
    # moments when it has them); the rest is allocated once, at its final place. Gathered
    # before the structure arrives: the sender is exporting and pickling meanwhile.
    own = {"model": [chunk.state_dict() for chunk in trainer.model_chunks]}
    try:
        own["optimizer"] = trainer.optimizer.state_dict()
    except AssertionError:  # megatron's DistributedOptimizer before its first step
        pass
    got: List[Any] = [None]
    dist.recv_object_list(got, src=src, group=group)
    skeleton = got[0]
    device = next(p.device for c in trainer.model_chunks for p in c.parameters())
    dests = destinations(skeleton, own, device)
    del own
    structure_s = time.perf_counter() - t0
    try:
        stats = recv_tensors(dests, src, group, config, more_groups)
    except ChecksumMismatch as err:
        raise ChecksumMismatch(f"heal of rank {dist.get_rank()} from rank {src}: {err}") from None
    t0 = time.perf_counter()
    import_state(trainer, fill_tree(skeleton, dests, device))
    stats.structure_s, stats.import_s = structure_s, time.perf_counter() - t0
    return stats


def stream_groups(group: Any, config: StreamConfig) -> List[Any]:
    """The groups beside ``group`` (a data-parallel group) that a heal's messages are also
    dealt over, at most ``config.connections - 1``: Megatron's gloo data-parallel group, when
    ``group`` is a gloo group too, over the same ranks (a second connection between each
    sender and joiner, made when the world was built). None on NCCL, whose own channels
    spread a transfer, or without Megatron's gloo groups. Every member computes the same."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if config.connections < 2 or dist.get_backend(group) != "gloo":
        return []
    try:
        other = ps.get_data_parallel_group_gloo()
    except (AssertionError, RuntimeError):  # built with create_gloo_process_groups=False
        return []
    if other is None or other is group or dist.get_backend(other) != "gloo":
        return []
    if dist.get_process_group_ranks(other) != dist.get_process_group_ranks(group):
        return []
    return [other]


def wait_for_heals(
    store: Any,
    prefix: str,
    receivers: Sequence[int],
    sources: Sequence[int],
    stall_s: float,
    poll_s: float,
    abort_check: Callable[[], Optional[str]],
) -> float:
    """Wait until every rank of ``receivers`` has set ``<prefix>/done/<rank>``; returns the
    seconds waited.

    The deadline is on progress, not on size: each source sets ``<prefix>/sent/<rank>`` as
    it goes (:func:`progress_reporter`), and the wait fails only when no source's count has
    moved for ``stall_s``. ``abort_check`` returns a reason to stop (a newer generation, a
    fatal error), which is raised as a ``RuntimeError``.

    The store wakes the waiter the moment the last key is set; between wake-ups of at most
    ``5 * poll_s`` it looks at ``abort_check`` and the progress. Polling every ``poll_s``
    instead cost the bystanders of a DP4 heal four store round trips each per 10 ms, on the
    cores the transfer runs on.

    Raises:
        RuntimeError: A stall, or what ``abort_check`` said.
    """
    from torch.distributed import DistStoreError

    t0 = time.monotonic()
    keys = [f"{prefix}/done/{r}" for r in receivers]
    last, moved = None, time.monotonic()
    wake = datetime.timedelta(seconds=max(5 * poll_s, 0.001))
    while True:
        try:
            store.wait(keys, wake)
            break
        except DistStoreError:  # not all done yet: a reason to stop, or a stall?
            pass
        reason = abort_check()
        if reason:
            raise RuntimeError(f"heal stopped: {reason}")
        counts = tuple(_get_int(store, f"{prefix}/sent/{s}") for s in sources)
        if counts != last:
            last, moved = counts, time.monotonic()
        elif time.monotonic() - moved > stall_s:
            raise RuntimeError(
                f"heal: no progress for {stall_s:.0f} s (messages sent per source "
                f"{dict(zip(sources, counts, strict=False))})"
            )
    return time.monotonic() - t0


def _get_int(store: Any, key: str) -> int:
    return int(store.get(key)) if store.check([key]) else 0


def progress_reporter(store: Any, key: str, every_s: float) -> Callable[[int, int], None]:
    """An ``on_progress`` for :func:`send_state` that sets ``key`` to the messages sent, at
    most every ``every_s`` (and at the last one)."""
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] >= every_s:
            last[0] = now
            store.set(key, str(done))

    return report


def mark_done(store: Any, prefix: str, rank: int) -> None:
    """This receiver holds the state and checked it."""
    store.set(f"{prefix}/done/{rank}", "1")


__all__ = [
    "ChecksumMismatch",
    "ShardLost",
    "heal_plan",
    "heal_source",
    "mark_done",
    "progress_reporter",
    "receive_state",
    "send_state",
    "stream_groups",
    "wait_for_heals",
]
