"""MeCeFO in Megatron-LM: the ``--mecefo`` flags and the wiring into ``pretrain_gpt.py``.

What the patches in ``patches/`` call: :func:`extra_args_provider` (the flags),
:func:`install` (the :class:`MegatronLMIntegration` of the process) and
:func:`maybe_wrap_for_inprocess_restart`. One module per concern:

* :mod:`.flags`: adds ``--mecefo`` and ``--mecefo-*`` to Megatron-LM's parser and runs the
  plugin's start-up checks as it parses them (also the training data's token ids);
* :mod:`.layer_spec`: swaps in the MeCeFO (and/or ABFT) layer spec and binds the built model;
* :mod:`.checksum_hooks`: ``--mecefo-abft``'s step counting and log lines;
* :mod:`.training_hooks`: wraps five names of ``megatron.training.training`` so that
  Megatron-LM's own loop runs each iteration's takeover plan, and reads a failed replica's
  samples;
* :mod:`.basis_checkpoint`: the low-rank bases in Megatron-LM's checkpoints;
* :mod:`.integration`: :class:`MegatronLMIntegration`, which joins them, and :func:`install`;
* :mod:`.recovery`: under MeCeFO's recovery supervisor, re-enters ``pretrain()`` in-process
  after a rank's death, with the state in memory;
* :mod:`.patch_check`: says when a ``pretrain_gpt.py`` lacks the patch (``python -m
  megatron_mecefo.megatron_lm.patch_check DIR``);
* :mod:`.arguments`: where the flags used to live (re-exports).

Uses: :mod:`megatron_mecefo.techniques`, :mod:`megatron_mecefo.takeover`,
:mod:`megatron_mecefo.abft`, :mod:`megatron_mecefo.snapshot` and
:mod:`megatron_mecefo.recovery`. Used by: Megatron-LM's patched ``pretrain_gpt.py`` and
``patches/run_megatron_lm_cpu.py``. Importing it does not import torch.
"""

from typing import Any, Callable, Tuple

from megatron_mecefo.megatron_lm.flags import extra_args_provider
from megatron_mecefo.megatron_lm.integration import MegatronLMIntegration, install


def maybe_wrap_for_inprocess_restart(pretrain: Callable) -> Tuple[Callable, Any]:
    """Megatron-LM's ``maybe_wrap_for_inprocess_restart``, or MeCeFO's in-process recovery
    under its supervisor (:func:`.recovery.maybe_wrap_for_inprocess_restart`): the patch calls
    it at Megatron-LM's own call site, ``pretrain, store = (mecefo or
    inprocess_restart).maybe_wrap_for_inprocess_restart(pretrain)``.

    Returns:
        ``(pretrain, store)``, as Megatron-LM's function does.
    """
    from megatron_mecefo.megatron_lm.recovery import maybe_wrap_for_inprocess_restart as wrap

    return wrap(pretrain)


__all__ = [
    "MegatronLMIntegration",
    "extra_args_provider",
    "install",
    "maybe_wrap_for_inprocess_restart",
]
