"""The plugin's side of the Megatron-LM contract, single process (issue 12's regressions):
core_v0.19's flags that would build a wrong batch or gradient are refused, a builder's
``finalize_model_grads_func`` hook is wrapped once, the loader offset after a phase
transition, the flag checks run as Megatron-LM parses, ``MECEFO_PG_TIMEOUT_MIN`` becomes
``--distributed-timeout-minutes``, and a negative replica reaches the schedule check.

The core_v0.19.0 items cannot run here (megatron-core 0.19 needs Python 3.12): these tests
fake the shapes of Megatron-LM's parsed ``args`` and of its ``megatron.training.training``
module (three names and ``get_args``) and check the plugin's side of the contract.
"""

from __future__ import annotations

import argparse
import sys
import types
from typing import Any, List

import pytest
from conftest import child_env

from megatron_mecefo.cli import normalize_argv
from megatron_mecefo.megatron_lm import integration as integ
from megatron_mecefo.megatron_lm.integration import (
    MegatronLMIntegration,
    _validated_config,
    extra_args_provider,
)
from megatron_mecefo.takeover.arguments import add_arguments
from megatron_mecefo.takeover.config import MecefoConfigError


def _args(argv: List[str], **megatron: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=1234)
    args = add_arguments(parser).parse_args(argv)
    defaults = dict(
        data_parallel_size=4, hidden_size=256, train_iters=10, train_samples=None,
        global_batch_size=16, virtual_pipeline_model_parallel_size=None,
        calculate_per_token_loss=False, recompute_granularity=None, rampup_batch_size=None,
        dataloader_type="single", num_experts=None,
    )  # fmt: skip
    defaults.update(megatron)
    for key, value in defaults.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize(
    "megatron,flag",
    [
        ({"step_batch_size_schedule": "0:16,100:32"}, "--step-batch-size-schedule=0:16,100:32"),
        ({"hybrid_context_parallel": True}, "--hybrid-context-parallel"),
        ({"tensor_parallel_num_weight_shards": 4, "tensor_model_parallel_size": 2},
         "--tensor-parallel-num-weight-shards=4"),
    ],
)  # fmt: skip
def test_core_v0_19_flags_are_rejected(megatron: dict, flag: str) -> None:
    """Item 2: flags of 0.19 that would build a wrong batch layout or a wrong gradient."""
    with pytest.raises(MecefoConfigError) as err:
        _validated_config(_args(["--mecefo"], **megatron))
    assert flag in str(err.value)


def test_gtp_remat_size_is_not_dropped_silently() -> None:
    """Item 2: 0.19's _forward_impl passes gtp_remat_size; the low-rank path refuses > 1."""
    import torch

    from megatron_mecefo.techniques.lowrank_wgrad import _LowRankMixin

    layer = types.SimpleNamespace(mecefo_lowrank_active=True, training=True)
    weight = torch.zeros(2, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match="gtp_remat_size=2"):
        _LowRankMixin._forward_impl(layer, torch.zeros(1, 2), weight, gtp_remat_size=2)


class _Controller:
    """Stands in for MecefoController.wrap_finalize: records that the re-weighting ran."""

    def __init__(self) -> None:
        self.reweighted = 0

    def wrap_finalize(self, finalize: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            out = finalize(*a, **kw)
            self.reweighted += 1
            return out

        return run


def test_a_builder_installed_finalize_hook_is_wrapped() -> None:
    """Item 2 (core_v0.19 train() keeps a hook a builder set): the re-weighting still runs,
    through the builder's own hook, and is not wrapped twice."""
    integration = MegatronLMIntegration()
    integration.controller = ctrl = _Controller()
    calls: List[tuple] = []
    config = types.SimpleNamespace(finalize_model_grads_func=lambda *a, **kw: calls.append(a))
    hook = integration.finalize_hook(config)
    assert integration.finalize_hook(config) is hook is config.finalize_model_grads_func
    config.finalize_model_grads_func(["chunk"], None, force_all_reduce=True)
    assert calls == [(["chunk"], None)] and ctrl.reweighted == 1


def _fake_megatron_training(monkeypatch: pytest.MonkeyPatch, args: Any) -> types.ModuleType:
    """``megatron.training`` and ``megatron.training.training`` as far as the plugin uses
    them: the five wrapped names and ``get_args``."""
    training = types.ModuleType("megatron.training.training")
    training.loaders = []
    training.get_forward_backward_func = lambda *a, **kw: None
    training.finalize_model_grads = lambda *a, **kw: None
    training.build_pretraining_data_loader = lambda ds, consumed: training.loaders.append(consumed)
    training.save_checkpoint = lambda *a, **kw: None
    training.load_checkpoint = lambda *a, **kw: (0, 0)
    package = types.ModuleType("megatron.training")
    package.get_args = lambda: args
    package.training = training
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    return training


def test_phase_transition_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 1: resuming into phase 2 (transition at iteration 10, global batch 16), Megatron
    builds the training loader at consumed_train_samples_in_current_phase = 16 while
    consumed_train_samples is 176; absorbed micro-batches must be read at the loader's
    offset, 16 samples into the phase, not 176."""
    args = _args(["--mecefo", "--mecefo-fail", "1:12:15"])
    args.consumed_train_samples = 11 * 16
    training = _fake_megatron_training(monkeypatch, args)
    integration = MegatronLMIntegration()
    assert integration._setup(args)
    training.build_pretraining_data_loader(["dataset"], 16)  # train loader: phase-local
    training.build_pretraining_data_loader(["valid"], 0)
    assert training.loaders == [16, 0]
    assert integration.loader_offset == 160
    assert args.consumed_train_samples - integration.loader_offset == 16


def test_flag_checks_run_when_megatron_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 10: a bad --mecefo flag stops the run as Megatron-LM parses its flags (before its
    validate_args and any initialisation), with exit 2 and one line."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--mecefo", "--mecefo-fail", "7:2:5"])
    parser = argparse.ArgumentParser()
    for flag, default in (("--tensor-model-parallel-size", 1), ("--micro-batch-size", 2),
                          ("--hidden-size", 256), ("--train-iters", 10)):  # fmt: skip
        parser.add_argument(flag, type=int, default=default)
    for flag in ("--pipeline-model-parallel-size", "--context-parallel-size",
                 "--global-batch-size", "--train-samples"):  # fmt: skip
        parser.add_argument(flag, type=int, default=1 if "size" in flag else None)
    parser.set_defaults(global_batch_size=None, calculate_per_token_loss=False, seed=1234)
    parser = extra_args_provider()(parser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args()
    assert exit_info.value.code == 2


def test_pg_timeout_sets_megatron_lm_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 6: MECEFO_PG_TIMEOUT_MIN becomes --distributed-timeout-minutes, which Megatron-LM
    passes to init_process_group and to every group of initialize_model_parallel."""
    monkeypatch.setenv("MECEFO_PG_TIMEOUT_MIN", "1")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    args = argparse.Namespace(mecefo=False, distributed_timeout_minutes=10)
    for action in extra_args_provider()(argparse.ArgumentParser())._actions:
        if action.dest.startswith("mecefo_"):
            setattr(args, action.dest, action.default)
    integ.check_parsed_args(args)
    assert args.distributed_timeout_minutes == 1.0


def test_negative_replica_reaches_the_schedule_check() -> None:
    """Item 8: --mecefo-fail -1:5:10 used to be parsed as an option."""
    assert normalize_argv(["--mecefo-fail", "-1:5:10", "--lr", "-1"]) == [
        "--mecefo-fail=-1:5:10",
        "--lr",
        "-1",
    ]
    with pytest.raises(MecefoConfigError, match="replica -1"):
        _validated_config(_args(normalize_argv(["--mecefo", "--mecefo-fail", "-1:5:10"])))


def test_child_env_is_importable() -> None:
    assert "PYTHONPATH" in child_env()
