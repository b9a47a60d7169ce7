"""MeCeFO in Megatron-LM: the ``--mecefo`` flags and the wiring into ``pretrain_gpt.py``.

:mod:`.arguments` adds ``--mecefo`` and ``--mecefo-*`` to any argparse parser (Megatron-LM's
``extra_args_provider`` or the example trainer's), turns them into a
:class:`~.arguments.FaultToleranceConfig` and checks them at start-up. :mod:`.integration`
(``install()``, ``extra_args_provider()``) is what the small patches in ``patches/`` call: it
swaps in the MeCeFO layer spec and wraps three names of ``megatron.training.training`` so that
Megatron-LM's own loop runs each iteration's takeover plan.

Under MeCeFO's recovery supervisor, :mod:`.recovery` re-enters ``pretrain()`` in-process after a
rank's death, with the state in memory (the patch's ``maybe_wrap_for_inprocess_restart``).

Uses: :mod:`megatron_mecefo.techniques`, :mod:`megatron_mecefo.takeover` and
:mod:`megatron_mecefo.recovery`. Used by:
Megatron-LM's patched ``pretrain_gpt.py`` and the example trainer (its flags). Importing it
does not import torch.
"""

from megatron_mecefo.megatron_lm.integration import (
    MegatronLMIntegration,
    extra_args_provider,
    install,
)


def maybe_wrap_for_inprocess_restart(pretrain):  # type: ignore[no-untyped-def]
    """Megatron-LM's ``maybe_wrap_for_inprocess_restart``, or MeCeFO's in-process recovery
    under its supervisor (:func:`.recovery.maybe_wrap_for_inprocess_restart`)."""
    from megatron_mecefo.megatron_lm.recovery import maybe_wrap_for_inprocess_restart as wrap

    return wrap(pretrain)


__all__ = [
    "MegatronLMIntegration",
    "extra_args_provider",
    "install",
    "maybe_wrap_for_inprocess_restart",
]
