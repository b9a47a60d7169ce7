"""``apply_abft``: bind a model built from an ABFT spec to a per-process ``AbftState``."""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple, Union

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_mecefo.abft.attention import AbftDotProductAttention
from megatron_mecefo.abft.linear import AbftColumnParallelLinear, AbftRowParallelLinear
from megatron_mecefo.abft.state import AbftState

ModelLike = Union[torch.nn.Module, Iterable[torch.nn.Module]]


def _chunks(model: ModelLike) -> List[torch.nn.Module]:
    return [model] if isinstance(model, torch.nn.Module) else list(model)


def apply_abft(model: ModelLike, state: Optional[AbftState]) -> List[Tuple[int, str]]:
    """Bind ``state`` to every checked module of ``model``; ``None`` unbinds (stock behaviour).

    Args:
        model: A module or a list of model chunks (DDP / Float16Module wrappers are fine),
            built from :func:`~megatron_mecefo.abft.spec.abft_spec`.
        state: The process's :class:`AbftState`.

    Returns:
        The (layer number, op) sites found, in order.

    Raises:
        ValueError: If the model has no checked attention (it was not built from an ABFT spec).
    """
    sites: List[Tuple[int, str]] = []
    for chunk in _chunks(model):
        for module in chunk.modules():
            if not isinstance(module, TransformerLayer):
                continue
            attn = getattr(module, "self_attention", None)
            layer = module.layer_number
            parts = (
                ("qkv", getattr(attn, "linear_qkv", None), AbftColumnParallelLinear),
                ("scores", getattr(attn, "core_attention", None), AbftDotProductAttention),
                ("proj", getattr(attn, "linear_proj", None), AbftRowParallelLinear),
            )
            for op, part, cls in parts:
                if not isinstance(part, cls):
                    continue
                part.abft_state = state
                if op == "scores":
                    sites += [(layer, "scores"), (layer, "context")]
                else:
                    part.abft_layer, part.abft_op = layer, op
                    sites.append((layer, op))
    if not sites:
        raise ValueError(
            "the model has no ABFT-checked attention: build it with "
            "megatron_mecefo.abft.abft_spec(spec)"
        )
    if state is not None:
        if state.injector is not None:
            state.injector.bind_sites(sites)
        if not state.num_layers:  # the same on every rank: end_step sums fixed-size counts
            top = torch.tensor([float(max(layer for layer, _ in sites))])
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX)
            state.num_layers = int(top.item())
    return sorted(sites)
