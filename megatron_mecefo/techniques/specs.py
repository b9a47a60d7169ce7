"""MeCeFO layer specs: Megatron-Core's local and Transformer-Engine specs, rewritten.

``mecefo_spec(spec)`` deep-copies a stock GPT layer (or block) spec and swaps in
``MecefoTransformerLayer`` and, for low-rank FFN weight gradients, the low-rank fc1/fc2
linears. Parameter names and checkpoint keys are unchanged, so a MeCeFO model loads a stock
checkpoint and the other way round.

Ready-made objects, for ``GPTModel(transformer_layer_spec=...)`` or Megatron-LM's ``--spec``:

- ``mecefo_local_spec``: the local spec (runs on CPU);
- ``mecefo_te_spec``: the Transformer-Engine spec (None when TE is not installed);
- ``mecefo_layer_spec(config, vp_stage=None)``: a callable for megatron-core ≥ 0.19, whose
  ``--spec`` may name a function of the model config.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Optional, Union

from megatron.core.extensions import transformer_engine as te_ext
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_mecefo._optional import have_transformer_engine
from megatron_mecefo.techniques.lowrank_wgrad import (
    LowRankColumnParallelLinear,
    LowRankRowParallelLinear,
)
from megatron_mecefo.techniques.transformer_layer import MecefoTransformerLayer

Spec = Union[ModuleSpec, TransformerBlockSubmodules]


def _te(name: str) -> Any:
    """A TE layer class of megatron-core (a stand-in object when TE is not installed)."""
    return getattr(te_ext, name, None)


# Keeps local-spec and unfused TE checkpoints key-compatible with fused-LN TE checkpoints.
_PRE_MLP_NORM_KEY = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


class MecefoSpecError(ValueError):
    """A spec MeCeFO cannot rewrite, with the reason and the fix."""


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or repr(obj)


def _mlp_class(mlp: Any) -> Any:
    """The MLP class a spec's ``mlp`` field builds (ModuleSpec ≤ 0.17, partial ≥ 0.18)."""
    if isinstance(mlp, ModuleSpec):
        return mlp.module
    if isinstance(mlp, functools.partial):
        return getattr(mlp.func, "__self__", mlp.func)
    return mlp


def _rewrite_mlp_linears(layer: ModuleSpec) -> None:
    subs = layer.submodules
    mlp = subs.mlp
    mlp_cls = _mlp_class(mlp)
    fused = _te("TEFusedMLP")
    if isinstance(fused, type) and isinstance(mlp_cls, type) and issubclass(mlp_cls, fused):
        raise MecefoSpecError(
            "the MLP is TEFusedMLP (--use-te-op-fuser): its fused ops hide the FFN weight "
            "gradient; build the spec without use_te_op_fuser"
        )
    if not (isinstance(mlp_cls, type) and issubclass(mlp_cls, MLP)):
        raise MecefoSpecError(
            f"the MLP is {_name(mlp_cls)}, not a dense megatron MLP (MoE layers are not "
            "supported): low-rank FFN weight gradients need MLP's linear_fc1/linear_fc2; use a "
            "dense model, or mecefo_spec(..., lowrank=False)"
        )
    mlp_subs = mlp.submodules if isinstance(mlp, ModuleSpec) else mlp.keywords.get("submodules")
    if not isinstance(mlp_subs, MLPSubmodules):
        raise MecefoSpecError(f"the MLP spec has no MLPSubmodules: {mlp!r}")
    fc1, fc2 = mlp_subs.linear_fc1, mlp_subs.linear_fc2
    te_ln_column = _te("TELayerNormColumnParallelLinear")
    fc1_ok = (ColumnParallelLinear, LowRankColumnParallelLinear, _te("TEColumnParallelLinear"))
    fc2_ok = (RowParallelLinear, LowRankRowParallelLinear, _te("TERowParallelLinear"))
    if fc1 not in (*fc1_ok, te_ln_column) or fc2 not in fc2_ok:
        raise MecefoSpecError(
            f"unknown FFN linears fc1={_name(fc1)}, fc2={_name(fc2)}: low-rank weight gradients "
            "replace megatron-core's or TE's column/row-parallel linears only"
        )
    if fc1 is te_ln_column:
        # The pre-MLP norm was fused into fc1; un-fuse it so fc1 can be a plain linear.
        if subs.pre_mlp_layernorm is not IdentityOp:
            raise MecefoSpecError("fc1 fuses the pre-MLP norm but pre_mlp_layernorm is set too")
        subs.pre_mlp_layernorm = _te("TENorm")
        subs.sharded_state_dict_keys_map = {**subs.sharded_state_dict_keys_map, **_PRE_MLP_NORM_KEY}
    mlp_subs.linear_fc1 = LowRankColumnParallelLinear
    mlp_subs.linear_fc2 = LowRankRowParallelLinear


def _rewrite_layer(layer: Any, lowrank: bool) -> ModuleSpec:
    if not isinstance(layer, ModuleSpec) or not (
        isinstance(layer.module, type) and issubclass(layer.module, TransformerLayer)
    ):
        raise MecefoSpecError(
            f"expected a ModuleSpec of megatron's TransformerLayer, got {layer!r}"
        )
    if layer.module not in (TransformerLayer, MecefoTransformerLayer):
        raise MecefoSpecError(
            f"the layer class is {_name(layer.module)}; MeCeFO subclasses TransformerLayer "
            "itself, so a custom layer class must inherit from MecefoTransformerLayer instead"
        )
    layer.module = MecefoTransformerLayer
    if lowrank:
        _rewrite_mlp_linears(layer)
    return layer


def mecefo_spec(spec: Spec, lowrank: bool = True) -> Spec:
    """A MeCeFO copy of a stock GPT layer spec or block spec; ``spec`` is not modified.

    Args:
        spec: ``ModuleSpec(module=TransformerLayer, ...)`` (replicated over layers) or
            ``TransformerBlockSubmodules`` (one spec per layer), from the local or TE factory.
        lowrank: Swap fc1/fc2 for the low-rank linears. With the TE spec this un-fuses the
            pre-MLP norm from fc1 and runs the FFN linears without TE (no FP8 on the FFN);
            pass False to keep TE's FFN when ``MecefoConfig.lowrank_ffn`` is off.

    Raises:
        MecefoSpecError: For MoE or TE op-fuser MLPs (with ``lowrank``) and unknown layers.
    """
    spec = copy.deepcopy(spec)
    if isinstance(spec, TransformerBlockSubmodules):
        spec.layer_specs = [_rewrite_layer(layer, lowrank) for layer in spec.layer_specs]
        return spec
    return _rewrite_layer(spec, lowrank)


def get_mecefo_local_spec(lowrank: bool = True, **kwargs: Any) -> Spec:
    """``mecefo_spec(get_gpt_layer_local_spec(**kwargs))``."""
    return mecefo_spec(gpt_layer_specs.get_gpt_layer_local_spec(**kwargs), lowrank=lowrank)


def get_mecefo_te_spec(lowrank: bool = True, **kwargs: Any) -> Spec:
    """``mecefo_spec(get_gpt_layer_with_transformer_engine_spec(**kwargs))``; needs TE."""
    if not have_transformer_engine():
        raise RuntimeError(
            "the MeCeFO Transformer-Engine spec needs Transformer Engine, which is not "
            "installed; use mecefo_local_spec on machines without it"
        )
    if kwargs.get("use_te_op_fuser") and lowrank:
        raise MecefoSpecError(
            "use_te_op_fuser=True fuses the FFN ops and hides its weight gradient; drop it"
        )
    return mecefo_spec(
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs), lowrank=lowrank
    )


def mecefo_layer_spec(config: Any, vp_stage: Optional[int] = None) -> Spec:
    """The callable ``--spec megatron_mecefo.techniques.specs mecefo_layer_spec`` (megatron ≥ 0.19).

    Rewrites Megatron-LM's own default spec for ``config`` (``default_layer_spec`` of
    ``megatron.training.models.gpt``) when that exists, else the plugin's decoder spec.
    """
    try:
        from megatron.training.models.gpt import default_layer_spec
    except ImportError:
        from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec

        impl = getattr(config, "transformer_impl", "local")
        if impl == "transformer_engine" and not have_transformer_engine():
            # TransformerConfig defaults to TE; megatron-core < 0.19 has no --spec callables,
            # so this path only serves direct calls, where the local spec is the working one.
            warnings.warn(
                "Transformer Engine is not installed: using the MeCeFO local spec", stacklevel=2
            )
            impl = "local"
        return mecefo_spec(gpt_decoder_spec(config, impl, vp_stage))
    return mecefo_spec(default_layer_spec(config, vp_stage))


mecefo_local_spec: ModuleSpec = get_mecefo_local_spec()
"""The MeCeFO local spec (LayerNorm or RMSNorm per ``config.normalization``)."""

mecefo_te_spec: Optional[ModuleSpec] = get_mecefo_te_spec() if have_transformer_engine() else None
"""The MeCeFO Transformer-Engine spec, or None without Transformer Engine."""
