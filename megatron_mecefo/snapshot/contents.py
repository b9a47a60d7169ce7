"""What a snapshot holds, and putting it back.

Per rank: the model parameters; the optimizer's state as the inner torch optimizer holds it
(with ``--use-distributed-optimizer`` that is this rank's shard: the fp32 main params and the
Adam moments; without it, the full state); the torch RNG state and, on GPU, the CUDA RNG and
Megatron's CUDA RNG tracker; and, as metadata, the iteration, consumed samples, the LR
scheduler and the step of each low-rank basis V (whose tensor is in the snapshot too).

Tensors are named, so ``restore`` can check that a snapshot fits the live model. Optimizer
state that a fresh process has not created yet (torch Adam builds it at its first step) is
allocated from the recorded shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch


@dataclass
class TrainingState:
    """The live objects a snapshot is taken from and restored into."""

    model_chunks: List[torch.nn.Module]
    optimizer: Any
    scheduler: Any = None
    counters: Dict[str, int] = field(default_factory=dict)
    """``iteration`` and ``consumed_samples``, as the trainer keeps them."""
    extra: Dict[str, Any] = field(default_factory=dict)
    """More JSON-able trainer state kept with the snapshot (e.g. the MeCeFO controller's
    counters); :func:`restore` updates it in place."""


def _parts(optimizer: Any) -> List[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _lowrank(model_chunks: List[torch.nn.Module]) -> Dict[str, torch.nn.Module]:
    """MeCeFO's low-rank linears (``techniques.lowrank_wgrad``), found by their basis
    attributes so that this module does not import megatron-core."""
    return {
        f"{i}.{name}": module
        for i, chunk in enumerate(model_chunks)
        for name, module in chunk.named_modules()
        if hasattr(module, "mecefo_basis") and hasattr(module, "mecefo_basis_step")
    }


def _rng_tensors() -> Dict[str, torch.Tensor]:
    out = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["rng.cuda"] = torch.cuda.get_rng_state()
        try:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            for name, state in get_cuda_rng_tracker().get_states().items():
                out[f"rng.tracker.{name}"] = state
        except Exception:  # noqa: BLE001 (no tracker initialised: nothing to keep)
            pass
    return out


def collect(state: TrainingState) -> tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """The snapshot's tensors (live tensors, not copies: copy them before the next step
    writes them) and its JSON-able metadata."""
    tensors: Dict[str, torch.Tensor] = {}
    for i, chunk in enumerate(state.model_chunks):
        for name, param in chunk.named_parameters():
            tensors[f"model{i}.{name}"] = param.data
    for j, part in enumerate(_parts(state.optimizer)):
        inner = part.optimizer
        for g, group in enumerate(inner.param_groups):
            for k, param in enumerate(group["params"]):
                tensors[f"optim{j}.main.{g}.{k}"] = param.data
                for key, value in inner.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"optim{j}.state.{g}.{k}.{key}"] = value
    bases = {}
    for key, module in _lowrank(state.model_chunks).items():
        bases[key] = module.mecefo_basis_step
        if module.mecefo_basis is not None:
            tensors[f"basis.{key}"] = module.mecefo_basis
    tensors.update(_rng_tensors())
    meta = {
        "counters": dict(state.counters),
        "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
        "basis_steps": bases,
        "extra": dict(state.extra),
    }
    return tensors, meta


class SnapshotMismatch(ValueError):
    """A snapshot of another model or layout; the message names the keys and both shapes."""


def restore(state: TrainingState, tensors: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> None:
    """Write a snapshot (CPU tensors by name, and its metadata) into the live objects.

    Raises:
        SnapshotMismatch: If the snapshot's parameters do not match the model's (another model
            or another layout), naming the keys with both shapes.
    """
    live = {
        f"model{i}.{name}": list(param.shape)
        for i, chunk in enumerate(state.model_chunks)
        for name, param in chunk.named_parameters()
    }
    saved = {n: list(t.shape) for n, t in tensors.items() if n.startswith("model")}
    problems = [
        f"{name}: snapshot {saved.get(name, 'none')}, model {live.get(name, 'none')}"
        for name in sorted(set(live) | set(saved))
        if saved.get(name) != live.get(name)
    ]
    if problems:
        more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
        raise SnapshotMismatch(
            f"the snapshot was taken by another model or layout: {'; '.join(problems[:2])}{more}"
        )
    with torch.no_grad():
        for i, chunk in enumerate(state.model_chunks):
            for name, param in chunk.named_parameters():
                param.data.copy_(tensors[f"model{i}.{name}"])
    restore_optimizer(state.optimizer, tensors)
    for key, module in _lowrank(state.model_chunks).items():
        saved = tensors.get(f"basis.{key}")
        module.mecefo_basis = None if saved is None else saved.to(module.weight.device, copy=True)
        module.mecefo_basis_step = meta["basis_steps"].get(key)
    if state.scheduler is not None and meta.get("scheduler") is not None:
        state.scheduler.load_state_dict(meta["scheduler"])
    state.counters.update(meta["counters"])
    state.extra.update(meta.get("extra", {}))
    # Clones: the RNG setters need a tensor that owns its storage (a view into the slot's
    # mapped buffer, at an offset, crashes torch.set_rng_state).
    torch.set_rng_state(tensors["rng.torch"].clone())
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"].clone())
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = {
            n[len("rng.tracker.") :]: t.clone()
            for n, t in tensors.items()
            if n.startswith("rng.tracker.")
        }
        if tracker:
            get_cuda_rng_tracker().set_states(tracker)


def restore_optimizer(optimizer: Any, tensors: Dict[str, torch.Tensor]) -> None:
    """Write the ``optim*`` tensors of a snapshot (or of :func:`reshard`) into the inner
    optimizers: main params and state (allocated from the saved shapes where missing)."""
    with torch.no_grad():
        for j, part in enumerate(_parts(optimizer)):
            inner = part.optimizer
            for g, group in enumerate(inner.param_groups):
                for k, param in enumerate(group["params"]):
                    param.data.copy_(tensors[f"optim{j}.main.{g}.{k}"])
                    prefix = f"optim{j}.state.{g}.{k}."
                    entries = {
                        n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)
                    }
                    if entries:
                        slot = inner.state.setdefault(param, {})
                        for key, saved in entries.items():
                            live: Optional[torch.Tensor] = slot.get(key)
                            # A scalar gets a tensor of its own: megatron-core's
                            # DistributedOptimizer.load_state_dict gives every parameter the
                            # same 'step' tensor, which torch's Adam would then advance once
                            # per parameter at each step (a wrong bias correction).
                            if live is None or live.shape != saved.shape or saved.dim() == 0:
                                live = torch.empty_like(saved, device=param.device)
                                slot[key] = live
                            live.copy_(saved)


def dist_opt_map(state: TrainingState) -> Optional[List[List[Any]]]:
    """Which slice of which parameter each distributed-optimizer shard tensor holds, or None
    without the distributed optimizer.

    One row per shard tensor: ``[part, group, index, parameter name, start, end]``: the inner
    optimizer's ``param_groups[group]["params"][index]`` of optimizer part ``part`` holds the
    elements ``start:end`` of the flattened parameter (megatron-core's
    ``_get_model_param_range_map(param)["param"]``). This depends on the data-parallel size,
    so a snapshot records it: the shards of a lost layout can then be put back together.
    """
    names = {
        id(param): f"model{i}.{name}"
        for i, chunk in enumerate(state.model_chunks)
        for name, param in chunk.named_parameters()
    }
    rows: List[List[Any]] = []
    for j, part in enumerate(_parts(state.optimizer)):
        index = getattr(part, "model_param_group_index_map", None)
        if index is None:
            return None
        for param, (g, k) in index.items():
            rng = part._get_model_param_range_map(param)["param"]
            rows.append([j, g, k, names[id(param)], int(rng.start), int(rng.end)])
    return sorted(rows)


def reshard(
    shards: List[tuple[Dict[str, Any], Dict[str, torch.Tensor]]],
    new_map: List[List[Any]],
    sizes: Dict[str, int],
) -> Dict[str, torch.Tensor]:
    """The distributed-optimizer tensors of a new layout, from every shard of an old one.

    Args:
        shards: ``(metadata, tensors)`` of every member of the old data-parallel group (each
            with its ``dist_opt_map``).
        new_map: :func:`dist_opt_map` of the live optimizer (the new layout).
        sizes: Elements of each parameter, by name.

    Returns:
        ``optim{j}.main.{g}.{k}`` and ``optim{j}.state.{g}.{k}.{key}`` for the new layout, as
        :func:`restore` reads them.

    Raises:
        ValueError: If the old shards do not cover every element of a needed parameter.
    """
    full: Dict[tuple, torch.Tensor] = {}  # (part, name, key) -> the whole flattened tensor
    filled: Dict[tuple, torch.Tensor] = {}
    scalars: Dict[tuple, torch.Tensor] = {}  # (part, name, key) -> e.g. Adam's step
    for meta, tensors in shards:
        for j, g, k, name, start, end in meta["dist_opt_map"]:
            pieces = {"main": tensors[f"optim{j}.main.{g}.{k}"]}
            prefix = f"optim{j}.state.{g}.{k}."
            for n, t in tensors.items():
                if n.startswith(prefix):
                    pieces[n[len(prefix) :]] = t
            for key, t in pieces.items():
                if t.dim() == 0:
                    scalars[(j, name, key)] = t
                    continue
                whole = full.get((j, name, key))
                if whole is None:
                    whole = full[(j, name, key)] = torch.zeros(sizes[name], dtype=t.dtype)
                    filled[(j, name, key)] = torch.zeros(sizes[name], dtype=torch.bool)
                whole[start:end] = t.reshape(-1)
                filled[(j, name, key)][start:end] = True
    out: Dict[str, torch.Tensor] = {}
    for j, g, k, name, start, end in new_map:
        for (pj, pname, key), whole in full.items():
            if (pj, pname) != (j, name):
                continue
            if not bool(filled[(j, name, key)][start:end].all()):
                raise ValueError(f"the old optimizer shards do not cover {name}[{start}:{end}]")
            n = f"optim{j}.main.{g}.{k}" if key == "main" else f"optim{j}.state.{g}.{k}.{key}"
            out[n] = whole[start:end].clone()
        for (pj, pname, key), value in scalars.items():
            if (pj, pname) == (j, name):
                out[f"optim{j}.state.{g}.{k}.{key}"] = value.clone()
        if f"optim{j}.main.{g}.{k}" not in out:
            raise ValueError(f"no optimizer shard of the old layout holds {name}")
    return out
