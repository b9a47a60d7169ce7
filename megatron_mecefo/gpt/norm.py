"""A torch LayerNorm/RMSNorm that works with sequence parallelism in the local layer spec.

Megatron-Core's ``WrappedTorchNorm`` (the local spec's norm when apex is absent) asserts
``not config.sequence_parallel``. Under sequence parallelism each TP rank normalises its own
slice of the sequence, so the norm weights only get partial gradients; tagging the parameters
``sequence_parallel=True`` makes ``finalize_model_grads`` all-reduce them over the TP group,
exactly as it does for Transformer Engine's norms.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelTorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` per ``config.normalization``.

    Same construction signature as ``WrappedTorchNorm``, so it drops into a layer spec.
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by the torch norm")
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported by the torch norm; "
                f"use one of {sorted(norms)}"
            )
        norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            # Read by finalize_model_grads: all-reduce this grad over the TP group.
            param.sequence_parallel = config.sequence_parallel
        return norm
