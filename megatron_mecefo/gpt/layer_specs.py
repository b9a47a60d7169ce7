"""GPT layer specs for the local (pure megatron-core) and Transformer Engine backends."""

from __future__ import annotations

import copy
from typing import Optional, Union

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mecefo._optional import have_transformer_engine
from megatron_mecefo.gpt.norm import SequenceParallelTorchNorm

TRANSFORMER_IMPLS = ("local", "transformer_engine")


def gpt_decoder_spec(
    config: TransformerConfig,
    transformer_impl: str = "local",
    vp_stage: Optional[int] = None,
) -> Union[ModuleSpec, TransformerBlockSubmodules]:
    """The decoder spec for ``GPTModel(transformer_layer_spec=...)``.

    Args:
        config: The model's transformer config (normalization, qk_layernorm, SP are read).
        transformer_impl: ``"local"`` (megatron-core modules, runs on CPU) or
            ``"transformer_engine"`` (GPU, needs Transformer Engine installed).
        vp_stage: Virtual pipeline stage, for the number of layers this stage builds.

    Returns:
        The stock Megatron-Core layer spec, except that the local spec with sequence
        parallelism gets an SP-capable torch norm (the stock one refuses SP).
    """
    if transformer_impl == "transformer_engine":
        if not have_transformer_engine():
            raise RuntimeError(
                "--transformer-impl transformer_engine needs Transformer Engine, which is not "
                "installed; install megatron-mecefo[te] on a GPU machine, or use "
                "--transformer-impl local"
            )
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=None, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm
        )
    if transformer_impl != "local":
        raise ValueError(
            f"transformer_impl={transformer_impl!r}; expected one of {TRANSFORMER_IMPLS}"
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        normalization=config.normalization, qk_layernorm=config.qk_layernorm
    )
    if not config.sequence_parallel:
        return spec
    spec = copy.deepcopy(spec)
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=[spec] * num_layers, layer_norm=SequenceParallelTorchNorm
    )
