"""Checked core attention: megatron-core's unfused ``DotProductAttention`` with ABFT.

The forward is the stock one, op for op (bit-identical output when nothing is wrong), with
two checks added:

* **scores** ``AS = α·Q·Kᵀ`` (``[b·np, sq, sk]``): token-sum ``t(AS) = α·t(Q)·Kᵀ``, with
  ``t(Q)`` re-encoded here because RoPE and the q/k norms (position-dependent and nonlinear)
  sit between the QKV GEMM and this one; second direction ``f(AS) = α·Q·t(K)ᵀ``;
* **context** ``CL = P·V`` (``P`` = softmax output after dropout): token-sum ``t(CL) =
  t(P)·V`` with ``t(P)`` re-encoded after the softmax (nonlinear: nothing to carry through
  it); second direction ``f(CL) = P·f(V)``, where ``f(V)`` is the value tensor's feature
  checksum as the QKV GEMM produced (and checked) it — nothing touches V in between.

``t(CL)`` is then handed to the output projection as its operand checksum (ATTNChecker's
``CL_rowchk``), so that GEMM needs no encoding pass of its own. Faults *inside* the softmax
(or the mask, the dropout, RoPE, the q/k norms) are not covered: the checksums after them
are encoded from their outputs, as in ATTNChecker.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_mecefo.abft.checksum import compute_dtype, is_half, weights
from megatron_mecefo.abft.guard import Direction, inject_only, protect


class AbftDotProductAttention(DotProductAttention):
    """``DotProductAttention`` with checked ``Q·Kᵀ`` and ``softmax·V``; see the module doc."""

    abft_state: Any = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        state = self.abft_state
        active = state is not None and (
            state.injector is not None or any(state.checks(op) for op in ("scores", "context"))
        )
        if not active or packed_seq_params is not None or attention_bias is not None:
            # The stock path (which also rejects packed sequences and attention bias).
            return super().forward(
                query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params,
            )  # fmt: skip
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        b, np_, sq, sk = query.size(1), query.size(2), query.size(0), key.size(0)
        heads = b * np_
        query = query.reshape(sq, heads, -1)
        key = key.view(sk, heads, -1)
        buffer = parallel_state.get_global_memory_buffer().get_tensor(
            (heads, sq, sk), query.dtype, "mpu"
        )
        q_t, k_t = query.transpose(0, 1), key.transpose(0, 1)  # [heads, s, hn]
        alpha = self.softmax_scale

        def scores_gemm() -> torch.Tensor:
            return torch.baddbmm(buffer, q_t, k_t.transpose(1, 2), beta=0.0, alpha=alpha)

        scores = scores_gemm()
        if state.checks("scores"):
            self._check_scores(state, scores, q_t, k_t, scores_gemm)
        else:
            inject_only(state, self.layer_number, "scores", scores, lambda h, i, j: (h, i, j),
                        causal=True, training=self.training)  # fmt: skip

        probs = self.scale_mask_softmax(
            scores.view(b, np_, sq, sk), attention_mask, self.softmax_offset
        )
        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        else:
            probs = self.attention_dropout(probs)

        out_size = (value.size(1), value.size(2), sq, value.size(3))
        value = value.view(value.size(0), heads, -1)
        probs = probs.view(heads, sq, -1)
        v_t = value.transpose(0, 1)  # [heads, sk, hn]

        def context_gemm() -> torch.Tensor:
            return torch.bmm(probs, v_t)

        context = context_gemm()
        carried = None
        if state.checks("context"):
            carried = self._check_context(state, context, probs, v_t, context_gemm)
        else:
            inject_only(state, self.layer_number, "context", context, lambda h, i, d: (h, i, d),
                        training=self.training)  # fmt: skip

        context = context.view(*out_size).permute(2, 0, 1, 3).contiguous()
        context = context.view(*context.size()[:-2], self.hidden_size_per_partition)
        if carried is not None and state.checks("proj"):
            # t(CL) in the projection input's layout [k, b, np·hn]: its operand checksum.
            k = carried.shape[1]
            tx = carried.view(b, np_, k, -1).permute(2, 0, 1, 3).reshape(k, b, -1)
            state.handoff[self.layer_number] = (context, tx)
        return context

    # ------------------------------------------------------------------ checks
    def _count(self, state: Any) -> int:
        return 2 if state.config.mode == "correct" else 1

    def _check_scores(self, state, scores, q_t, k_t, recompute) -> None:
        count, dt, alpha = self._count(state), compute_dtype(scores), self.softmax_scale
        heads, sq, sk = scores.shape
        q_norm, k_norm = q_t.to(dt).norm(dim=-1), k_t.to(dt).norm(dim=-1)  # [heads, s]

        def token_direction() -> Direction:
            w = weights(sq, count, 0, dt, scores.device)
            expected = alpha * torch.bmm(torch.matmul(w, q_t.to(dt)), k_t.transpose(1, 2).to(dt))
            bound = alpha * q_norm.sum(-1, keepdim=True) * k_norm
            return Direction(scores, expected, lambda: torch.matmul(w, scores.to(dt)), bound,
                             lambda h, i, j: (h, i, j))  # fmt: skip

        def feature_direction() -> Direction:
            w = weights(sk, 2, 0, dt, scores.device)
            expected = alpha * torch.bmm(torch.matmul(w, k_t.to(dt)), q_t.transpose(1, 2).to(dt))
            bound = alpha * k_norm.sum(-1, keepdim=True) * q_norm
            lines = scores.transpose(1, 2)
            return Direction(lines, expected, lambda: torch.matmul(w, lines.to(dt)), bound,
                             lambda h, j, i: (h, i, j))  # fmt: skip

        protect(
            state, self.layer_number, "scores", scores, [token_direction, feature_direction],
            recompute, state.config.rel_for(is_half(scores)), causal=True,
            training=self.training,
        )  # fmt: skip

    def _check_context(self, state, context, probs, v_t, recompute) -> torch.Tensor:
        count, dt = self._count(state), compute_dtype(context)
        heads, sq, hn = context.shape
        sk = probs.shape[-1]
        carried = {}

        def token_direction() -> Direction:
            w = weights(sq, count, 0, dt, context.device)
            t_probs = torch.matmul(w, probs.to(dt))  # re-encoded after the softmax
            expected = torch.bmm(t_probs, v_t.to(dt))
            carried["t"] = expected
            # |P| = P: the column sums of P bound the lines' sums of |P|·|V|.
            bound = torch.bmm(t_probs[:, :1], v_t.to(dt).abs()).squeeze(1)
            return Direction(context, expected, lambda: torch.matmul(w, context.to(dt)), bound,
                             lambda h, i, d: (h, i, d))  # fmt: skip

        def feature_direction() -> Direction:
            w = weights(hn, 2, 0, dt, context.device)
            f_v = torch.matmul(v_t.to(dt), w.t())  # f(V): [heads, sk, 2]
            expected = torch.bmm(probs.to(dt), f_v).transpose(1, 2)  # [heads, 2, sq]
            bound = torch.bmm(probs.to(dt), v_t.to(dt).abs().sum(-1, keepdim=True)).squeeze(-1)
            lines = context.transpose(1, 2)  # [heads, hn, sq]
            return Direction(lines, expected, lambda: torch.matmul(w, lines.to(dt)), bound,
                             lambda h, d, i: (h, i, d))  # fmt: skip

        del sk
        protect(
            state, self.layer_number, "context", context, [token_direction, feature_direction],
            recompute, state.config.rel_for(is_half(context)), training=self.training,
        )  # fmt: skip
        return carried["t"]
