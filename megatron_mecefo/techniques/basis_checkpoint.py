"""The low-rank basis V and its refresh step, as checkpointable state.

V is recomputed every τ steps from the weights of the step it was refreshed at; a run
resumed between two refreshes would otherwise recompute V from the resumed weights and
diverge from the uninterrupted run. These two functions give and take, per low-rank linear,
the basis and the step it was computed at (``None`` for a linear that has not refreshed yet),
keyed by ``<chunk index>.<module name>``. The row-parallel V is TP-sharded, so a saved basis
restores only on the layout that saved it (the checkpoint code keeps it per rank).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Union

import torch

from megatron_mecefo.techniques.lowrank_wgrad import _LowRankMixin

ModelLike = Union[torch.nn.Module, Iterable[torch.nn.Module]]


def _lowrank_modules(model: ModelLike) -> Dict[str, _LowRankMixin]:
    chunks: List[torch.nn.Module] = [model] if isinstance(model, torch.nn.Module) else list(model)
    return {
        f"{i}.{name}": module
        for i, chunk in enumerate(chunks)
        for name, module in chunk.named_modules()
        if isinstance(module, _LowRankMixin)
    }


def basis_state_dict(model: ModelLike) -> Dict[str, Dict[str, Any]]:
    """``{key: {"basis": Tensor | None, "step": int | None}}`` for every low-rank linear.

    The tensors are detached CPU copies, so the dict can be saved while training goes on.
    """
    out: Dict[str, Dict[str, Any]] = {}
    for key, module in _lowrank_modules(model).items():
        basis: Optional[torch.Tensor] = module.mecefo_basis
        out[key] = {
            "basis": None if basis is None else basis.detach().to("cpu", copy=True),
            "step": module.mecefo_basis_step,
        }
    return out


def load_basis_state_dict(model: ModelLike, state: Dict[str, Dict[str, Any]]) -> int:
    """Restore what :func:`basis_state_dict` gave; returns how many bases were restored.

    Raises:
        ValueError: If the keys or a basis shape differ from the model's (another model or
            another TP layout).
    """
    modules = _lowrank_modules(model)
    if set(modules) != set(state):
        missing, extra = sorted(set(modules) - set(state)), sorted(set(state) - set(modules))
        raise ValueError(
            f"saved MeCeFO basis does not match the model's low-rank linears "
            f"(missing {missing[:3]}, unexpected {extra[:3]}); it was saved by another model"
        )
    restored = 0
    for key, module in modules.items():
        entry = state[key]
        basis = entry["basis"]
        if basis is not None:
            rows = module.weight.shape[1]
            if basis.shape[0] != rows:
                raise ValueError(
                    f"saved MeCeFO basis of {key} has {basis.shape[0]} rows, the weight's "
                    f"input dimension here is {rows}: it was saved on another TP layout"
                )
            basis = basis.to(device=module.weight.device, dtype=module.weight.dtype)
            restored += 1
        module.mecefo_basis = basis
        module.mecefo_basis_step = entry["step"]
    return restored
