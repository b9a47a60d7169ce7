"""The in-process recovery's Megatron-LM side where it differs between tags, single process.

core_v0.19.0 cannot run here (megatron-core 0.19 needs Python 3.12). There
``pretrain_gpt.py`` parses and validates the flags *before* ``pretrain()``, which then reads
them from Megatron-LM's globals; the recovery must take those flags instead of parsing, and
set the globals again before each re-entry (its release destroys them, as Megatron-LM's own
in-process restart does). These tests fake ``megatron.training``'s ``global_vars``,
``arguments`` and ``inprocess_restart`` and check the plugin's side of that contract, and the
patches' call site for both tags.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
from typing import Any, Dict, List

import pytest
from conftest import REPO

from megatron_mecefo.megatron_lm import recovery as mlm_recovery

PATCHES = REPO / "patches"


def _megatron_args(**over: Any) -> argparse.Namespace:
    base = dict(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=2, context_parallel_size=1,
        global_batch_size=16, micro_batch_size=2, train_iters=20, train_samples=None,
        seed=1234, save=None, load=None, use_distributed_optimizer=False, mecefo=True,
        mecefo_kill=["1:3:backward"], mecefo_seed=None, mecefo_grad_error_interval=0,
        rank=5, world_size=6,
    )  # fmt: skip
    base.update(over)
    args = argparse.Namespace(**base)
    from megatron_mecefo.takeover.arguments import add_arguments

    for key, value in vars(add_arguments(argparse.ArgumentParser()).parse_args([])).items():
        if not hasattr(args, key):
            setattr(args, key, value)
    return args


def _fake_training(monkeypatch: pytest.MonkeyPatch, parsed: Any) -> Dict[str, List[Any]]:
    """Fake megatron.training: global_vars (holding ``parsed``), arguments, inprocess_restart."""
    calls: Dict[str, List[Any]] = {"parse_args": [], "set_global_variables": [], "wrap": []}
    package = types.ModuleType("megatron.training")
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_ARGS = parsed

    def set_global_variables(args: Any, build_tokenizer: bool = True) -> None:
        calls["set_global_variables"].append((args.rank, args.world_size))
        global_vars._GLOBAL_ARGS = args

    global_vars.set_global_variables = set_global_variables
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.parse_args = lambda *a, **k: calls["parse_args"].append(a) or _megatron_args()
    inprocess = types.ModuleType("megatron.training.inprocess_restart")
    inprocess.maybe_wrap_for_inprocess_restart = lambda f: calls["wrap"].append(f) or (f, None)
    package.global_vars, package.arguments = global_vars, arguments
    package.inprocess_restart = inprocess
    for name, module in (
        ("megatron.training", package),
        ("megatron.training.global_vars", global_vars),
        ("megatron.training.arguments", arguments),
        ("megatron.training.inprocess_restart", inprocess),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def _capture_run(monkeypatch: pytest.MonkeyPatch) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    from megatron_mecefo.recovery import generations

    def run_recoverable(job: Any, make_trainer: Any, **_: Any) -> None:
        seen["job"], seen["make_trainer"] = job, make_trainer

    monkeypatch.setattr(generations, "run_recoverable", run_recoverable)
    from megatron_mecefo.megatron_lm import integration

    monkeypatch.setattr(integration, "_CURRENT", integration.MegatronLMIntegration())
    return seen


@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.19.0"])
def test_patch_call_site_is_megatron_lm_or_mecefo(tag: str) -> None:
    """One line at Megatron-LM's own re-entry point, for both tags."""
    text = (PATCHES / f"megatron-lm-{tag}.patch").read_text()
    line = "+    pretrain, store = (mecefo or inprocess_restart).maybe_wrap_for_inprocess_restart("
    assert line + "pretrain)" in text.splitlines()
    assert re.search(r"^-    pretrain, store = inprocess_restart\.maybe_wrap", text, re.M)


def test_core_v0_19_takes_the_parsed_flags_and_sets_them_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed = _megatron_args()
    calls = _fake_training(monkeypatch, parsed)
    seen = _capture_run(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "8")
    mlm_recovery.run_pretrain(lambda *a, **k: None, ("cfg",), {"store": None})
    assert calls["parse_args"] == []  # the flags pretrain_gpt.py parsed, not parsed again
    job = seen["job"]
    assert (job.data_parallel_size, job.global_batch_size, job.train_iters) == (4, 16, 20)
    assert job.mecefo_kill == ["1:3:backward"]
    # The next generation: the release destroyed the globals; train() sets them again with
    # this world's rank and the job's world size (the original data-parallel view).
    session = types.SimpleNamespace(rank=3, generation=1)
    trainer = seen["make_trainer"](session)
    sys.modules["megatron.training.global_vars"]._GLOBAL_ARGS = None
    trainer._restore_global_args()
    assert calls["set_global_variables"] == [(3, 8)]
    trainer._restore_global_args()  # globals present (the first generation): left alone
    assert calls["set_global_variables"] == [(3, 8)]


def test_core_v0_16_parses_as_pretrain_will(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_training(monkeypatch, None)
    seen = _capture_run(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "4")
    provider = object()
    mlm_recovery.run_pretrain(lambda *a, **k: None, (), {"extra_args_provider": provider})
    assert calls["parse_args"] == [(provider,)]
    assert seen["make_trainer"](types.SimpleNamespace(rank=0))._parsed_args is None


def test_outside_the_supervisor_megatron_lm_wraps(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_training(monkeypatch, None)
    monkeypatch.delenv("MECEFO_RECOVERY", raising=False)

    def pretrain() -> None:
        pass

    assert mlm_recovery.maybe_wrap_for_inprocess_restart(pretrain) == (pretrain, None)
    assert calls["wrap"] == [pretrain]


def test_nvrx_inprocess_restart_is_refused_under_the_supervisor(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _fake_training(monkeypatch, None)
    monkeypatch.setenv("MECEFO_RECOVERY", "{}")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--inprocess-restart", "--mecefo"])
    with pytest.raises(SystemExit) as exit_info:
        mlm_recovery.maybe_wrap_for_inprocess_restart(lambda: None)
    assert exit_info.value.code == 2
    err = capsys.readouterr()
    line = (err.out + err.err).strip().splitlines()
    assert len(line) == 1 and "--inprocess-restart" in line[0] and "drop" in line[0]
