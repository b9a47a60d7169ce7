"""Checked QKV and output projections: megatron-core's column/row-parallel linears.

The check sits in ``_forward_impl``, around the GEMM itself: for the row-parallel output
projection that is *before* the TP all-reduce (or SP reduce-scatter), so each TP rank checks
its own partial product, for its own heads. The token-sum checksum of ``Y = X·Wᵀ + b`` is
``t(Y) = t(X)·Wᵀ + (Σ1, Σpos)·b``, per sample. ``t(X)`` is

* for the output projection, the context checksum the core attention carried over
  (``t(CL) = t(softmax)·V``), when its output reaches the projection unchanged;
* otherwise encoded here from X (two weighted sums over the tokens: cheap next to the GEMM);
* under sequence parallelism (QKV), encoded from this rank's sequence shard with global
  positions and summed over the TP group: one all-reduce of ``[2·b·h + b]`` values. The QKV
  recompute all-gathers the input again, so "recompute needed" is agreed over the TP group.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_mecefo.abft.checksum import compute_dtype, is_half, position_sums, weights
from megatron_mecefo.abft.guard import Direction, inject_only, protect


class _AbftLinearMixin:
    """Adds the check to ``_forward_impl``; ``apply_abft`` sets the three attributes."""

    abft_state: Any = None
    abft_layer: int = 0
    abft_op: str = ""

    def _forward_impl(self, input, weight, *args: Any, **kwargs: Any):  # noqa: A002
        base = super()._forward_impl  # type: ignore[misc]
        out = base(input, weight, *args, **kwargs)
        state = self.abft_state
        if state is None:
            return out
        if not state.checks(self.abft_op):
            if state.injector is not None:
                lines = out.view(out.shape[0], out.shape[1], -1).permute(1, 0, 2)
                inject_only(state, self.abft_layer, self.abft_op, lines,
                            lambda b, t, j: (t, b, j), training=self.training)  # fmt: skip
            return out
        sp = bool(kwargs.get("sequence_parallel", False))
        _check_linear(
            self, state, input, weight, kwargs.get("bias"), sp, out,
            lambda: base(input, weight, *args, **kwargs),
        )  # fmt: skip
        return out


def _tp_group(module: Any) -> Any:
    group = getattr(module, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
    return group


def _check_linear(
    module: Any,
    state: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    sequence_parallel: bool,
    out: torch.Tensor,
    recompute: Any,
) -> None:
    cfg = state.config
    count = 2 if cfg.mode == "correct" else 1
    dt = compute_dtype(out)
    seq, batch = out.shape[0], out.shape[1]
    layer, op = module.abft_layer, module.abft_op
    lines = out.view(seq, batch, -1).permute(1, 0, 2)  # [b, s, out]: lines over the tokens
    group = _tp_group(module) if sequence_parallel else None

    def direction() -> Direction:
        passed = state.handoff.pop(layer, None) if op == "proj" else None
        x2 = x.reshape(x.shape[0], batch, -1)
        if passed is not None and passed[0] is x and passed[1].shape[0] == count:
            tx = passed[1]
            xnorm = x2.to(dt).norm(dim=-1).sum(0)
        else:
            offset = 0
            if group is not None:
                offset = torch.distributed.get_rank(group) * x2.shape[0]
            w = weights(x2.shape[0], count, offset, dt, x.device)
            tx = (w @ x2.reshape(x2.shape[0], -1).to(dt)).view(count, batch, -1)
            xnorm = x2.to(dt).norm(dim=-1).sum(0)
            if group is not None:  # the shards' sums are the full sequence's sums
                flat = torch.cat([tx.reshape(-1), xnorm])
                torch.distributed.all_reduce(flat, group=group)
                tx, xnorm = flat[: tx.numel()].view_as(tx), flat[tx.numel() :]
        w_dt = weight.to(dt)
        expected = tx @ w_dt.t()  # [k, b, out]
        bound = xnorm[:, None] * w_dt.norm(dim=1)[None, :]
        if bias is not None:
            sums = position_sums(seq)
            b_dt = bias.to(dt)
            for k in range(count):
                expected[k] += sums[k] * b_dt
            bound = bound + seq * b_dt.abs()[None, :]
        ws = weights(seq, count, 0, dt, out.device)

        def actual() -> torch.Tensor:
            return (ws @ out.reshape(seq, -1).to(dt)).view(count, batch, -1).permute(1, 0, 2)

        return Direction(lines, expected.permute(1, 0, 2), actual, bound, lambda b, t, j: (t, b, j))

    def any_rank(need: bool) -> bool:
        flag = torch.tensor([float(need)], device=out.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(flag.item())

    protect(
        state, layer, op, out, [direction], recompute, cfg.rel_for(is_half(out)),
        training=module.training, any_rank=any_rank if group is not None else None,
    )  # fmt: skip


class AbftColumnParallelLinear(_AbftLinearMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose GEMM output is checked (the QKV projection)."""


class AbftRowParallelLinear(_AbftLinearMixin, RowParallelLinear):
    """``RowParallelLinear`` whose partial GEMM output is checked before the TP reduction."""
