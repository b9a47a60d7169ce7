"""``MecefoTransformerLayer``: Megatron-Core's ``TransformerLayer`` with a takeover path.

An exact micro-batch runs the stock layer unchanged. A takeover micro-batch runs the techniques
that ``MecefoConfig`` switches on: the attention branch without backward (``skip_attention``),
the FFN block checkpointed at its input (``recompute_ffn``) and low-rank FFN weight gradients
(``lowrank_ffn``). The mode is read once per layer call from the bound ``MecefoState`` and
carried in closures, because recomputation reruns them after other micro-batches' forwards.
"""

from __future__ import annotations

import contextlib
from typing import Any, List, Optional

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_mecefo.techniques.ffn_recompute import run_ffn
from megatron_mecefo.techniques.skip_attention import run_attention_branch_without_backward
from megatron_mecefo.techniques.state import MicrobatchMode

# Sub-modules run inside TransformerLayer._forward_attention: the MHA group of the layer.
MHA_GROUP_MODULES = (
    "input_layernorm",
    "self_attention",
    "pre_cross_attn_layernorm",
    "cross_attention",
)


def _unsupported(config: Any, is_moe_layer: bool) -> Optional[str]:
    if getattr(config, "cuda_graph_impl", "none") != "none" or getattr(
        config, "enable_cuda_graph", False
    ):
        return (
            f"cuda_graph_impl={config.cuda_graph_impl!r} (--cuda-graph-impl): a captured graph "
            "cannot switch between exact and takeover micro-batches; turn CUDA graphs off"
        )
    if getattr(config, "fine_grained_activation_offloading", False):
        return (
            "fine_grained_activation_offloading=True: its norm offload hooks are not wired into "
            "the takeover path; turn it off"
        )
    if config.recompute_granularity == "selective" and "layernorm" in (
        config.recompute_modules or []
    ):
        return (
            "recompute_modules contains 'layernorm' (--recompute-modules): FFN recomputation "
            "already recomputes the norms of takeover micro-batches; drop 'layernorm'"
        )
    if getattr(config, "fp32_residual_connection", False):
        return "fp32_residual_connection=True is not supported; turn it off"
    if getattr(config, "delay_wgrad_compute", False):
        return "delay_wgrad_compute=True is not supported; turn it off"
    if is_moe_layer:
        return (
            "MoE layers are not supported: the takeover techniques need a dense MLP; use "
            "a dense model (num_moe_experts=None)"
        )
    return None


class MecefoTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` that runs takeover micro-batches the MeCeFO way.

    Built through a MeCeFO layer spec (``megatron_mecefo.techniques.specs``); bound to a
    ``MecefoState`` by ``apply_mecefo``. Unbound, or in eval mode, it is the stock layer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        problem = _unsupported(self.config, self.is_moe_layer)
        if problem is not None:
            raise ValueError(f"MeCeFO layer {self.layer_number}: {problem}")
        self.mecefo_state = None
        self._mecefo_takeover = False
        self._mecefo_mha_params: Optional[List[torch.nn.Parameter]] = None

    def mha_group_parameters(self) -> List[torch.nn.Parameter]:
        """QKV, output projection, input norm, q/k norms and attention biases of this layer."""
        if self._mecefo_mha_params is None:
            seen, params = set(), []
            for name in MHA_GROUP_MODULES:
                module = getattr(self, name, None)
                if not isinstance(module, torch.nn.Module):
                    continue
                for p in module.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            self._mecefo_mha_params = params
        return self._mecefo_mha_params

    def _current_takeover(self) -> bool:
        state = self.mecefo_state
        if state is None or not self.training or state.current_mode is not MicrobatchMode.TAKEOVER:
            return False
        if self.config.recompute_granularity == "full" and state.mixes_modes:
            raise RuntimeError(
                "--recompute-granularity full reruns whole layers during backward, after other "
                "micro-batches' forwards, so a step must not mix exact and takeover "
                f"micro-batches (step {state.step}: {[m.value for m in state.modes]}); use "
                "selective recompute or a policy whose replicas run one mode per step"
            )
        return state.config.any_technique

    def forward(self, *args: Any, **kwargs: Any):
        self._mecefo_takeover = self._current_takeover()
        return super().forward(*args, **kwargs)

    def _forward_attention(self, *args: Any, **kwargs: Any):
        if not (self._mecefo_takeover and self.mecefo_state.config.skip_attention):
            return super()._forward_attention(*args, **kwargs)
        if args:
            hidden_states, args = args[0], args[1:]
        else:
            hidden_states = kwargs.pop("hidden_states")
        stock = super()._forward_attention
        return run_attention_branch_without_backward(
            lambda x: stock(x, *args, **kwargs), hidden_states, self.mha_group_parameters()
        )

    def _forward_mlp(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        config = self.mecefo_state.config if self._mecefo_takeover else None
        if config is None or not (config.recompute_ffn or config.lowrank_ffn):
            return super()._forward_mlp(hidden_states, *args, **kwargs)
        padding_mask = kwargs.get("padding_mask")
        lowrank = config.lowrank_ffn
        mlp = self.mlp

        def ffn(h: torch.Tensor):
            with contextlib.ExitStack() as stack:
                if lowrank:
                    stack.enter_context(mlp.linear_fc1.lowrank(True))
                    stack.enter_context(mlp.linear_fc2.lowrank(True))
                return mlp(self.pre_mlp_layernorm(h), padding_mask=padding_mask)

        output_with_bias = run_ffn(ffn, hidden_states, config.recompute_ffn)
        return self._forward_post_mlp(output_with_bias, hidden_states)
