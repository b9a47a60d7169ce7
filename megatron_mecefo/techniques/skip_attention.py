"""Skip-connection: the attention branch runs forward exactly, with no backward at all.

MeCeFO (arXiv 2510.16415 §3) drops the attention branch from a takeover micro-batch's backward:
``h = x + Attn(Norm(x))`` keeps its exact value, but ``∂L/∂x = ∂L/∂h`` through the residual
alone. ``AttentionBranchWithoutBackward`` runs the stock branch (input norm, self-attention,
bias-dropout-add) inside an autograd Function, where grad mode is off, so nothing in it is
saved for backward: no QKV, no softmax statistics, no norm input. Its backward passes the
gradient straight through and hands every MHA-group parameter a zero gradient, so their
gradient-accumulation hooks still fire once per micro-batch and Megatron DDP's
``overlap_grad_reduce`` bookkeeping (golden per-parameter counts) holds.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple

import torch


class AttentionBranchWithoutBackward(torch.autograd.Function):
    """``h = run(x)`` forward; ``∂h/∂x = I`` and zero parameter gradients backward."""

    @staticmethod
    def forward(
        ctx, run: Callable[[torch.Tensor], torch.Tensor], hidden_states: torch.Tensor, *params
    ) -> torch.Tensor:
        # Grad mode is off inside Function.forward: run() records no graph.
        ctx.param_meta = [(p.shape, p.dtype, p.device) for p in params]
        return run(hidden_states)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> Tuple[Any, ...]:
        zeros = [
            torch.zeros(shape, dtype=dtype, device=device)
            for shape, dtype, device in ctx.param_meta
        ]
        return (None, grad_output, *zeros)


def run_attention_branch_without_backward(
    run: Callable[[torch.Tensor], Tuple[torch.Tensor, Any]],
    hidden_states: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
) -> Tuple[torch.Tensor, Any]:
    """Run ``run(hidden_states) -> (hidden_states, context)`` as a skip-connection branch.

    Args:
        run: The stock attention sub-block (norm, attention, bias-dropout-add with residual).
        hidden_states: The layer input ``x``.
        params: The MHA group: every parameter used inside ``run``.

    Returns:
        ``(h, context)`` with ``h`` bit-identical to ``run``'s, differentiable only through
        the residual.
    """
    extra = []

    def run_hidden(x: torch.Tensor) -> torch.Tensor:
        output, context = run(x)
        extra.append(context)
        return output

    grad_params = [p for p in params if p.requires_grad]
    output = AttentionBranchWithoutBackward.apply(run_hidden, hidden_states, *grad_params)
    return output, extra[0]
