"""``--mecefo-abft*`` through the Megatron-LM extra-args provider (no Megatron-LM needed)."""

from __future__ import annotations

import argparse

import pytest

from megatron_mecefo.abft.arguments import abft_config_from_args
from megatron_mecefo.abft.config import AbftConfigError
from megatron_mecefo.megatron_lm import extra_args_provider


def _args(argv):
    parser = extra_args_provider()(argparse.ArgumentParser())
    args = parser.parse_args(argv)
    args.seed = 5
    return args


def test_flags_reach_megatron_lm_and_raise_through_the_rerun_machine():
    cfg = abft_config_from_args(
        _args(["--mecefo-abft", "--mecefo-abft-policy", "adaptive:4"]), "local", "raise"
    )
    assert cfg.check and cfg.policy == "adaptive:4" and cfg.on_uncorrectable == "raise"
    assert cfg.seed == 5
    assert abft_config_from_args(_args([]), "transformer_engine") is None  # off: TE is fine
    inject_only = abft_config_from_args(_args(["--mecefo-abft-inject", "kind=nan,iter=2"]))
    assert not inject_only.check and inject_only.inject == ("kind=nan,iter=2",)


def test_megatron_lm_default_te_is_refused_with_the_fix():
    with pytest.raises(AbftConfigError) as info:
        abft_config_from_args(_args(["--mecefo-abft"]), "transformer_engine", "raise")
    assert "--transformer-impl local" in str(info.value)
