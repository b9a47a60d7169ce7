"""``abft_spec(spec)``: a layer-spec rewrite that checks the attention GEMMs.

It deep-copies a stock or MeCeFO GPT layer (or block) spec and swaps, inside
``self_attention``'s submodules, the QKV projection for
:class:`~megatron_mecefo.abft.linear.AbftColumnParallelLinear`, the core attention for
:class:`~megatron_mecefo.abft.attention.AbftDotProductAttention` and the output projection
for :class:`~megatron_mecefo.abft.linear.AbftRowParallelLinear`. Parameter names and
checkpoint keys do not change; the layer class is untouched, so it composes with
``mecefo_spec`` in either order.

Transformer Engine: its fused attention (``TEDotProductAttention``) computes ``Q·Kᵀ``,
softmax and ``·V`` in one kernel, so the two inner GEMM outputs never exist in memory and
cannot be checksummed; ``TELayerNormColumnParallelLinear`` fuses the input norm into the QKV
GEMM, so the GEMM's operand (the norm output) is not visible either. ``abft_spec`` refuses
both with :class:`AbftSpecError`, naming the module and the fix (the local spec).
"""

from __future__ import annotations

import copy
from typing import Any, Union

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_mecefo.abft.attention import AbftDotProductAttention
from megatron_mecefo.abft.linear import AbftColumnParallelLinear, AbftRowParallelLinear

Spec = Union[ModuleSpec, TransformerBlockSubmodules]

_TE_REASONS = {
    "TEDotProductAttention": (
        "Transformer Engine's fused attention computes Q·Kᵀ, softmax and ·V in one kernel, so "
        "the scores and context GEMM outputs never exist in memory and cannot be checksummed"
    ),
    "TELayerNormColumnParallelLinear": (
        "it fuses the input norm into the QKV GEMM, so the GEMM's operand is not visible to "
        "encode a checksum from"
    ),
    "TEColumnParallelLinear": "its GEMM runs inside Transformer Engine (no unfused output)",
    "TERowParallelLinear": "its GEMM runs inside Transformer Engine (no unfused output)",
}
_FIX = (
    "build the model from the local spec (--transformer-impl local, or "
    "megatron_mecefo.gpt.layer_specs.gpt_decoder_spec(config, 'local')), or run without "
    "--mecefo-abft"
)


class AbftSpecError(ValueError):
    """A spec whose attention ABFT cannot protect, naming the module and the fix."""


def _name(obj: Any) -> str:
    return getattr(obj, "__name__", None) or type(obj).__name__


def _swap(current: Any, stock: type, checked: type, what: str) -> type:
    if current is checked:
        return checked
    if current is stock:
        return checked
    name = _name(current)
    reason = _TE_REASONS.get(name)
    if reason is not None:
        raise AbftSpecError(f"attention ABFT cannot protect {what} = {name}: {reason}; {_FIX}")
    raise AbftSpecError(
        f"attention ABFT cannot protect {what} = {name}: it wraps megatron-core's "
        f"{stock.__name__} only; {_FIX}"
    )


def _rewrite_layer(layer: Any) -> Any:
    if not isinstance(layer, ModuleSpec) or not (
        isinstance(layer.module, type) and issubclass(layer.module, TransformerLayer)
    ):
        raise AbftSpecError(f"expected a ModuleSpec of megatron's TransformerLayer, got {layer!r}")
    attn = layer.submodules.self_attention
    if not isinstance(attn, ModuleSpec) or not (
        isinstance(attn.module, type) and issubclass(attn.module, SelfAttention)
    ):
        raise AbftSpecError(
            f"attention ABFT needs megatron-core's SelfAttention, got "
            f"self_attention = {_name(getattr(attn, 'module', attn))} (multi-latent or other "
            "attention variants are not supported)"
        )
    subs = attn.submodules
    subs.linear_qkv = _swap(
        subs.linear_qkv, ColumnParallelLinear, AbftColumnParallelLinear, "linear_qkv"
    )
    subs.core_attention = _swap(
        subs.core_attention, DotProductAttention, AbftDotProductAttention, "core_attention"
    )
    subs.linear_proj = _swap(
        subs.linear_proj, RowParallelLinear, AbftRowParallelLinear, "linear_proj"
    )
    return layer


def abft_spec(spec: Spec) -> Spec:
    """A copy of a GPT layer or block spec with checked attention GEMMs; ``spec`` is kept.

    Raises:
        AbftSpecError: For Transformer-Engine attention modules, non-``SelfAttention``
            attention, and unknown linear classes; the message names the module and the fix.
    """
    spec = copy.deepcopy(spec)
    if isinstance(spec, TransformerBlockSubmodules):
        spec.layer_specs = [_rewrite_layer(layer) for layer in spec.layer_specs]
        return spec
    return _rewrite_layer(spec)
