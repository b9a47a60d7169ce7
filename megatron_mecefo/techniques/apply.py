"""``apply_mecefo``: bind a model built from a MeCeFO spec to a per-process ``MecefoState``."""

from __future__ import annotations

from typing import Iterable, List, Optional, Union

import torch

from megatron_mecefo.techniques.lowrank_wgrad import _LowRankMixin
from megatron_mecefo.techniques.state import MecefoState
from megatron_mecefo.techniques.transformer_layer import MecefoTransformerLayer

ModelLike = Union[torch.nn.Module, Iterable[torch.nn.Module]]


def _chunks(model: ModelLike) -> List[torch.nn.Module]:
    return [model] if isinstance(model, torch.nn.Module) else list(model)


def mecefo_layers(model: ModelLike) -> List[MecefoTransformerLayer]:
    """Every ``MecefoTransformerLayer`` of ``model`` (a module or a list of model chunks)."""
    return [
        m
        for chunk in _chunks(model)
        for m in chunk.modules()
        if isinstance(m, MecefoTransformerLayer)
    ]


def mha_group_parameters(model: ModelLike) -> List[torch.nn.Parameter]:
    """The MHA-group parameters of every MeCeFO layer: the ones a takeover leaves at zero."""
    return [p for layer in mecefo_layers(model) for p in layer.mha_group_parameters()]


def apply_mecefo(model: ModelLike, state: Optional[MecefoState]) -> List[MecefoTransformerLayer]:
    """Bind ``state`` to every MeCeFO module of ``model``; ``None`` unbinds (always exact).

    Args:
        model: A module or list of model chunks (DDP/Float16Module wrappers are fine), built
            from a MeCeFO spec.
        state: The process's ``MecefoState``.

    Returns:
        The MeCeFO layers found.

    Raises:
        ValueError: If the model has no MeCeFO layers, or if ``state.config.lowrank_ffn`` is
            on and a layer's FFN linears are not the low-rank ones.
    """
    layers = mecefo_layers(model)
    if not layers:
        raise ValueError(
            "the model has no MecefoTransformerLayer: build it with a MeCeFO layer spec "
            "(megatron_mecefo.techniques.specs.mecefo_spec / mecefo_local_spec)"
        )
    for layer in layers:
        if state is not None and state.config.lowrank_ffn:
            for name in ("linear_fc1", "linear_fc2"):
                if not isinstance(getattr(layer.mlp, name, None), _LowRankMixin):
                    raise ValueError(
                        f"MecefoConfig.lowrank_ffn=True but layer {layer.layer_number}'s "
                        f"mlp.{name} is not a low-rank linear: build the spec with "
                        "mecefo_spec(..., lowrank=True), or set lowrank_ffn=False"
                    )
        layer.mecefo_state = state
    for chunk in _chunks(model):
        for name, module in chunk.named_modules():
            if isinstance(module, _LowRankMixin):
                module.mecefo_state = state
                module.mecefo_name = name
    return layers
