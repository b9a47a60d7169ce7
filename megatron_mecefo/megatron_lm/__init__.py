"""MeCeFO in Megatron-LM: the ``--mecefo`` flags and the wiring into ``pretrain_gpt.py``.

:mod:`.arguments` adds ``--mecefo`` and ``--mecefo-*`` to any argparse parser (Megatron-LM's
``extra_args_provider`` or the example trainer's), turns them into a
:class:`~.arguments.FaultToleranceConfig` and checks them at start-up. :mod:`.integration`
(``install()``, ``extra_args_provider()``) is what the small patches in ``patches/`` call: it
swaps in the MeCeFO layer spec and wraps three names of ``megatron.training.training`` so that
Megatron-LM's own loop runs each iteration's takeover plan.

Uses: :mod:`megatron_mecefo.techniques` and :mod:`megatron_mecefo.takeover`. Used by:
Megatron-LM's patched ``pretrain_gpt.py`` and the example trainer (its flags). Importing it
does not import torch.
"""

from megatron_mecefo.megatron_lm.integration import (
    MegatronLMIntegration,
    extra_args_provider,
    install,
)

__all__ = ["MegatronLMIntegration", "extra_args_provider", "install"]
