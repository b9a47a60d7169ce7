"""MeCeFO in Megatron-LM's own training loop (``pretrain_gpt.py``), through ``patches/``.

The patch for each Megatron-LM tag adds a few lines to ``pretrain_gpt.py`` and nothing to
``megatron/``; everything else happens in this package, one module per concern:

* :mod:`.flags`: ``extra_args_provider`` adds ``--mecefo`` and the ``--mecefo-*`` flags, and
  the plugin's start-up checks run as Megatron-LM parses them;
* :mod:`.layer_spec`: the layer spec becomes the MeCeFO (and/or ABFT) spec, and the built
  model is bound to the per-process state;
* :mod:`.checksum_hooks`: ``--mecefo-abft``'s step counting and its log lines;
* :mod:`.training_hooks`: with ``--mecefo``, Megatron-LM's loop runs each iteration's
  takeover plan, re-weights the gradients, reads a failed replica's samples and keeps the
  low-rank bases in the checkpoints; it also times each replica for ``--mecefo-fail-slow``
  and, with ``rebalance``, moves a slow replica's micro-batches.

:class:`MegatronLMIntegration` joins them: one object per process (:func:`install`), whose
:meth:`~MegatronLMIntegration._setup` validates the flags once ``args`` exist and installs
the hooks the flags ask for. Without ``--mecefo`` and ``--mecefo-abft*`` nothing is wrapped
and Megatron-LM runs exactly as unpatched.

The flag functions are re-exported here (``extra_args_provider``, ``check_parsed_args``,
``_validated_config``), where earlier versions defined them.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

from megatron_mecefo.cli import exit_with_config_error
from megatron_mecefo.megatron_lm.checksum_hooks import ChecksumHooks
from megatron_mecefo.megatron_lm.flags import (
    check_parsed_args,
    check_token_ids,
    extra_args_provider,
    fail_slow_config,
    train_iters,
    validated_config,
)
from megatron_mecefo.megatron_lm.layer_spec import LayerSpecHooks
from megatron_mecefo.megatron_lm.training_hooks import TrainingLoopHooks
from megatron_mecefo.takeover.config import FaultToleranceConfig, MecefoConfigError

__all__ = [
    "MegatronLMIntegration",
    "check_parsed_args",
    "current",
    "extra_args_provider",
    "install",
]

_validated_config = validated_config  # the name earlier versions (and tests) import
_train_iters = train_iters


class MegatronLMIntegration(LayerSpecHooks, ChecksumHooks, TrainingLoopHooks):
    """The per-process MeCeFO wiring of one Megatron-LM run; see the module docstring."""

    def __init__(self) -> None:
        self._hooks_installed = False
        self._abft_hooks_installed = False
        self._summary_registered = False
        self._data_checked = False
        self.reset()

    def reset(self) -> None:
        """Forget the model, the controller and the dataset (before ``pretrain()`` is entered
        again in a new world). The wrapped ``megatron.training.training`` names stay: they
        read this object's state at every call."""
        self.config: Optional[FaultToleranceConfig] = None
        self.state: Any = None
        self.chunks: List[Any] = []
        self.controller: Any = None
        self.train_dataset: Any = None
        self.loader_offset = 0
        """``args.consumed_train_samples`` minus the sample offset the training data loader
        was built at: nonzero in a later phase of ``--phase-transition-iterations``, where
        Megatron-LM builds it at ``consumed_train_samples_in_current_phase``."""
        self.abft_config: Any = None
        self.abft: Any = None
        self._abft_open_step: Optional[int] = None
        self.fail_slow_config: Any = None
        self.fail_slow: Any = None
        """The :class:`~megatron_mecefo.failslow.monitor.FailSlowMonitor` of the current
        controller (``--mecefo-fail-slow`` detect or rebalance), built at its first step."""
        self._fail_slow_for: Any = None
        self.recovery: Any = None
        """The Megatron-LM adapter of the recovery session
        (:class:`~megatron_mecefo.megatron_lm.recovery.MegatronLMTrainer`) under the
        supervisor: the original replica layout, the schedule of real failures, the phase
        hooks and the summary's recovery rows come from it."""

    # ------------------------------------------------------------------ set-up
    def _setup(self, args: Any) -> bool:
        """Validate the flags once args exist; returns whether ``--mecefo`` is on."""
        if self.config is not None:
            return self.config.enabled
        from megatron_mecefo.abft.arguments import abft_config_from_args
        from megatron_mecefo.abft.config import AbftConfigError

        warnings: List[str] = []
        try:
            self.config = validated_config(args, warnings)
            self.fail_slow_config = fail_slow_config(args, warnings)
            self.abft_config = abft_config_from_args(
                args, getattr(args, "transformer_impl", None), on_uncorrectable="raise"
            )
        except (MecefoConfigError, AbftConfigError) as err:
            exit_with_config_error(err)
        if int(os.environ.get("RANK", "0")) == 0:
            for line in warnings:
                print(f"WARNING: MeCeFO: {line}", flush=True)
        if self.config.enabled:
            from megatron_mecefo.techniques.state import MecefoState

            self._check_data(args)
            self.state = MecefoState(self.config.techniques)
            self._install_training_hooks()
        if self.abft_config is not None:
            self._install_abft_hooks()
        return self.config.enabled

    def _check_data(self, args: Any) -> None:
        """The training data's token ids against the tokenizer's vocabulary, once per
        process. Up to core_v0.17 the tokenizer is built by now (Megatron-LM builds it before
        the model); where it is not (core_v0.19 calls :func:`install` before ``pretrain()``),
        only a ``NullTokenizer``'s ``--vocab-size`` is known, and other tokenizers' data is
        not checked."""
        if self._data_checked:
            return
        self._data_checked = True
        vocab = _vocab_size(args)
        if vocab is not None:
            check_token_ids(args, vocab)


def _vocab_size(args: Any) -> Optional[int]:
    """The number of token ids of Megatron-LM's tokenizer: the built tokenizer's, else the
    ``--vocab-size`` of a ``NullTokenizer`` (plus its end-of-document id); None if unknown."""
    try:
        from megatron.training import global_vars

        tokenizer = getattr(global_vars, "_GLOBAL_TOKENIZER", None)
    except ImportError:
        tokenizer = None
    if tokenizer is not None:
        return int(tokenizer.vocab_size)
    if getattr(args, "tokenizer_type", None) == "NullTokenizer" and args.vocab_size:
        return int(args.vocab_size) + 1
    return None


_CURRENT: Optional[MegatronLMIntegration] = None
"""The integration :func:`install` made in this process (the recovery wrapper finds it)."""


def current() -> Optional[MegatronLMIntegration]:
    """The integration :func:`install` made in this process, if any."""
    return _CURRENT


def install(args: Any = None, model_cfg: Any = None) -> MegatronLMIntegration:
    """Wire MeCeFO into Megatron-LM's ``pretrain_gpt.py`` (see ``patches/``).

    Megatron-LM <= core_v0.17 (flags parsed inside ``pretrain``): call it with no arguments
    and pass ``integration.wrap_builder(gpt_builder)`` and ``extra_args_provider(...)`` to
    ``pretrain``. core_v0.19 and later: call it with the parsed ``args`` and the
    ``GPTModelConfig`` before ``pretrain(full_config, ...)``.
    """
    global _CURRENT
    integration = _CURRENT = MegatronLMIntegration()
    if args is not None and model_cfg is not None:
        integration.configure_model(args, model_cfg)
    return integration
