"""A trainer's state as local tensors: carried across a regroup, copied to a joiner (heal).

``export_state`` takes the state at the last committed iteration boundary: the model chunks'
tensors, the optimizer state, the LR scheduler, the RNG states and the MeCeFO controller
counters of that boundary, the MeCeFO bases, the data position and the logged history. A
survivor keeps it in memory and loads it into the model it rebuilds in the new world
(nothing is read from disk); a joiner receives it from a data-parallel peer with the same
TP/PP coordinates (``heal``) and checks it against the sender's SHA-256 digest.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch


def boundary_snapshot(trainer: Any) -> Dict[str, Any]:
    """RNG states and controller counters at an iteration boundary (cheap: a few KB)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    snap: Dict[str, Any] = {
        "rng": {
            "torch": torch.get_rng_state(),
            "tracker": {k: v.clone() for k, v in tracker.items()},
        }
    }
    ctrl = getattr(trainer, "controller", None)
    if ctrl is not None:
        snap["controller"] = {
            k: getattr(ctrl, k)
            for k in ("degraded_iterations", "fallback_iterations", "samples_processed",
                      "samples_skipped", "_announced")  # fmt: skip
        }
    return snap


def export_state(trainer: Any, boundary: Dict[str, Any]) -> Dict[str, Any]:
    """The trainer's state at its last committed boundary (tensors shared, not copied)."""
    basis = {}
    for i, chunk in enumerate(trainer.model_chunks):
        for name, module in chunk.named_modules():
            if getattr(module, "mecefo_basis", None) is not None:
                basis[f"{i}.{name}"] = (module.mecefo_basis, module.mecefo_basis_step)
    return {
        "iteration": trainer.iteration,
        "consumed_samples": trainer.consumed_samples,
        "model": [chunk.state_dict() for chunk in trainer.model_chunks],
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "boundary": boundary,
        "mecefo_basis": basis,
        "history": list(trainer.history),
        "evals": list(trainer.evals),
        "saved": list(trainer.saved),
        "extra": trainer.extra_state(),
    }


def import_state(trainer: Any, state: Dict[str, Any]) -> None:
    """Load ``state`` into a trainer built in the new world and rewind its data iterator."""
    from megatron.core import tensor_parallel

    for chunk, sd in zip(trainer.model_chunks, state["model"], strict=True):
        chunk.load_state_dict(sd, strict=True)
    trainer.optimizer.load_state_dict(state["optimizer"])
    # Megatron's OptimizerParamScheduler.load_state_dict *adds* the saved step count to its
    # own (made for a fresh scheduler): start from zero, or a second import doubles the steps.
    trainer.scheduler.num_steps = 0
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.iteration = state["iteration"]
    trainer.consumed_samples = state["consumed_samples"]
    trainer.history = list(state["history"])
    trainer.evals = list(state["evals"])
    trainer.saved = list(state["saved"])
    b = state["boundary"]
    torch.set_rng_state(b["rng"]["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(
        {k: v.clone() for k, v in b["rng"]["tracker"].items()}
    )
    ctrl = getattr(trainer, "controller", None)
    if ctrl is not None and "controller" in b:
        for k, v in b["controller"].items():
            setattr(ctrl, k, v)
    modules = {
        f"{i}.{name}": m
        for i, chunk in enumerate(trainer.model_chunks)
        for name, m in chunk.named_modules()
    }
    for name, (basis, step) in state["mecefo_basis"].items():
        modules[name].mecefo_basis = basis
        modules[name].mecefo_basis_step = step
    trainer.load_extra_state(state.get("extra", {}))
    trainer.rewind_data(trainer.consumed_samples)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested dict/list/tuple, in a deterministic order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def state_digest(trainer: Any) -> str:
    """SHA-256 of the parameters and the optimizer state (the heal checksum)."""
    h = hashlib.sha256()
    for chunk in trainer.model_chunks:
        for _, p in sorted(chunk.named_parameters()):
            h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for t in _tensors(trainer.optimizer.state_dict()):
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    # The learning rate and weight decay the next step will use (the scheduler's state).
    h.update(
        repr([(g["lr"], g.get("weight_decay")) for g in trainer.optimizer.param_groups]).encode()
    )
    return h.hexdigest()


class ShardLost(Exception):
    """No member of a data-parallel group holds the newest committed state: the model shard
    of those TP/PP coordinates is lost (e.g. every replica's rank of it died). Its ranks
    cannot heal from an older iteration (their shard would not match the others'), so the
    job stops with this message."""


def heal_source(
    infos: Sequence[Tuple[int, bool, int]], group: Sequence[int], target: int
) -> Optional[int]:
    """The rank that heals the data-parallel ``group`` (global ranks) to iteration ``target``.

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


def heal(trainer: Any, state: Any, src: int, group: Any, receiving: bool) -> float:
    """Copy the state of global rank ``src`` to the receivers of ``group`` (a DP group).

    Every rank of ``group`` calls this; ``state`` is the sender's :func:`export_state`
    (ignored elsewhere). A receiver loads it and verifies the digest; returns seconds spent.
    """
    import time

    import torch.distributed as dist

    t0 = time.time()
    payload = [None]
    if dist.get_rank() == src:
        payload = [{"state": state, "digest": state_digest(trainer)}]
    dist.broadcast_object_list(payload, src=src, group=group)
    if receiving:
        import_state(trainer, payload[0]["state"])
        mine = state_digest(trainer)
        if mine != payload[0]["digest"]:
            raise RuntimeError(
                f"heal: state digest {mine[:12]} differs from the sender's "
                f"{payload[0]['digest'][:12]} (rank {src})"
            )
    return time.time() - t0
