"""The Megatron-LM integration in one process: the patch files, the flag provider and the
start-up checks. The patched Megatron-LM itself runs in
``tests/integration/megatron_lm/test_patched_megatron_lm.py``."""

from __future__ import annotations

import argparse
import re

import pytest
from conftest import REPO

from megatron_mecefo.megatron_lm.integration import _validated_config, extra_args_provider
from megatron_mecefo.takeover.config import MecefoConfigError

PATCHES = REPO / "patches"


@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.19.0"])
def test_patch_touches_only_pretrain_gpt(tag: str) -> None:
    text = (PATCHES / f"megatron-lm-{tag}.patch").read_text()
    assert re.findall(r"^diff --git a/(\S+) b/", text, re.M) == ["pretrain_gpt.py"]
    added = [line for line in text.splitlines() if line.startswith("+") and line[1:2] != "+"]
    removed = [line for line in text.splitlines() if line.startswith("-") and line[1:2] != "-"]
    assert len(added) <= 14 and len(removed) <= 2, (len(added), len(removed))
    assert "megatron_mecefo" in text and "except ImportError" in text  # optional import


def _parser() -> argparse.ArgumentParser:
    def modelopt(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--other-flag", type=int, default=3)
        return parser

    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=1234)
    return extra_args_provider(modelopt)(parser)


def _args(argv: list[str], **megatron: object) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    defaults = dict(
        data_parallel_size=4,
        hidden_size=256,
        train_iters=10,
        train_samples=None,
        global_batch_size=16,
        virtual_pipeline_model_parallel_size=None,
        calculate_per_token_loss=False,
        recompute_granularity=None,
        rampup_batch_size=None,
        dataloader_type="single",
        num_experts=None,
    )
    defaults.update(megatron)
    for key, value in defaults.items():
        setattr(args, key, value)
    return args


def test_extra_args_provider_keeps_the_other_provider() -> None:
    args = _args(["--other-flag", "5", "--mecefo", "--mecefo-fail", "1:2:5"])
    assert args.other_flag == 5 and args.mecefo and args.mecefo_fail == ["1:2:5"]
    ft = _validated_config(args)
    assert ft.enabled and ft.policy == "neighbor" and ft.failure_schedule == "scripted"
    assert not _validated_config(_args([])).enabled


@pytest.mark.parametrize(
    "argv,megatron,flag",
    [
        (["--mecefo"], {"rampup_batch_size": [4, 4, 100]}, "--rampup-batch-size"),
        (["--mecefo"], {"dataloader_type": "cyclic"}, "--dataloader-type=cyclic"),
        (["--mecefo", "--mecefo-grad-error-interval", "5"], {}, "--mecefo-grad-error-interval=5"),
        (["--mecefo"], {"num_experts": 8}, "--num-experts"),
        (["--mecefo", "--mecefo-fail", "4:2:5"], {}, "--mecefo-fail"),
        (["--mecefo", "--mecefo-rank", "512"], {}, "--mecefo-rank=512"),
        (["--mecefo"], {"data_parallel_size": 1}, "--mecefo-policy=neighbor"),
        (["--mecefo-policy", "drop"], {}, "--mecefo-policy=drop was given without --mecefo"),
        (
            ["--mecefo"] + [f"--mecefo-fail={r}:3:4" for r in range(4)],
            {},
            "every replica down at iteration 3",
        ),
    ],
)
def test_megatron_lm_start_up_errors(argv: list[str], megatron: dict, flag: str) -> None:
    with pytest.raises(MecefoConfigError) as info:
        _validated_config(_args(argv, **megatron))
    assert flag in str(info.value), str(info.value)
