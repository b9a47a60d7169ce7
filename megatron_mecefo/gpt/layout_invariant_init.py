"""Initialise a Megatron-Core model identically for every TP/PP layout.

Megatron's own CPU initialisation draws each full master weight from the process's RNG stream
and slices it per TP rank. That is not layout-invariant: every pipeline stage starts from the
same stream (so PP2's second stage repeats PP1's first layers), and a SwiGLU ``linear_fc1`` is
laid out per TP rank as ``[gate_i; up_i]``, so TP2 slices a different gate than TP1.

Here each parameter is drawn from its *checkpoint-space* tensor instead: the model's sharded
state dict names every global tensor (key plus layer offset), its global shape and this rank's
slice. The global tensor is generated from a generator seeded by ``(seed, key, layer)`` and
the rank copies its slice. Any TP/PP(/VPP) layout therefore starts from the same model, which
is what makes "TP2×PP2 equals TP1×PP1" a testable property.
"""

from __future__ import annotations

import math
import zlib
from typing import Iterable

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.transformer.transformer_config import TransformerConfig

# Output projections of each residual branch get Megatron's scaled init (std / sqrt(2 L)).
_SCALED_INIT_SUFFIXES = ("linear_proj.weight", "linear_fc2.weight")


def _global_std(key: str, config: TransformerConfig) -> float:
    if key.endswith(_SCALED_INIT_SUFFIXES):
        return config.init_method_std / math.sqrt(2.0 * config.num_layers)
    return config.init_method_std


@torch.no_grad()
def layout_invariant_init_(
    model_chunks: Iterable[torch.nn.Module], config: TransformerConfig, seed: int
) -> int:
    """Re-initialise the parameters of ``model_chunks`` in place; returns the tensors written.

    Weights of rank >= 2 get N(0, std) (scaled for the residual output projections), 1-D
    weights (norms) get 1 and biases 0, as Megatron-Core initialises them. Call it on the
    unwrapped models, before DDP and the optimizer are built.

    Args:
        model_chunks: The (virtual pipeline) model chunks of this rank.
        config: The transformer config (``init_method_std``, ``num_layers``).
        seed: The run's seed; the same seed gives the same model in every layout.
    """
    written = 0
    for chunk in model_chunks:
        sharded = chunk.sharded_state_dict(prefix="")
        apply_factories(sharded)  # e.g. SwiGLU fc1 -> separate gate/up global tensors
        for sh in nested_values(sharded):
            if not isinstance(sh, ShardedTensor) or not sh.key.endswith(("weight", "bias")):
                continue  # _extra_state and other non-parameter objects
            if sh.flattened_range is not None:
                raise ValueError(f"{sh.key}: flattened shards cannot be initialised here")
            n = sh.prepend_axis_num
            layer_offset = tuple(sh.global_offset[:n])
            shape = tuple(sh.global_shape[n:])
            offset = tuple(sh.global_offset[n:])
            full = _global_tensor(sh.key, layer_offset, shape, sh.data.dtype, config, seed)
            local = full[
                tuple(slice(o, o + s) for o, s in zip(offset, sh.local_shape, strict=True))
            ]
            sh.data.copy_(local)
            written += 1
    return written


def _global_tensor(
    key: str,
    layer_offset: tuple[int, ...],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    config: TransformerConfig,
    seed: int,
) -> torch.Tensor:
    if key.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) < 2:
        return torch.ones(shape, dtype=dtype)
    # crc32, not hash(): Python's str hash differs between processes.
    tag = f"{seed}|{key}|{','.join(map(str, layer_offset))}".encode()
    gen = torch.Generator().manual_seed(zlib.crc32(tag))
    full = torch.empty(shape, dtype=torch.float32)
    full.normal_(mean=0.0, std=_global_std(key, config), generator=gen)
    return full.to(dtype)
