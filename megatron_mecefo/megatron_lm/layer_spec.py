"""The layer spec of a Megatron-LM run: the MeCeFO and/or attention-checksum (ABFT) rewrite.

:class:`LayerSpecHooks` is the part of
:class:`~megatron_mecefo.megatron_lm.integration.MegatronLMIntegration` that swaps the spec
and binds the built model: up to core_v0.17 through ``wrap_builder(gpt_builder)`` (Megatron-LM
builds the model through ``model_provider``), from core_v0.19 on through the model config's
``transformer_layer_spec`` and ``post_wrap_hooks`` (:meth:`LayerSpecHooks.configure_model`).
A ``--spec`` given by the user is kept, and must be a MeCeFO (ABFT) spec. The built chunks are
bound to the per-process :class:`~megatron_mecefo.techniques.state.MecefoState` (``--mecefo``)
and :class:`~megatron_mecefo.abft.state.AbftState` (``--mecefo-abft``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional

from megatron_mecefo.cli import exit_with_config_error

__all__ = ["LayerSpecHooks"]


class LayerSpecHooks:
    """The spec rewrite and the model binding; the state is the integration's (its
    ``config``, ``abft_config``, ``state``, ``abft`` and ``chunks``, and its ``_setup``)."""

    config: Any
    abft_config: Any
    state: Any
    abft: Any
    chunks: List[Any]
    _setup: Callable[[Any], bool]
    """Validates the flags once args exist; returns whether ``--mecefo`` is on."""

    def _rewrite_spec(self, spec: Any) -> Any:
        """The MeCeFO and/or ABFT rewrite of a stock layer spec, as the flags ask."""
        if self.config.enabled:
            from megatron_mecefo.techniques.specs import mecefo_spec

            spec = mecefo_spec(spec, lowrank=self.config.techniques.lowrank_ffn)
        if self.abft_config is not None:
            from megatron_mecefo.abft.spec import abft_spec

            spec = abft_spec(spec)
        return spec

    def layer_spec(self, config: Any, vp_stage: Optional[int] = None) -> Any:
        """The callable spec for core_v0.19 (``model_cfg.transformer_layer_spec``)."""
        if self.config.enabled:
            from megatron_mecefo.techniques.specs import mecefo_layer_spec

            spec = mecefo_layer_spec(config, vp_stage)
            return spec if self.abft_config is None else _abft(spec)
        try:
            from megatron.training.models.gpt import default_layer_spec
        except ImportError:
            from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec

            return self._rewrite_spec(gpt_decoder_spec(config, "local", vp_stage))
        return self._rewrite_spec(default_layer_spec(config, vp_stage))

    def wrap_builder(self, gpt_builder: Callable) -> Callable:
        """Megatron-LM <= core_v0.17: ``gpt_builder`` building the MeCeFO spec with --mecefo."""

        @functools.wraps(gpt_builder)
        def builder(args: Any, pre_process: bool, post_process: bool, *a: Any, **kw: Any) -> Any:
            if not self._setup(args) and self.abft_config is None:
                return gpt_builder(args, pre_process, post_process, *a, **kw)
            namespace = gpt_builder.__globals__
            original = namespace.get("_get_transformer_layer_spec")
            if original is not None and args.spec is None:
                namespace["_get_transformer_layer_spec"] = lambda *s, **k: self._rewrite_spec(
                    original(*s, **k)
                )
            try:
                model = gpt_builder(args, pre_process, post_process, *a, **kw)
            finally:
                if original is not None:
                    namespace["_get_transformer_layer_spec"] = original
            self._bind([model])
            return model

        return builder

    def configure_model(self, args: Any, model_cfg: Any) -> None:
        """Megatron-LM >= core_v0.19: set the spec and the post-wrap hook on ``model_cfg``."""
        if not self._setup(args) and self.abft_config is None:
            return
        if getattr(args, "spec", None) is None:
            model_cfg.transformer_layer_spec = self.layer_spec
        model_cfg.post_wrap_hooks.append(self._post_wrap)

    def _post_wrap(self, model: List[Any]) -> List[Any]:
        self._bind(model)
        return model

    def _bind(self, chunks: List[Any]) -> None:
        if self.config.enabled:
            from megatron_mecefo.techniques.apply import apply_mecefo

            try:
                apply_mecefo(chunks, self.state)
            except ValueError as err:
                exit_with_config_error(
                    f"--mecefo: {err} (with --spec, pass a MeCeFO spec such as "
                    "megatron_mecefo.techniques.specs mecefo_layer_spec)"
                )
        if self.abft_config is not None:
            import torch

            from megatron_mecefo.abft import AbftState, apply_abft

            if self.abft is None:
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
                self.abft = AbftState(self.abft_config, rank)
            try:
                apply_abft(chunks, self.abft)
            except ValueError as err:
                exit_with_config_error(f"--mecefo-abft: {err} (a --spec must be an ABFT spec)")
        self.chunks.extend(chunks)


def _abft(spec: Any) -> Any:
    from megatron_mecefo.abft.spec import abft_spec

    return abft_spec(spec)
