"""Low-rank FFN weight gradients: exact dgrad, ``G_W ≈ (G_yᵀ (X V)) Vᵀ``, ``X V`` saved.

``LowRankColumnParallelLinear`` (fc1) and ``LowRankRowParallelLinear`` (fc2) are Megatron-Core's
linears with ``_forward_impl`` overridden: while their layer runs a takeover micro-batch with
low-rank gradients on, the matmul goes through ``LowRankWgradLinear``; otherwise it is the stock
path, bit for bit. Parameters and checkpoint keys are the stock ones.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_mecefo.techniques.lowrank_basis import COLUMN, ROW, compute_basis


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if group is not None else 1


class LowRankWgradLinear(torch.autograd.Function):
    """``y = X Wᵀ + b`` with MeCeFO's low-rank weight gradient, in Megatron's [out, in] layout.

    TP communication matches ``LinearWithGradAccumulationAndAsyncCommunication``: the input is
    all-gathered under sequence parallelism, and the input gradient is all-reduced
    (``allreduce_dgrad``) or reduce-scattered (sequence parallel). For a row-parallel weight,
    ``basis`` holds this rank's rows of V and ``X V`` is summed over the TP group.
    """

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        basis: torch.Tensor,
        basis_is_row_shard: bool,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        tp_group: Optional[dist.ProcessGroup],
    ) -> torch.Tensor:
        if sequence_parallel:
            total_input = input.new_empty(
                (input.shape[0] * _group_size(tp_group),) + input.shape[1:]
            )
            dist.all_gather_into_tensor(total_input, input.contiguous(), group=tp_group)
        else:
            total_input = input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        # The only activation kept for the weight gradient: [tokens, r] instead of [tokens, in].
        xv = total_input.reshape(-1, total_input.shape[-1]) @ basis
        if basis_is_row_shard and _group_size(tp_group) > 1:
            dist.all_reduce(xv, group=tp_group)
        ctx.save_for_backward(weight, xv, basis)
        ctx.input_shape = input.shape
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.tp_group = tp_group
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        weight, xv, basis = ctx.saved_tensors
        tp_group = ctx.tp_group
        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:
            handle = dist.all_reduce(grad_input, group=tp_group, async_op=True)
        elif ctx.sequence_parallel:
            sub_grad_input = grad_input.new_empty(ctx.input_shape)
            handle = dist.reduce_scatter_tensor(
                sub_grad_input, grad_input.contiguous(), group=tp_group, async_op=True
            )
            grad_input = sub_grad_input

        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        factor = grad_2d.t() @ xv  # [out, r]: the m×r factor of the weight gradient
        main_grad = getattr(weight, "main_grad", None)
        if ctx.gradient_accumulation_fusion and main_grad is not None:
            # Megatron's fused path: accumulate into the fp32 main_grad here and hand autograd
            # a dummy, flagged so the DDP hook does not add it again.
            main_grad.addmm_(factor.to(main_grad.dtype), basis.t().to(main_grad.dtype))
            if hasattr(weight, "grad_added_to_main_grad"):
                if getattr(weight, "zero_out_wgrad", False):
                    grad_weight = torch.zeros_like(main_grad, dtype=grad_output.dtype)
                else:
                    grad_weight = torch.empty_like(main_grad, dtype=grad_output.dtype)
                weight.grad_added_to_main_grad = True
            else:
                grad_weight = None
        else:
            grad_weight = factor @ basis.t()
        grad_bias = grad_2d.sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


class _LowRankMixin:
    """Shared by both linears: the takeover switch, the basis and its refresh."""

    mecefo_parallel_mode: str = COLUMN

    def _mecefo_init(self) -> None:
        self.mecefo_state = None
        """The ``MecefoState`` bound by ``apply_mecefo``; None means always exact."""
        self.mecefo_name = ""
        self.mecefo_lowrank_active = False
        self.mecefo_basis: Optional[torch.Tensor] = None
        self.mecefo_basis_step: Optional[int] = None

    @contextlib.contextmanager
    def lowrank(self, active: bool) -> Iterator[None]:
        """Within the block, ``forward`` uses the low-rank weight gradient if ``active``."""
        previous, self.mecefo_lowrank_active = self.mecefo_lowrank_active, active
        try:
            yield
        finally:
            self.mecefo_lowrank_active = previous

    def refresh_basis_if_stale(self) -> torch.Tensor:
        """V for this step: recomputed on first use and every τ steps (a TP collective)."""
        state = self.mecefo_state
        if self.mecefo_basis is None or state.basis_is_stale(self.mecefo_basis_step):
            self.mecefo_basis = compute_basis(
                self.weight,
                self.mecefo_parallel_mode,
                state.config,
                self.tp_group,
                seed_offset=max(state.step, 0),
            )
            self.mecefo_basis_step = state.step
            state.basis_refreshes.append((state.step, self.mecefo_name))
        return self.mecefo_basis

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not (self.mecefo_lowrank_active and self.training and weight.requires_grad):
            return super()._forward_impl(input, weight, *args, **kwargs)
        if args:
            raise TypeError(
                "megatron-core passed _forward_impl positional arguments; expected keywords"
            )
        if kwargs.get("grad_output_buffer") is not None:
            raise RuntimeError("low-rank FFN weight gradients do not support deferred wgrad")
        if (kwargs.get("gtp_remat_size") or 1) > 1:
            # megatron-core >= 0.19: a GTP-sharded weight is re-materialised inside the
            # stock autograd Function; the low-rank one would see a partial weight.
            raise RuntimeError(
                f"low-rank FFN weight gradients do not support GTP weight re-materialisation "
                f"(gtp_remat_size={kwargs['gtp_remat_size']}); drop "
                "--tensor-parallel-num-weight-shards or pass --no-mecefo-lowrank-ffn"
            )
        basis = self.refresh_basis_if_stale()
        return LowRankWgradLinear.apply(
            input,
            weight,
            kwargs.get("bias"),
            basis,
            self.mecefo_parallel_mode == ROW,
            bool(kwargs.get("gradient_accumulation_fusion", False)),
            bool(kwargs.get("allreduce_dgrad", False)),
            bool(kwargs.get("sequence_parallel", False)),
            kwargs.get("tp_group") or self.tp_group,
        )


class LowRankColumnParallelLinear(_LowRankMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` (fc1, gate and up) with MeCeFO's low-rank weight gradient."""

    mecefo_parallel_mode = COLUMN

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mecefo_init()


class LowRankRowParallelLinear(_LowRankMixin, RowParallelLinear):
    """``RowParallelLinear`` (fc2) with MeCeFO's low-rank weight gradient."""

    mecefo_parallel_mode = ROW

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mecefo_init()
