"""FFN recomputation: keep only the FFN block input; recompute norm and MLP in backward.

MeCeFO (arXiv 2510.16415 §4) stores, for a takeover micro-batch, just the residual stream
``h`` entering the FFN block. This is Megatron-Core's own ``tensor_parallel.checkpoint``
(RNG-tracker aware) around the pre-MLP norm and the MLP, switched per micro-batch.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch
from megatron.core import tensor_parallel


def run_ffn(
    ffn: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]],
    hidden_states: torch.Tensor,
    recompute: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``ffn(hidden_states)``, checkpointed so only ``hidden_states`` is saved if ``recompute``.

    ``ffn`` must decide everything (e.g. low-rank or not) from its closure, not from state read
    at call time: the recompute runs it again during backward, possibly after other
    micro-batches' forwards.
    """
    if not recompute:
        return ffn(hidden_states)

    def ffn_without_parameter_outputs(h: torch.Tensor):
        output, bias = ffn(h)
        # With skip_bias_add, fc2 hands back its bias Parameter itself. A checkpoint Function
        # must not return a leaf Parameter (autograd would re-parent it and the recompute would
        # recurse), so return a copy whose backward reaches the bias.
        if isinstance(bias, torch.nn.Parameter):
            bias = bias.clone()
        return output, bias

    return tensor_parallel.checkpoint(ffn_without_parameter_outputs, False, hidden_states)
