"""``--mecefo-fail-slow*`` in Megatron-LM's parser: the flags exist, and their start-up checks
stop a bad combination with one line as Megatron-LM parses (before any process group)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, List

import pytest

from megatron_mecefo.megatron_lm import flags
from megatron_mecefo.megatron_lm.flags import extra_args_provider, fail_slow_config


def _megatron_args(argv: List[str], **megatron: Any) -> argparse.Namespace:
    """Megatron-LM's parsed flags as far as the checks read them (a 2-layer model)."""
    parser = extra_args_provider()(argparse.ArgumentParser())
    args = parser.parse_args(argv)
    defaults = dict(
        num_layers=2, hidden_size=256, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, context_parallel_size=1, micro_batch_size=2,
        global_batch_size=8, train_iters=10, train_samples=None, seed=1234,
        calculate_per_token_loss=False, transformer_impl="local", iterations_to_skip=[],
    )  # fmt: skip
    defaults.update(megatron)
    for key, value in defaults.items():
        setattr(args, key, value)
    return args


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Any:
    def set_argv(argv: List[str], world: int = 2) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.delenv("MECEFO_RECOVERY", raising=False)
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])

    return set_argv


def _error_line(capsys: pytest.CaptureFixture, argv: List[str], **megatron: Any) -> str:
    args = _megatron_args(argv, **megatron)
    with pytest.raises(SystemExit) as stop:
        flags.check_parsed_args(args)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    "argv,megatron,words",
    [
        (["--mecefo-fail-slow", "rebalance"], {}, ["without --mecefo", "add --mecefo"]),
        (["--mecefo-fail-slow", "detect"], {}, ["without --mecefo", "would be ignored"]),
        (["--mecefo-fail-slow-threshold", "1.5"], {}, ["--mecefo-fail-slow-threshold",
                                                        "without --mecefo"]),
        (["--mecefo", "--mecefo-fail-slow-threshold", "0.9"], {}, ["above 1"]),
        (["--mecefo", "--mecefo-fail-slow-window", "0"], {}, ["from 1 to 1000"]),
        (["--mecefo", "--mecefo-fail-slow", "rebalance"],
         {"num_layers_per_virtual_pipeline_stage": 1, "pipeline_model_parallel_size": 2},
         ["interleaved schedule"]),
    ],
)  # fmt: skip
def test_bad_fail_slow_flags_stop_with_one_line(
    ranks: Any, capsys: pytest.CaptureFixture, argv: List[str], megatron: dict, words: List[str]
) -> None:
    ranks(argv, world=4)
    line = _error_line(capsys, argv, **megatron)
    for word in words:
        assert word in line, line


def test_good_fail_slow_flags(ranks: Any) -> None:
    argv = ["--mecefo", "--mecefo-fail-slow", "rebalance", "--mecefo-fail-slow-window", "3"]
    ranks(argv)
    args = _megatron_args(argv)
    flags.check_parsed_args(args)  # no exit
    args.data_parallel_size = 2
    config = fail_slow_config(args)
    assert (config.mode, config.threshold, config.window) == ("rebalance", 1.3, 3)
    # Without --mecefo and no fail-slow flag: the default (detect) is simply not run.
    ranks([])
    flags.check_parsed_args(_megatron_args([]))
    # At DP1 rebalancing has nobody to give to: a warning, not an error.
    ranks(argv, world=1)
    warnings: List[str] = []
    args.data_parallel_size = 1
    fail_slow_config(args, warnings)
    assert len(warnings) == 1 and "data-parallel size of 1" in warnings[0], warnings
